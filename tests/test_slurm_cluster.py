"""The real Slurm fixture behaves the way a Slurm user (and pbstk's Slurm backend) expects: submission, the
state and exit-code queries, time limits, cancel, two-node steps, fake GPUs, dependencies and begin times.

These tests pin down the facts the backend's parsers rely on (Slurm 22.05 here): ``squeue --json`` exists but
ignores ``--jobs``; ``-O exit_code`` and the JSON ``exit_code`` are raw wait statuses (exit 3 -> 768); the
``%``-style ``--format`` has no exit code at all.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import slurm_cluster as fixture_module
from helpers import wait_for
from slurm_cluster import FINAL_STATES, SlurmCluster, SlurmStartError, start_slurm_cluster

#: the one batched status call (state, reason, nodes, time limit, start time, exit status) for a list of ids
STATUS_FORMAT = "JobID:|,State:|,Reason:|,NodeList:|,TimeLimit:|,StartTime:|,exit_code:"


def sbatch(cluster: SlurmCluster, tmp_path: Path, *args: str, script: str = "true") -> str:
    result = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%j.out", *args, f"--wrap={script}")
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert job_id.isdigit(), result.stdout  # --parsable: the id alone (no ";cluster" without federation)
    return job_id


def status(cluster: SlurmCluster, *ids: str) -> dict[str, dict[str, str]]:
    """The fixed-format batched query: one squeue call for all ``ids``."""
    result = cluster.run("squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}", "-O", STATUS_FORMAT)
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        job, state, reason, nodes, limit, start, exit_status = (f.strip() for f in line.split("|"))
        rows[job] = {"state": state, "reason": reason, "nodes": nodes, "limit": limit, "start": start,
                     "exit": exit_status}
    return rows


def state_of(cluster: SlurmCluster, job_id: str) -> str:
    return status(cluster, job_id).get(job_id, {}).get("state", "")


def wait_state(cluster: SlurmCluster, job_id: str, wanted: set[str], timeout: float = 30) -> dict[str, str]:
    def check() -> dict[str, str] | None:
        row = status(cluster, job_id).get(job_id)
        return row if row and row["state"] in wanted else None

    return wait_for(check, timeout=timeout, what=f"job {job_id} in {sorted(wanted)}", interval=0.3)


def test_both_nodes_idle_with_four_gpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "--noheader", "--Node", "--partition=debug", "--format=%N %G").stdout
    nodes = dict(line.split() for line in out.splitlines())
    assert nodes == {"n1": "gpu:4", "n2": "gpu:4"}
    assert slurm_cluster.partition == "debug" and slurm_cluster.nodes == ["n1", "n2"]
    assert set(slurm_cluster.env) == {"SLURM_CONF", "PATH"}
    shown = slurm_cluster.run("scontrol", "show", "node", "--oneliner", "n2").stdout
    assert "NodeAddr=127.0.0.3 " in shown and slurm_cluster.node_addresses == {"n1": "127.0.0.2", "n2": "127.0.0.3"}


def test_batch_job_runs_writes_output_and_squeue_shows_it(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, tmp_path, "--nodelist=n1", "--job-name=pbstk-probe",
                 script='echo "node=$SLURMD_NODENAME id=$SLURM_JOB_ID"; sleep 3')
    row = wait_state(slurm_cluster, job, {"RUNNING"})
    # no --time: UNLIMITED, or 365 days when the backfill scheduler started it (preemption is configured)
    assert row["nodes"] == "n1" and row["reason"] == "None" and row["limit"] in {"UNLIMITED", "365-00:00:00"}

    listing = json.loads(slurm_cluster.run("squeue", "--json").stdout)
    ours = [j for j in listing["jobs"] if str(j["job_id"]) == job]
    assert ours and ours[0]["job_state"] == "RUNNING" and ours[0]["nodes"] == "n1"
    assert ours[0]["name"] == "pbstk-probe"
    assert listing["meta"]["Slurm"]["release"].startswith("22.")

    row = wait_state(slurm_cluster, job, {"COMPLETED"})
    assert row["exit"] == "0"
    assert (tmp_path / f"{job}.out").read_text() == f"node=n1 id={job}\n"


def test_squeue_json_ignores_the_job_filter(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Slurm 22.05: ``squeue --json --jobs=X`` lists every job, so a JSON parser must filter by id itself."""
    first = sbatch(slurm_cluster, tmp_path)
    second = sbatch(slurm_cluster, tmp_path)
    listing = json.loads(slurm_cluster.run("squeue", "--json", f"--jobs={first}").stdout)
    assert {first, second} <= {str(j["job_id"]) for j in listing["jobs"]}


