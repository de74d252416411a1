"""The Slurm backend without a cluster: its parsers on answers captured from a real Slurm 22.05.8 (the fixture's
cluster), its state mapping, the #SBATCH directives it renders and the values it refuses to put there.

The cluster itself (launch -> READY -> logs -> cancel, a time limit, two nodes) is tests/test_slurm_real.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.errors import ConfigError, SchedulerError, SchedulerUnavailable, UsageError
from pbs_toolkit.schedulers import BACKENDS, JobRef, Outcome, SchedState
from pbs_toolkit.schedulers.slurm import (
    FIELDS,
    SlurmScheduler,
    cancel_argv,
    exit_parts,
    first_host,
    outcome,
    parse_job_id,
    parse_status,
    status_argv,
    submit_argv,
)
from pbs_toolkit.transports.base import Result

# `squeue --noheader --states=all --jobs=... --Format=<FORMAT>` on Slurm 22.05.8, Debian 12 (test cluster; captured
# with TimeUsed as the 5th column, shown here in FORMAT's current order):
# 4 cancelled while pending (--begin), 6 `pbstk cancel` of a running job (its script exited 143), 8 exit 0,
# 1 `exit 3`, 7 `kill -9 $$`, 3 pending until its --begin time, 9 running, 2 over its 1-minute time limit.
SAMPLE = """\
4|CANCELLED|BeginTime||UNLIMITED|2026-11-23T11:39:48|0|0:00|
6|CANCELLED|None|n1|10:00|2026-11-23T11:43:24|36608|0:02|
8|COMPLETED|None|n1|UNLIMITED|2026-11-23T11:43:35|0|0:00|
1|FAILED|NonZeroExitCode|n1|1:00|2026-11-23T11:39:32|768|0:03|
7|FAILED|JobLaunchFailure|n1|UNLIMITED|2026-11-23T11:43:35|9|0:00|
3|PENDING|BeginTime||UNLIMITED|2026-11-23T11:49:32|0|0:00|
9|RUNNING|None|n1|UNLIMITED|2026-11-23T11:43:35|0|0:03|
2|TIMEOUT|TimeLimit|n1|1:00|2026-11-23T11:39:32|15|1:19|
"""
#: when the sample was taken (its pending job's StartTime is 6 minutes later)
ASKED_AT = time.mktime(time.strptime("2026-11-23T11:43:38", "%Y-%m-%dT%H:%M:%S"))


def test_registered() -> None:
    assert BACKENDS["slurm"] is SlurmScheduler


def test_parse_status_real_sample() -> None:
    jobs = parse_status(SAMPLE, ASKED_AT)
    assert sorted(jobs, key=int) == ["1", "2", "3", "4", "6", "7", "8", "9"]
    got = {j: (jobs[j].state, jobs[j].outcome, jobs[j].outcome_code) for j in jobs}
    assert got == {
        "4": (SchedState.FINISHED, Outcome.NEVER_RAN, None),
        "6": (SchedState.FINISHED, Outcome.CANCELLED, 143),
        "8": (SchedState.FINISHED, Outcome.EXITED, 0),
        "1": (SchedState.FINISHED, Outcome.EXITED, 3),
        "7": (SchedState.FINISHED, Outcome.KILLED, 9),
        "3": (SchedState.QUEUED, None, None),
        "9": (SchedState.RUNNING, None, None),
        "2": (SchedState.FINISHED, Outcome.WALLTIME, None),
    }
    pending, running, timed_out = jobs["3"], jobs["9"], jobs["2"]
    assert pending.comment == "BeginTime" and pending.estimated_start == ASKED_AT + 354
    assert running.uptime_s == 3.0 and running.exec_host == "n1" and running.walltime_s is None
    assert running.comment is None and running.estimated_start is None
    assert timed_out.walltime_s == 60 and timed_out.comment == "TimeLimit" and timed_out.uptime_s is None


DATA = Path(__file__).parent / "data" / "slurm"
#: sample (tests/data/slurm, SLURMFIX's real Slurm output) -> (state, outcome, outcome code, comment)
EXPECTED = {
    "pending": (SchedState.QUEUED, None, None, "BeginTime"),
    "pending-dependency": (SchedState.QUEUED, None, None, "Dependency"),
    "pending-resources": (SchedState.QUEUED, None, None, "Resources"),
    "node_fail-requeued": (SchedState.QUEUED, None, None, "BeginTime"),
    "running": (SchedState.RUNNING, None, None, None),
    "running-two-nodes": (SchedState.RUNNING, None, None, None),
    "completed": (SchedState.FINISHED, Outcome.EXITED, 0, None),
    "failed": (SchedState.FINISHED, Outcome.EXITED, 3, "NonZeroExitCode"),
    "cancelled": (SchedState.FINISHED, Outcome.CANCELLED, None, None),
    "timeout": (SchedState.FINISHED, Outcome.WALLTIME, None, "TimeLimit"),
    "node_fail": (SchedState.FINISHED, Outcome.SCHEDULER_ERROR, None, "NodeDown"),
    "preempted": (SchedState.FINISHED, Outcome.KILLED, 15, None),
}


def _with_time_used(text: str) -> str:
    """The samples' squeue lines are FORMAT without its last column (TimeUsed): add an unknown one."""
    return "".join(f"{line.rstrip()}|0:00|\n" for line in text.splitlines() if line.strip())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_samples(name: str) -> None:
    import json

    assert FIELDS[:-1] == ("JobID", "State", "Reason", "NodeList", "TimeLimit", "StartTime", "exit_code")
    job_id = json.loads((DATA / "jobs.json").read_text())[name]
    job = parse_status(_with_time_used((DATA / f"{name}.squeue.txt").read_text()))[job_id]
    assert (job.state, job.outcome, job.outcome_code, job.comment) == EXPECTED[name]
    if name == "running":
        assert job.walltime_s == 1800 and job.exec_host == "n1"
    if name == "running-two-nodes":
        assert job.exec_host == "n1" and job.walltime_s == 365 * 86400
    if name == "pending-dependency":
        assert job.estimated_start is None  # StartTime N/A
    if name == "pending-resources":
        assert job.estimated_start is not None and job.estimated_start > time.time()  # Slurm's estimate


