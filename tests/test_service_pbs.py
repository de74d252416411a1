"""A service whose replicas are jobs of the fake OpenPBS (tests/fakepbs), its router the real vllm-router here.

The fake PBS runs each replica for real (the stand-in vllm), enforces walltime (SIGTERM at the limit) and keeps a
``qsub -a`` job in ``W`` with its ``Execution_Time`` until then: the keep-alive handover must beat the walltime
kill, and the successor must really have waited for its time. Loopback only, every loop bounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FAKEPBS_BIN, read_calls
from helpers import MODEL, pbstk, wait_for
from test_service import ROUTER, Load, _stop_services, handed_over_from, openai_chat, service_json

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def pbs_svc(isolated_user: Path, fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PBS profile (the fake qsub/qstat/qdel on PATH), the router local; the keeper looks every 0.5 s."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "svcpbs.yaml").write_text(
        "name: svcpbs\nscheduler: pbs\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        "address: loopback\nbind_host: 127.0.0.1\n"
        f"router_command: {ROUTER}\nrouter: local\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "3")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    yield fakepbs
    _stop_services()


def fake_job(home: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads((home / "jobs" / f"{job_id.split('.')[0]}.json").read_text()))


def test_keep_alive_on_pbs_hands_over_before_the_walltime_with_zero_failed_requests(
        pbs_svc: Path, isolated_user: Path) -> None:
    result = pbstk("serve", MODEL, "--profile", "svcpbs", "--preset", "single", "--replicas", "1", "--name", "pka",
                   "--keep-alive", "--walltime", "00:01:15", "--handover", "45", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "pka")
    assert rec.scheduler == "pbs" and rec.transport == ""
    first = rec.slots[0].current
    assert first and first.endswith(".fakepbs")
    registry = isolated_user / "endpoints.yaml"
    assert pbstk("update-endpoint", "pka", "--registry", str(registry)).exit_code == 0
    before = registry.read_bytes()
    send, handed_over = openai_chat(rec), handed_over_from("pka", first)

    with Load(send, threads=2, limit_s=150) as load:
        # eligible 45 s before the 75 s walltime ends: about 30 s after the first job started; W until then
        doc = wait_for(lambda: (d := service_json("pka"))["slots"][0]["successor"] and d, 30, "a successor")
        successor = doc["slots"][0]["successor"]
        waiting = next(j for j in doc["jobs"] if j["job_id"] == successor)
        assert (waiting["state"], waiting["scheduler_state"]) == ("PENDING", "W"), waiting
        assert "eligible at" in (waiting["comment"] or ""), waiting
        wait_for(handed_over, 75, "the handover", interval=0.5)
        done = load.ok
        wait_for(lambda: load.ok >= done + 20, 30, "load after the handover")
    print(f"PBS keep-alive handover under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
    assert load.failed == 0, load.errors
    assert registry.read_bytes() == before
    assert records.find(JobStore(), "pka").slots[0].current == successor == JobStore().find("pka-r0-g1").job_id

    # the successor was submitted with qsub -a and really waited: its Execution_Time, and it started after it
    # (the successor, running now, has queued its own successor already: keep-alive goes on)
    qsubs = read_calls(pbs_svc, "qsub")
    assert "-a" not in qsubs[0] and all("-a" in argv for argv in qsubs[1:]), qsubs
    job = fake_job(pbs_svc, successor)
    assert job["internal"]["stime"] >= job["internal"]["exec_at"]
    assert job["internal"]["exec_at"] <= fake_job(pbs_svc, first)["internal"]["stime"] + 75 - 45 + 2
    # the predecessor was drained and cancelled (qdel) before the walltime could kill it
    wait_for(lambda: pbstk("status", first, "--json").exit_code == 0 and JobStore().find(first).final_state
             == "CANCELLED", 20, "the predecessor CANCELLED")
    assert any(first.split(".")[0] in " ".join(argv) for argv in read_calls(pbs_svc, "qdel"))
    assert fake_job(pbs_svc, first)["attrs"]["Exit_status"] != -29  # ended by qdel, not killed at its walltime
    assert service_json("pka")["state"] == "READY"
    assert pbstk("cancel", "pka").exit_code == 0


def test_status_is_one_qstat_for_every_job_and_every_services_replicas(
        pbs_svc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/status.md: one scheduler query per transport per call, services included (their replica jobs join
    the jobs' batch). A counting ``qstat`` in front of the fake one, put on PATH after the keepers started (they
    keep the PATH they were started with, so their own looks are not counted)."""
    import os

    for name in ("sa", "sb"):
        result = pbstk("serve", MODEL, "--profile", "svcpbs", "--preset", "single", "--replicas", "1",
                       "--name", name)
        assert result.exit_code == 0, result.output
    launched = pbstk("launch", MODEL, "--profile", "svcpbs", "--preset", "single", "--name", "plain")
    assert launched.exit_code == 0, launched.output
    shim = tmp_path / "counting"
    shim.mkdir()
    calls = tmp_path / "qstat-calls"
    real = FAKEPBS_BIN / "qstat"
    assert real.exists(), real
    (shim / "qstat").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {real} "$@"\n')
    (shim / "qstat").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")

    def count(*args: str) -> tuple[int, Any]:
        calls.unlink(missing_ok=True)
        shown = pbstk("status", *args)
        assert shown.exit_code == 0, shown.output
        return len(calls.read_text().splitlines()) if calls.exists() else 0, shown

    n, shown = count()
    assert n == 1, (calls.read_text(), shown.output)
    assert "sa " in shown.stdout and "sb " in shown.stdout and "plain" in shown.stdout, shown.stdout
    n, shown = count("--json")
    doc = json.loads(shown.stdout)
    assert n == 1 and [d["kind"] for d in doc][:2] == ["service", "service"], (n, doc)
    assert all(len(d["jobs"]) == 1 for d in doc[:2]), doc  # each service still shows its replica
    n, shown = count("sa", "sb")
    assert n == 1 and "service sa:" in shown.stdout and "service sb:" in shown.stdout, shown.output
    # one service on its own (status NAME) is one query too
    n, shown = count("sa")
    assert n == 1, shown.output