def test_exit_code_is_a_raw_wait_status(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, tmp_path, script="exit 3")
    row = wait_state(slurm_cluster, job, FINAL_STATES)
    assert (row["state"], row["reason"], row["exit"]) == ("FAILED", "NonZeroExitCode", str(3 << 8))
    listing = json.loads(slurm_cluster.run("squeue", "--json").stdout)
    (entry,) = [j for j in listing["jobs"] if str(j["job_id"]) == job]
    assert entry["exit_code"] == 3 << 8
    assert "ExitCode=3:0" in slurm_cluster.run("scontrol", "show", "job", "--oneliner", job).stdout
    # jobcomp/filetxt makes ``sacct --completion`` answer for finished jobs (plain sacct has no database here)
    sacct = slurm_cluster.run("sacct", "--completion", f"--jobs={job}", "--noheader", "--parsable2",
                              "--format=JobID,State,ExitCode")
    assert sacct.stdout.splitlines() == [f"{job}|FAILED|3:0"]


def test_cancel_gives_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, tmp_path, script="sleep 60")
    wait_state(slurm_cluster, job, {"RUNNING"})
    assert slurm_cluster.run("scancel", job).returncode == 0
    row = wait_state(slurm_cluster, job, {"CANCELLED"}, timeout=20)
    assert row["state"] == "CANCELLED"