def test_real_batch_and_errors() -> None:
    import json

    jobs = parse_status(_with_time_used((DATA / "batch.squeue.txt").read_text()))
    assert len(jobs) == 12 and all(j.state is SchedState.FINISHED for j in jobs.values())
    errors = {" ".join(e["argv"][:4]): e for e in json.loads((DATA / "errors.json").read_text())}

    def answer(key: str) -> Result:
        e = errors[key]
        return Result(e["rc"], e["stdout"], e["stderr"])

    one_unknown = FakeRunner(answer("squeue --noheader --states=all --jobs=99999"), NO_ACCOUNTING)
    assert SlurmScheduler().query(one_unknown, [JobRef("99999", "/r")]) == {}  # type: ignore[arg-type]
    bad = FakeRunner(answer("squeue --noheader --states=all --jobs=abc"))
    with pytest.raises(SchedulerError):
        SlurmScheduler().query(bad, [JobRef("abc", "/r")])  # type: ignore[arg-type]
    for key in ("sbatch --parsable --partition=nosuch --wrap=true", "sbatch --parsable --gres=gpu:5 --wrap=true"):
        refused = FakeRunner(answer(key))
        with pytest.raises(SchedulerError, match="sbatch refused the job: sbatch: error"):
            SlurmScheduler().submit(refused, "/r/job.slurm", "/r", "t")  # type: ignore[arg-type]


@pytest.mark.parametrize(("state", "code", "ran", "expected"), [
    ("COMPLETED", "0", True, (Outcome.EXITED, 0)),
    ("FAILED", "3:0", True, (Outcome.EXITED, 3)),
    ("FAILED", "0:9", True, (Outcome.KILLED, 9)),
    ("TIMEOUT", "0:15", True, (Outcome.WALLTIME, None)),
    ("DEADLINE", "0", False, (Outcome.WALLTIME, None)),
    ("CANCELLED", "0", False, (Outcome.NEVER_RAN, None)),
    ("CANCELLED", "0:15", True, (Outcome.CANCELLED, None)),
    ("NODE_FAIL", "0", True, (Outcome.SCHEDULER_ERROR, None)),
    ("BOOT_FAIL", "0", False, (Outcome.SCHEDULER_ERROR, None)),
    ("PREEMPTED", "0:15", True, (Outcome.KILLED, 15)),
    ("OUT_OF_MEMORY", "0:125", True, (Outcome.KILLED, 9)),
])
def test_outcomes(state: str, code: str, ran: bool, expected: tuple[Outcome, int | None]) -> None:
    assert outcome(state, exit_parts(code), ran) == expected


