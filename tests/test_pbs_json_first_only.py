"""A batched ``qstat -x -f -F json ID1 ID2`` that lists only the first job (OpenPBS main, openpbs issue #2672).

The fake PBS plays the quirk with ``FAKEPBS_JSON_FIRST_ONLY=1``; the real-OpenPBS tier (test_realpbs.py) checks
that the real server does what the fake does. pbstk must show every job (not UNKNOWN), with its uptime and
walltime, ask again only once per server, and keep one ``qstat`` per poll where the server answers whole.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import FAKEPBS_BIN, read_calls
from helpers import MODEL, launch, pbstk, until
from test_service import ROUTER, service_json
from test_service_pbs import pbs_svc  # noqa: F401  (fixture)

from pbs_toolkit.schedulers.pbs import qstat_text


def statuses(*jobs: str) -> list[dict]:
    result = pbstk("status", *jobs, "--json")
    assert result.exit_code == 0, result.output
    return list(json.loads(result.stdout))


def qstat_calls(home: Path) -> list[list[str]]:
    return read_calls(home, "qstat")


def test_every_job_is_shown_when_the_batched_json_lists_only_the_first(fakepbs: Path, standins: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")  # running, starting for as long as the test likes
    jobs = [launch("--walltime", "00:20:00", "--name", f"q{i}").job_id for i in range(3)]
    for job in jobs:
        until(lambda job=job: statuses(job)[0]["scheduler_state"] == "R", 20, f"{job} to run")
    monkeypatch.setenv("FAKEPBS_JSON_FIRST_ONLY", "1")
    before = len(qstat_calls(fakepbs))

    first = statuses(*jobs)
    assert [s["state"] for s in first] == ["STARTING"] * 3, first  # was: UNKNOWN for all but the first
    for st in first:
        assert st["scheduler_state"] == "R" and st["walltime_s"] == 1200, st
        assert st["uptime_s"] is not None and 0 <= st["uptime_s"] < 120, st
    calls = qstat_calls(fakepbs)[before:]
    assert calls == [["-x", "-f", "-F", "json", *jobs], ["-x", "-f", "-w", *jobs[1:]]], calls  # asked again once

    second = statuses(*jobs)  # remembered: one call, in the text form
    assert [s["state"] for s in second] == ["STARTING"] * 3, second
    assert qstat_calls(fakepbs)[before + 2:] == [["-x", "-f", "-w", *jobs]]
    assert all(s["walltime_s"] == 1200 and s["uptime_s"] is not None for s in second)
    pbstk("cancel", *jobs)


def test_a_server_that_answers_whole_keeps_one_json_call_per_poll(fakepbs: Path, standins: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    jobs = [launch("--name", f"q{i}").job_id for i in range(2)]
    before = len(qstat_calls(fakepbs))
    for _ in range(2):
        assert [s["state"] for s in statuses(*jobs)] == ["PENDING"] * 2
    assert qstat_calls(fakepbs)[before:] == [["-x", "-f", "-F", "json", *jobs]] * 2
    assert not qstat_text.batching_broken("local")


def test_an_unknown_job_is_not_mistaken_for_the_quirk(fakepbs: Path, standins: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first id unknown (rc 153, named on stderr), the next listed, the last dropped by the quirk: only the
    dropped one is asked again; the unknown one stays the scheduler's "unknown"."""
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    jobs = [launch("--name", f"q{i}").job_id for i in range(3)]
    (fakepbs / "faults.json").write_text(json.dumps({"vanish": [jobs[0]]}))
    monkeypatch.setenv("FAKEPBS_JSON_FIRST_ONLY", "1")
    before = len(qstat_calls(fakepbs))
    shown = statuses(*jobs)
    assert [s["scheduler_state"] for s in shown[1:]] == ["Q", "Q"], shown
    assert shown[0]["scheduler_state"] != "Q"
    assert qstat_calls(fakepbs)[before:] == [["-x", "-f", "-F", "json", *jobs], ["-x", "-f", "-w", jobs[2]]]


