"""The PBS backend's ``begin_at`` (``qsub -a``) and ``after`` (``-W depend=after:ID``) against the fake OpenPBS.

A service's keep-alive successor is submitted with one of them (docs/pbs.md "Delayed and chained jobs"); these
tests launch real pbstk jobs through the Client and watch them wait, then run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import read_calls
from helpers import MODEL, pbstk

from pbs_toolkit.client import Client
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobStore


@pytest.fixture
def pbs(fakepbs: Path, standins: Path) -> Path:
    return fakepbs


def launch(client: Client, name: str, **when: Any) -> str:
    req = client.request(MODEL, "dp4", "generic-pbspro", port="auto", name=name)
    return client.launch_request(req, **when).record.job_id


def fake_job(home: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads((home / "jobs" / f"{job_id.split('.')[0]}.json").read_text()))


def test_begin_at_waits_in_w_with_its_eligible_time_then_runs(pbs: Path) -> None:
    client = Client()
    begin = time.time() + 8
    job_id = launch(client, "later", begin_at=begin)
    argv = read_calls(pbs, "qsub")[0]
    assert argv[:2] == ["-a", time.strftime("%Y%m%d%H%M.%S", time.localtime(math.ceil(begin)))]
    st = client.status(job_id)[0]
    assert (st.state.value, st.scheduler_state) == ("PENDING", "W")
    shown = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(math.ceil(begin)))
    assert st.comment == f"eligible at {shown} (qsub -a)"
    assert f"eligible at {shown}" in pbstk("status").stdout
    ready = client.wait(job_id, timeout=40)
    assert ready.state.value == "READY"
    assert fake_job(pbs, job_id)["internal"]["stime"] >= begin


def test_begin_at_is_read_in_the_login_nodes_time_zone(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the commands run (date, qsub) live 5h30 east of this process: a string made here would be off by that much
    monkeypatch.setenv("TZ", "IST-5:30")
    begin = time.time() + 600
    job_id = launch(Client(), "tz", begin_at=begin)
    assert fake_job(pbs, job_id)["internal"]["exec_at"] == math.ceil(begin)
    assert read_calls(pbs, "qsub")[0][1] == time.strftime("%Y%m%d%H%M.%S", time.gmtime(math.ceil(begin) + 19800))


def test_begin_at_without_gnu_date_runs_qsub_in_utc(pbs: Path, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    nodate = tmp_path / "nodate"
    nodate.mkdir()
    (nodate / "date").write_text("#!/bin/sh\necho 'date: illegal option -- d' >&2\nexit 1\n")
    (nodate / "date").chmod(0o755)
    monkeypatch.setenv("PATH", f"{nodate}:{os.environ['PATH']}")
    monkeypatch.setenv("TZ", "IST-5:30")
    begin = time.time() + 600
    job_id = launch(Client(), "bsd", begin_at=begin)
    assert fake_job(pbs, job_id)["internal"]["exec_at"] == math.ceil(begin)  # exact all the same
    # qsub still ran under launch's marking wrapper (TZ went through env=, not an `env` prefix)
    assert (Path(JobStore().find(job_id).run_dir) / "job_id").read_text().strip() == job_id
    assert read_calls(pbs, "qsub")[0][1] == time.strftime("%Y%m%d%H%M.%S", time.gmtime(math.ceil(begin)))


def test_after_waits_for_the_other_job_to_start(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client()
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "6")
    first = launch(client, "first")
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "0")
    second = launch(client, "second", after=first)
    assert read_calls(pbs, "qsub")[1][:2] == ["-W", f"depend=after:{first}"]
    before, st = client.status(first, second)
    assert before.scheduler_state == "Q"  # same answer: the first is queued, so the second is held
    assert (st.state.value, st.scheduler_state) == ("PENDING", "H")
    assert st.comment == f"held until its dependency is met: after:{first}"
    assert client.wait(second, timeout=40).state.value == "READY"
    assert fake_job(pbs, second)["internal"]["stime"] >= fake_job(pbs, first)["internal"]["stime"]
    for job in (first, second):
        client.cancel(job)


def test_after_must_be_a_pbs_job_id(pbs: Path) -> None:
    client = Client()
    with pytest.raises(UsageError, match="not a PBS job id"):
        launch(client, "bad", after="1; rm -rf ~")
    assert read_calls(pbs, "qsub") == []


def test_after_an_unknown_job_never_runs_and_says_so(pbs: Path) -> None:
    # OpenPBS takes the job (qsub prints an id), then aborts it when the parent cannot be registered
    client = Client()
    job_id = launch(client, "orphan", after="4242.fakepbs")
    st = None
    deadline = time.monotonic() + 20
    while st is None or not st.state.final:
        assert time.monotonic() < deadline, st
        time.sleep(0.3)
        st = client.status(job_id)[0]
    assert st.state.value == "CANCELLED" and st.exit_status is None
    assert st.reason == "deleted before it ran"


def test_a_user_run_limit_keeps_the_second_job_pending_with_its_reason(pbs: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_MAX_RUN_PER_USER", "1")
    client = Client()
    first = launch(client, "one")
    assert client.wait(first, timeout=40).state.value == "READY"
    second = launch(client, "two", begin_at=time.time())  # eligible at once, yet it cannot run
    reason = "Not Running: User has reached queue workq running job limit."
    deadline = time.monotonic() + 20
    while (st := client.status(second)[0]).comment != reason:
        assert time.monotonic() < deadline, st
        time.sleep(0.3)
    assert (st.state.value, st.scheduler_state) == ("PENDING", "Q")
    assert reason in pbstk("status").stdout
    client.cancel(first)
    assert client.wait(second, timeout=40).state.value == "READY"
    client.cancel(second)