@pytest.mark.parametrize(("state", "sched"), [
    ("PENDING", SchedState.QUEUED), ("CONFIGURING", SchedState.QUEUED), ("SUSPENDED", SchedState.HELD),
    ("RUNNING", SchedState.RUNNING), ("COMPLETING", SchedState.EXITING), ("OUT_OF_MEMORY", SchedState.FINISHED),
])
def test_states(state: str, sched: SchedState) -> None:
    job = parse_status(f"5|{state}|None||1:00:00|N/A||0:00|\n")["5"]
    assert job.state is sched and job.raw_state == state
    assert (job.outcome is None) == (sched is not SchedState.FINISHED)


def test_times_and_hosts() -> None:
    job = parse_status("5|RUNNING|None|gpu[0012-0013],x1|2-00:00:00|2026-11-23T11:00:00|0|1-02:03:04|\n")["5"]
    assert job.uptime_s == 86400 + 2 * 3600 + 3 * 60 + 4 and job.walltime_s == 2 * 86400
    assert job.exec_host == "gpu0012"
    assert first_host("") is None and first_host("n3") == "n3"


@pytest.mark.parametrize("line", ["garbage", "5|RUNNING|None|", "x|RUNNING|None|n1|1:00|N/A|0|0:00|",
                                  "5|RUNNING|a|b|c|d|e|f|g|"])
def test_garbled_answer_is_unavailable(line: str) -> None:
    with pytest.raises(SchedulerUnavailable):
        parse_status(line + "\n")


def test_job_ids_and_argv() -> None:
    assert parse_job_id("1234\n") == "1234" and parse_job_id("1234;perlmutter\n") == "1234"
    with pytest.raises(SchedulerError):
        parse_job_id("sbatch: error: Batch job submission failed\n")
    argv = status_argv(["1", "2"])
    assert argv[:4] == ["squeue", "--noheader", "--states=all", "--jobs=1,2"] and argv[4].startswith("--Format=")
    assert submit_argv("/r/job.slurm") == ["sbatch", "--parsable", "/r/job.slurm"]
    assert submit_argv("/r/job.slurm", begin_at=1000.2, after="77", now=900.0) == [
        "sbatch", "--parsable", "--begin=now+101", "--dependency=after:77", "/r/job.slurm"]
    with pytest.raises(UsageError):
        submit_argv("/r/job.slurm", after="77 --wrap=x")
    assert cancel_argv("5") == ["scancel", "-v", "5"]


class FakeRunner:
    """Answers each command with the next canned result; records the argv."""

    name = "local"

    def __init__(self, *results: Result) -> None:
        self.results = list(results)
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], **_: Any) -> Result:
        self.calls.append(list(argv))
        return self.results.pop(0)


NO_ACCOUNTING = Result(1, "", "Slurm accounting storage is disabled\n")


@pytest.fixture(autouse=True)
def _fresh_sacct_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pbs_toolkit.schedulers.slurm._NO_SACCT", set())


def test_query_one_call_unknown_and_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pbs_toolkit.schedulers.base.time.sleep", lambda _s: None)
    refs = [JobRef(j, "/r") for j in ("1", "2", "9")]
    runner = FakeRunner(Result(1, "", "slurm_load_jobs error: Socket timed out on send/recv operation\n"),
                        Result(0, SAMPLE, ""))
    jobs = SlurmScheduler().query(runner, refs)  # type: ignore[arg-type]
    assert sorted(jobs) == ["1", "2", "9"] and len(runner.calls) == 2 and runner.calls[0] == runner.calls[1]
    # squeue fails the whole call when the only id asked for is unknown: that is an answer ("not known")
    gone = FakeRunner(Result(1, "", "slurm_load_jobs error: Invalid job id specified\n"), NO_ACCOUNTING)
    assert SlurmScheduler().query(gone, [JobRef("404", "/r")]) == {}  # type: ignore[arg-type]
    assert [c[0] for c in gone.calls] == ["squeue", "sacct"]
    broken = FakeRunner(Result(1, "", "squeue: error: something else\n"))
    with pytest.raises(SchedulerError):
        SlurmScheduler().query(broken, refs)  # type: ignore[arg-type]