def test_keep_alive_that_cannot_overlap_is_refused_and_an_unrecorded_queue_limit_leaves_the_successor_queued(
        pbs_svc: Path, isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One running job per user (the fake's ``max_user_run``): recorded in the profile, keep-alive is refused; not
    recorded, the successor waits in ``Q`` with PBS's comment (status shows it), the predecessor is killed at its
    walltime (no overlap) and only then does the successor run and take the slot: the service comes back READY."""
    monkeypatch.setenv("FAKEPBS_MAX_RUN_PER_USER", "1")
    path = isolated_user / "config" / "pbstk" / "profiles" / "svcpbs.yaml"
    text = path.read_text()
    path.write_text(text + "max_running_jobs: 1\n")
    args = ("serve", MODEL, "--profile", "svcpbs", "--preset", "single", "--replicas", "1", "--name", "lim",
            "--keep-alive", "--walltime", "00:00:40", "--handover", "30")
    refused = pbstk(*args)
    assert refused.exit_code == 2 and refused.stderr.startswith("pbstk: error: --keep-alive needs 2 jobs"), \
        refused.output
    assert not JobStore().all() and not read_calls(pbs_svc, "qsub")
    path.write_text(text)  # the limit unknown to pbstk (max_running_jobs: 0): accepted
    result = pbstk(*args, "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    first = records.find(JobStore(), "lim").slots[0].current

    def queued_by_the_limit() -> dict[str, Any] | None:
        doc = service_json("lim")
        waiting = [j for j in doc["jobs"] if j["job_id"] == doc["slots"][0]["successor"]]
        if waiting and waiting[0]["scheduler_state"] == "Q":
            return doc
        return None

    doc = wait_for(queued_by_the_limit, 40, "the successor eligible and held in Q by the user limit")
    successor = doc["slots"][0]["successor"]
    job = next(j for j in doc["jobs"] if j["job_id"] == successor)
    assert job["state"] == "PENDING" and "User has reached queue" in (job["comment"] or ""), job
    assert doc["state"] == "READY" and doc["slots"][0]["current"] == first  # the predecessor still serves
    shown = pbstk("status", "lim").stdout
    assert "running job limit" in shown, shown  # not silent: `status NAME` shows why the successor waits
    # no overlap: the walltime kills the predecessor, then the successor runs and takes the slot
    seen: list[str] = []

    def serving_again() -> bool:
        doc = service_json("lim")
        if not seen or seen[-1] != doc["state"]:
            seen.append(doc["state"])
        return bool(doc["slots"][0]["current"] == successor and doc["state"] == "READY")

    wait_for(serving_again, 60, "the successor serving after the predecessor's walltime", interval=0.3)
    print(f"states while the successor was held by the user limit: {seen}")
    assert set(seen) <= {"READY", "DOWN"}, seen  # one replica: DOWN in the gap, said so, never gone from status
    assert fake_job(pbs_svc, first)["attrs"]["Exit_status"] == -29  # JOB_EXEC_KILL_WALLTIME
    assert pbstk("cancel", "lim").exit_code == 0