def test_time_limit_gives_timeout(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Slurm's smallest time limit is one minute (``--time=0:05`` becomes 1:00); moving the job's end time
    closer gives TIMEOUT within slurmctld's 30 s enforcement period."""
    job = sbatch(slurm_cluster, tmp_path, "--time=0:05", script="sleep 120")
    row = wait_state(slurm_cluster, job, {"RUNNING"})
    assert row["limit"] == "1:00"
    assert slurm_cluster.run("scontrol", "update", f"JobId={job}", "EndTime=now+2").returncode == 0
    row = wait_state(slurm_cluster, job, FINAL_STATES, timeout=60)
    assert (row["state"], row["reason"]) == ("TIMEOUT", "TimeLimit")


def test_srun_on_two_nodes_reports_both(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.run(
        "srun", "--nodes=2", "--ntasks-per-node=1", "--label",
        "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_NODEID $SLURM_NNODES"', timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["0: n1 0 2", "1: n2 1 2"]


def test_gres_gpu_is_accepted_and_sets_gpus_on_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Fake GPUs (plain files): Slurm sets SLURM_GPUS_ON_NODE but no CUDA_VISIBLE_DEVICES."""
    job = sbatch(slurm_cluster, tmp_path, "--gres=gpu:2",
                 script='echo "gpus=$SLURM_GPUS_ON_NODE cuda=${CUDA_VISIBLE_DEVICES-unset}"')
    wait_state(slurm_cluster, job, {"COMPLETED"})
    assert (tmp_path / f"{job}.out").read_text() == "gpus=2 cuda=unset\n"
    too_many = slurm_cluster.run("sbatch", "--gres=gpu:5", "--wrap=true")
    assert too_many.returncode != 0 and "Requested node configuration is not available" in too_many.stderr


def test_begin_time_holds_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    submitted = time.time()
    job = sbatch(slurm_cluster, tmp_path, "--begin=now+8", script="date +%s")
    row = status(slurm_cluster, job)[job]
    assert (row["state"], row["reason"]) == ("PENDING", "BeginTime")
    wait_state(slurm_cluster, job, {"COMPLETED"}, timeout=40)
    started = int((tmp_path / f"{job}.out").read_text())
    assert started >= int(submitted) + 7


def test_dependency_after_start(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``after:A``: B waits (reason Dependency) while A is pending and starts once A has started."""
    first = sbatch(slurm_cluster, tmp_path, "--begin=now+4", script="date +%s; sleep 30")
    second = sbatch(slurm_cluster, tmp_path, f"--dependency=after:{first}", script="date +%s")
    row = status(slurm_cluster, second)[second]
    assert (row["state"], row["reason"]) == ("PENDING", "Dependency")
    wait_state(slurm_cluster, second, {"COMPLETED"}, timeout=40)
    assert int((tmp_path / f"{second}.out").read_text()) >= int((tmp_path / f"{first}.out").read_text())
    slurm_cluster.run("scancel", first)


def test_cancel_all_leaves_nothing_running(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    jobs = [sbatch(slurm_cluster, tmp_path, script="sleep 60") for _ in range(3)]
    slurm_cluster.cancel_all()
    assert slurm_cluster.active_jobs() == []
    assert {status(slurm_cluster, *jobs)[j]["state"] for j in jobs} == {"CANCELLED"}


def test_missing_packages_skip_unless_required(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fixture_module, "DAEMONS", {**fixture_module.DAEMONS, "slurmd": "/nonexistent/slurmd"})
    monkeypatch.setattr(fixture_module, "REQUIRE_SLURM", False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install slurmctld slurmd slurm-client munge"), \
            start_slurm_cluster(tmp_path):
        pass
    monkeypatch.setattr(fixture_module, "REQUIRE_SLURM", True)
    with pytest.raises(pytest.fail.Exception, match="PBSTK_TEST_REQUIRE_SLURM=1 forbids skipping"), \
            start_slurm_cluster(tmp_path):
        pass


def test_a_daemon_that_dies_is_named_with_its_log(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """A broken slurm.conf: slurmctld exits at once; the error names it and shows its log, and the munged that
    was already started is stopped again."""
    good = fixture_module.slurm_conf
    monkeypatch.setattr(fixture_module, "slurm_conf", lambda *a: good(*a) + "NoSuchOption=1\n")
    with pytest.raises(SlurmStartError, match=r"(?s)slurmctld exited with status \d+.*NoSuchOption"), \
            start_slurm_cluster(tmp_path / "broken", timeout=20):
        pass
    assert "Created socket" in (tmp_path / "broken" / "munge" / "munged.log").read_text()  # munged did start
    assert _processes_mentioning(str(tmp_path)) == []


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            found.append(argv)
    return found


def test_a_port_taken_before_slurmctld_binds_it_is_retried(slurm_cluster: SlurmCluster,
                                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another session may take the port picked free before slurmctld binds it: the start is tried once more
    with new ports (in ``root/retry1``) instead of failing."""
    real = fixture_module._free_ports
    picks: list[list[int]] = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()

        def first_taken(count: int) -> list[int]:
            ports = real(count)
            picks.append([busy.getsockname()[1], *ports[1:]] if not picks else ports)
            return picks[-1]

        monkeypatch.setattr(fixture_module, "_free_ports", first_taken)
        with start_slurm_cluster(tmp_path, timeout=30) as second:
            assert second.root == tmp_path / "retry1"
            assert "Address already in use" in (tmp_path / "slurmctld.log").read_text()
            out = second.run("sinfo", "--noheader", "--Node", "--format=%N %T").stdout
            assert sorted(set(out.split())) == ["idle", "n1", "n2"]
    assert len(picks) == 2
    assert _processes_mentioning(str(tmp_path)) == []


def test_steps_inside_a_two_node_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """What a per-node launcher in a job script can rely on: the node list, one step for all nodes (SLURM_NODEID
    is the node's index), per-node steps with ``-w`` in parallel (``--overlap``; their SLURM_NODEID is 0), and
    each node's address from ``scontrol show node``. ``hostname`` is this machine's on both nodes."""
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n"
        'echo "batch $SLURMD_NODENAME $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,) $(hostname)"\n'
        "srun --ntasks-per-node=1 bash -c 'echo \"all $SLURMD_NODENAME $SLURM_NODEID\"' | sort\n"
        "for node in n2 n1; do\n"
        "  srun --nodes=1 --ntasks=1 -w \"$node\" --overlap bash -c 'echo \"one $SLURMD_NODENAME $SLURM_NODEID "
        "$SLURM_GPUS_ON_NODE $(scontrol show node \"$SLURMD_NODENAME\" -o | grep -o \"NodeAddr=[^ ]*\")\"; "
        "sleep 2' > \"$node.step\" &\n"
        "done\nwait\ncat n1.step n2.step\n"
    )
    result = slurm_cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out",
                               str(script))
    job = result.stdout.strip()
    wait_state(slurm_cluster, job, {"COMPLETED"}, timeout=60)
    assert (tmp_path / f"{job}.out").read_text().splitlines() == [
        f"batch n1 n1,n2 {socket.gethostname()}",
        "all n1 0", "all n2 1",
        "one n1 0 4 NodeAddr=127.0.0.2", "one n2 0 4 NodeAddr=127.0.0.3",
    ]


def test_jobs_a_failed_cancel_left_running_are_stopped_with_the_cluster(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """slurmstepd detaches from slurmd: without a final sweep, a job that scancel did not stop would outlive the
    session (with its slurmstepd). Every process carrying the cluster's SLURM_CONF is stopped at the end."""
    monkeypatch.setattr(SlurmCluster, "cancel_all", lambda self, timeout=30: None)
    with start_slurm_cluster(tmp_path, timeout=30) as cluster:
        daemons = len(fixture_module.cluster_processes(tmp_path))
        job = sbatch(cluster, tmp_path, script="sleep 300")
        wait_state(cluster, job, {"RUNNING"})
        wait_for(lambda: len(fixture_module.cluster_processes(tmp_path)) >= daemons + 3, timeout=10,
                 what="the job's processes (slurmstepd, its shell, sleep)")
    wait_for(lambda: fixture_module.cluster_processes(tmp_path) == [], timeout=5, what="no process left")