# `sacct -c --noheader --parsable2 --jobs=... --format=<SACCT_FIELDS>` on the same cluster (jobcomp/filetxt: the
# time limit in minutes); the last line is the slurmdbd form (`CANCELLED by UID`, HH:MM:SS limits).
SACCT = """\
1|FAILED|2026-11-23T11:39:32|00:00:03|1|n1|3:0
4|CANCELLED|2026-11-23T11:39:48|00:00:00|UNLIMITED|(null)|0:0
2|TIMEOUT|2026-11-23T11:39:32|00:01:19|1|n1|0:0
7|FAILED|2026-11-23T11:43:35|00:00:00|UNLIMITED|n1|0:9
11|CANCELLED by 1000|2026-11-23T11:48:14|00:01:09|00:10:00|n1|0:15
"""


def test_sacct_for_jobs_squeue_forgot() -> None:
    refs = [JobRef(j, "/r") for j in ("9", "1", "4", "2", "7", "11", "12")]
    running = "9|RUNNING|None|n1|UNLIMITED|2026-11-23T11:43:35|0|0:03|\n"
    runner = FakeRunner(Result(0, running, ""), Result(0, SACCT, ""))
    jobs = SlurmScheduler().query(runner, refs)  # type: ignore[arg-type]
    assert runner.calls[1][0] == "sacct" and runner.calls[1][4] == "--jobs=1,4,2,7,11,12"
    got = {j: (jobs[j].outcome, jobs[j].outcome_code, jobs[j].walltime_s) for j in jobs if j != "9"}
    assert got == {"1": (Outcome.EXITED, 3, 60), "4": (Outcome.NEVER_RAN, None, None),
                   "2": (Outcome.WALLTIME, None, 60), "7": (Outcome.KILLED, 9, None),
                   "11": (Outcome.CANCELLED, None, 600)}
    assert "12" not in jobs and jobs["9"].state is SchedState.RUNNING
    # no accounting: asked once, then not again in this process
    first = FakeRunner(Result(0, running, ""), NO_ACCOUNTING)
    assert sorted(SlurmScheduler().query(first, refs)) == ["9"]  # type: ignore[arg-type]
    again = FakeRunner(Result(0, running, ""))
    assert sorted(SlurmScheduler().query(again, refs)) == ["9"] and len(again.calls) == 1  # type: ignore[arg-type]


def test_cancel_gone_is_false() -> None:
    # scancel -v on Slurm 22.05: exit 0 either way; only its words tell
    stopped = FakeRunner(Result(0, "", "scancel: Terminating job 9\n"))
    assert SlurmScheduler().cancel(stopped, JobRef("9", "/r")) is True  # type: ignore[arg-type]
    for words in ("Invalid job id specified", "Job/step already completing or completed"):
        gone = FakeRunner(Result(0, "", f"scancel: Terminating job 4\nscancel: error: Kill job error on job id 4: "
                                        f"{words}\n"))
        assert SlurmScheduler().cancel(gone, JobRef("4", "/r")) is False  # type: ignore[arg-type]


# -- the job script ------------------------------------------------------------------------------------------