def test_one_job_is_never_asked_twice(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    monkeypatch.setenv("FAKEPBS_JSON_FIRST_ONLY", "1")
    job = launch().job_id
    before = len(qstat_calls(fakepbs))
    assert statuses(job)[0]["scheduler_state"] == "Q"
    assert qstat_calls(fakepbs)[before:] == [["-x", "-f", "-F", "json", job]]
    assert not qstat_text.batching_broken("local")


def test_the_text_form_reads_as_the_json_form() -> None:
    text = (
        "Job Id: 7.vm\n"
        "    Job_Name = qwen\n"
        "    job_state = R\n"
        "    comment = Job run at Wed Nov 25 at 22:00 on (vm:ncpus=1:ngpus=1)\n"
        "    Resource_List.walltime = 00:20:00\n"
        "    Resource_List.select = 1:ncpus=1:ngpus=1\n"
        "    resources_used.walltime = 00:00:05\n"
        "    exec_host = vm/0\n"
        "    Variable_List = PBS_O_HOME=/root,PBS_O_LANG=C.UTF-8,PBS_O_LOGNAME=root,PBS_O_PATH=/usr/bin:/bi\n"
        "\tn,PBS_O_SHELL=/bin/bash\n"
        "\n"
        "Job Id: 8.vm\n"
        "    job_state = F\n"
        "    Exit_status = -29\n"
    )
    jobs = qstat_text.parse_text(text)
    assert jobs["7.vm"]["Resource_List"] == {"walltime": "00:20:00", "select": "1:ncpus=1:ngpus=1"}
    assert jobs["7.vm"]["comment"].startswith("Job run at") and jobs["7.vm"]["exec_host"] == "vm/0"
    assert jobs["7.vm"]["Variable_List"].endswith("/usr/bin:/bin,PBS_O_SHELL=/bin/bash")  # a wrapped value joined
    assert jobs["8.vm"] == {"job_state": "F", "Exit_status": "-29"}
    assert qstat_text.unknown_ids("qstat: Unknown Job Id 9.vm\nqstat: Unknown Job Id 10\n") == {"9", "10"}



@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
@pytest.mark.usefixtures("pbs_svc")
def test_a_services_replicas_keep_their_state_uptime_and_walltime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper and ``status NAME`` ask for both replicas in one batch: with the quirk the second replica was
    UNKNOWN, without uptime nor walltime, and the service never READY 2/2."""
    monkeypatch.setenv("FAKEPBS_JSON_FIRST_ONLY", "1")  # the keeper inherits it
    result = pbstk("serve", MODEL, "--profile", "svcpbs", "--preset", "single", "--replicas", "2", "--name", "pq",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    doc = service_json("pq")
    assert doc["state"] == "READY" and doc["ready"] == 2, doc
    for job in doc["jobs"]:
        assert job["state"] == "READY" and job["scheduler_state"] == "R", job
        assert job["walltime_s"] == 600 and job["uptime_s"] is not None, job
    assert qstat_text.batching_broken("local")
    assert pbstk("cancel", "pq").exit_code == 0


def test_the_fake_plays_the_quirk_as_the_real_server_does(fakepbs: Path, standins: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What test_realpbs.py saw on OpenPBS main: the first job found (an unknown id before it does not count),
    rc and stderr as usual; the text form lists all."""
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    jobs = [launch("--name", f"q{i}").job_id for i in range(2)]
    monkeypatch.setenv("FAKEPBS_JSON_FIRST_ONLY", "1")

    def qstat(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(FAKEPBS_BIN / "qstat"), *args], capture_output=True, text=True, timeout=30)  # noqa: S603

    whole = qstat("-x", "-f", "-F", "json", *jobs)
    assert whole.returncode == 0 and not whole.stderr and list(json.loads(whole.stdout)["Jobs"]) == jobs[:1]
    unknown_first = qstat("-x", "-f", "-F", "json", "999", *jobs)
    assert unknown_first.returncode == 153 and "Unknown Job Id 999" in unknown_first.stderr
    assert list(json.loads(unknown_first.stdout)["Jobs"]) == jobs[:1]
    text = qstat("-x", "-f", "-w", *jobs)
    assert list(qstat_text.parse_text(text.stdout)) == jobs
    monkeypatch.delenv("FAKEPBS_JSON_FIRST_ONLY")
    assert list(json.loads(qstat("-x", "-f", "-F", "json", *jobs).stdout)["Jobs"]) == jobs
