"""Regenerate the real Slurm output samples in this directory (see README.md here).

    cd <repo> && PYTHONPATH=$PWD python tests/data/slurm/make_samples.py [OUTDIR]

Starts the test suite's two-node cluster (tests/slurm_cluster.py) in a temp dir, provokes each job state and
saves what the clients print for it. Takes about a minute and a half (TIMEOUT waits for slurmctld's 30 s check).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/

from slurm_cluster import FINAL_STATES, SlurmCluster, start_slurm_cluster  # noqa: E402

#: the backend's batched status call: state, reason, nodes, limit, start time and raw exit status per job
STATUS_FORMAT = "JobID:|,State:|,Reason:|,NodeList:|,TimeLimit:|,StartTime:|,exit_code:"
PERCENT_FORMAT = "%i|%T|%r|%N|%l|%S"
SACCT_FORMAT = "JobID,State,ExitCode,DerivedExitCode,Start,End,Timelimit,NodeList"


def ok(cluster: SlurmCluster, *argv: str) -> str:
    result = cluster.run(*argv, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: rc {result.returncode}\n{result.stderr}")
    return result.stdout


def submit(cluster: SlurmCluster, work: Path, *args: str, script: str = "sleep 300") -> str:
    return ok(cluster, "sbatch", "--parsable", f"--output={work}/%j.out", *args, f"--wrap={script}").strip()


def state(cluster: SlurmCluster, job: str) -> str:
    return ok(cluster, "squeue", "--noheader", "--states=all", f"--jobs={job}", "--format=%T").strip()


def wait(cluster: SlurmCluster, job: str, wanted: set[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while state(cluster, job) not in wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} still {state(cluster, job)}, wanted {wanted}")
        time.sleep(0.5)


def capture(cluster: SlurmCluster, out: Path, name: str, job: str) -> None:
    """Every view of one job: fixed-format squeue (-O and %), its squeue --json entry, scontrol, sacct -c."""
    (out / f"{name}.squeue.txt").write_text(ok(
        cluster, "squeue", "--noheader", "--states=all", f"--jobs={job}", "-O", STATUS_FORMAT))
    (out / f"{name}.squeue-percent.txt").write_text(ok(
        cluster, "squeue", "--noheader", "--states=all", f"--jobs={job}", f"--format={PERCENT_FORMAT}"))
    document = json.loads(ok(cluster, "squeue", "--json"))
    document["jobs"] = [j for j in document["jobs"] if str(j["job_id"]) == job]
    (out / f"{name}.squeue.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / f"{name}.scontrol.txt").write_text(ok(cluster, "scontrol", "show", "job", "--oneliner", job))
    if state(cluster, job) in FINAL_STATES:
        (out / f"{name}.sacct.txt").write_text(ok(
            cluster, "sacct", "--completion", f"--jobs={job}", "--parsable2", f"--format={SACCT_FORMAT}"))


def main(out: Path) -> None:  # noqa: C901 - one straight recipe, state after state
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pbstk-slurm-samples-") as tmp, \
            start_slurm_cluster(Path(tmp) / "cluster") as cluster:
        work = Path(tmp) / "work"
        work.mkdir()
        jobs = {
            "pending": submit(cluster, work, "--begin=now+3600"),
            "pending-resources": submit(cluster, work, "--nodes=2", "--gres=gpu:4", "--begin=now+2"),
            "running": submit(cluster, work, "--nodelist=n1", "--time=30"),
            "running-two-nodes": submit(cluster, work, "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:4"),
            "completed": submit(cluster, work, script="true"),
            "failed": submit(cluster, work, script="exit 3"),
            "cancelled": submit(cluster, work),
            "timeout": submit(cluster, work, "--time=1"),
        }
        jobs["pending-dependency"] = submit(cluster, work, f"--dependency=after:{jobs['pending']}")
        for name in ("running", "running-two-nodes", "cancelled", "timeout"):
            wait(cluster, jobs[name], {"RUNNING"})
        time.sleep(4)  # pending-resources: eligible now, but every GPU is taken by running-two-nodes
        ok(cluster, "scancel", jobs["cancelled"])
        ok(cluster, "scontrol", "update", f"JobId={jobs['timeout']}", "EndTime=now+1")
        for name in ("completed", "failed", "cancelled", "timeout"):
            wait(cluster, jobs[name], FINAL_STATES)
        for name in ("pending", "pending-dependency", "pending-resources", "running", "running-two-nodes",
                     "completed", "failed", "cancelled", "timeout"):
            capture(cluster, out, name, jobs[name])
        ok(cluster, "scancel", jobs["running-two-nodes"], jobs["pending-resources"], jobs["pending-dependency"])
        wait(cluster, jobs["running-two-nodes"], FINAL_STATES)

        # NODE_FAIL: the node under a running job is set DOWN by the admin. A batch job is requeued by default
        # (back to PENDING, Restarts=1); only a --no-requeue job ends NODE_FAIL.
        jobs["node_fail"] = submit(cluster, work, "--nodelist=n2", "--no-requeue")
        jobs["node_fail-requeued"] = submit(cluster, work, "--nodelist=n2")
        wait(cluster, jobs["node_fail"], {"RUNNING"})
        wait(cluster, jobs["node_fail-requeued"], {"RUNNING"})
        ok(cluster, "scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=pbstk-sample")
        wait(cluster, jobs["node_fail"], FINAL_STATES)
        wait(cluster, jobs["node_fail-requeued"], {"PENDING"})
        capture(cluster, out, "node_fail", jobs["node_fail"])
        capture(cluster, out, "node_fail-requeued", jobs["node_fail-requeued"])
        ok(cluster, "scancel", jobs["node_fail-requeued"])
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")  # refused if already back (ReturnToService)

        # PREEMPTED: a job of the higher-tier partition "urgent" needs the whole node a debug job holds
        ok(cluster, "scancel", jobs["running"], jobs["pending"])
        wait(cluster, jobs["running"], FINAL_STATES)
        jobs["preempted"] = submit(cluster, work, "--nodelist=n1", "--exclusive")
        wait(cluster, jobs["preempted"], {"RUNNING"})
        urgent = submit(cluster, work, "--partition=urgent", "--nodelist=n1", "--exclusive", script="sleep 5")
        wait(cluster, jobs["preempted"], FINAL_STATES)
        capture(cluster, out, "preempted", jobs["preempted"])
        wait(cluster, urgent, FINAL_STATES)

        # the backend's real call: one squeue for every id
        ids = ",".join(jobs.values())
        (out / "batch.squeue.txt").write_text(ok(
            cluster, "squeue", "--noheader", "--states=all", f"--jobs={ids}", "-O", STATUS_FORMAT))
        (out / "batch.sacct.txt").write_text(ok(
            cluster, "sacct", "--completion", f"--jobs={ids}", "--parsable2", f"--format={SACCT_FORMAT}"))
        (out / "jobs.json").write_text(json.dumps(jobs, indent=2) + "\n")
        known = jobs["completed"]
        errors = [cluster.run(*argv, timeout=60) for argv in (
            ["squeue", "--noheader", "--states=all", "--jobs=99999", "-O", STATUS_FORMAT],
            ["squeue", "--noheader", "--states=all", "--jobs=99998,99999", "-O", STATUS_FORMAT],
            ["squeue", "--noheader", "--states=all", f"--jobs={known},99999", "-O", STATUS_FORMAT],
            ["squeue", "--noheader", "--states=all", "--jobs=abc", "-O", STATUS_FORMAT],
            ["scontrol", "show", "job", "--oneliner", "99999"],
            ["sacct", "--completion", "--jobs=99999", "--parsable2", f"--format={SACCT_FORMAT}"],
            ["scancel", "99999"],
            ["scancel", known],
            ["sbatch", "--parsable", "--partition=nosuch", "--wrap=true"],
            ["sbatch", "--parsable", "--gres=gpu:5", "--wrap=true"],
        )]
        (out / "errors.json").write_text(json.dumps(
            [{"argv": r.args, "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr} for r in errors],
            indent=2) + "\n")
        cluster.cancel_all()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