def _profile(tmp_path: Path, **keys: Any) -> str:
    import yaml

    data = {"scheduler": "slurm", "nodes": 1, "gpus_per_node": 4, "cpus_per_node": 16, "walltime": "02:00:00",
            "slurm": {"queue": "gpu", "account": "m1234", "qos": "regular", "constraint": "gpu&hbm80g"}}
    data.update(keys)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_directives(tmp_path: Path) -> None:
    result = pbstk("render", MODEL, "--profile", _profile(tmp_path), "--preset", "dp4", "--run-dir", "/scratch/r1",
                   "--json")
    assert result.exit_code == 0, result.output
    import json

    script = json.loads(result.stdout)["job_script"]
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=qwen3-vl-2b-instruct", "#SBATCH --partition=gpu", "#SBATCH --account=m1234",
        "#SBATCH --qos=regular", "#SBATCH --constraint=gpu&hbm80g", "#SBATCH --time=02:00:00",
        "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=16", "#SBATCH --gres=gpu:4",
        "#SBATCH --output=/scratch/r1/slurm.out", "#SBATCH --error=/scratch/r1/slurm.err", "#SBATCH --no-requeue",
    ]
    assert 'export PBSTK_JOB_ID="${SLURM_JOB_ID:-}"' in script and "PBSTK_NODEFILE" in script
    result = pbstk("render", MODEL, "--profile", _profile(tmp_path, gpu_directive="gpus-per-node", exclusive=True,
                                                          extra_directives=["--mem=0"]),
                   "--preset", "dp4", "--run-dir", "/scratch/r1", "--json")
    script = json.loads(result.stdout)["job_script"]
    assert "#SBATCH --gpus-per-node=4\n" in script and "--gres" not in script
    assert "#SBATCH --exclusive\n" in script and "#SBATCH --mem=0\n" in script


@pytest.mark.parametrize(("keys", "words"), [
    ({"extra_directives": ["--mem=0 --export=ALL"]}, "extra_directives"),
    ({"extra_directives": ["--export=ALL"]}, "extra_directives"),
    ({"extra_directives": ["-p other"]}, "extra_directives"),
    ({"slurm": {"qos": "regular\n#SBATCH --export=ALL"}}, "qos"),
    ({"slurm": {"queue": "gpu --wrap=x"}}, "queue"),
    ({"slurm": {"constraint": "gpu --x"}}, "constraint"),
    ({"gpu_directive": "gpus"}, "gpu_directive"),
    ({"node_launcher": "pbsdsh"}, "node_launcher"),
])
def test_refused_values(tmp_path: Path, keys: dict[str, Any], words: str) -> None:
    result = pbstk("render", MODEL, "--profile", _profile(tmp_path, **keys), "--preset", "dp4")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("pbstk: error:")]
    assert len(lines) == 1 and words in lines[0], result.output


def test_validate_direct() -> None:
    from pbs_toolkit.schedulers.slurm import SlurmKeys, validate_directives
    from pbs_toolkit.settings.profiles import Profile

    # Slurm's own keys live in its section of the profile (``Profile.backend``)
    def slurm(*directives: str) -> Profile:
        return Profile(name="x", scheduler="slurm", backend=SlurmKeys(extra_directives=list(directives)))

    validate_directives(slurm("--licenses=scratch"), "x")
    with pytest.raises(ConfigError):
        validate_directives(slurm("--output=/tmp/x"), "x")


def test_node_launchers_come_from_the_backend(tmp_path: Path) -> None:
    import json

    result = pbstk("render", MODEL, "--profile", _profile(tmp_path, nodes=2, node_launcher="srun"), "--preset", "dp8",
                   "--json")
    assert result.exit_code == 0, result.output
    start = json.loads(result.stdout)["start_script"]
    assert "NODE_LAUNCHER=srun\n" in start and "pbstk_launch_node_srun() {" in start
    assert "pbstk_launch_node_pbsdsh" not in start
    pbs = tmp_path / "p.yaml"
    pbs.write_text("scheduler: pbs\nnode_launcher: srun\n")
    refused = pbstk("render", MODEL, "--profile", str(pbs), "--preset", "dp4")
    assert refused.exit_code == 2 and "mpiexec, pbsdsh, ssh" in refused.output, refused.output


def test_shipped_profiles() -> None:
    from pbs_toolkit.settings.profiles import load_profile

    generic, nersc = load_profile("slurm"), load_profile("perlmutter")
    assert generic.scheduler == nersc.scheduler == "slurm" and generic.queue == "gpu"
    assert nersc.account_required and nersc.constraint == "gpu" and nersc.qos == "regular"
    assert nersc.gpu_directive == "gpus-per-node" and nersc.gpus_per_node == 4 and nersc.node_launcher == "srun"
    refused = pbstk("render", MODEL, "--profile", "perlmutter")
    assert refused.exit_code == 2 and "needs an account" in refused.output
