"""Services: nothing orphaned, nothing wedged (issue 21 item 4). Real processes killed at the right moment:
``pbstk serve``, the keeper and ``pbstk cancel`` are real processes; replicas are jobs of the fake OpenPBS
(tests/fakepbs, whose ``qsub_block_until`` fault holds a submission after the job exists until the test lets it
answer) or of the local scheduler; the router is the real vllm-router. Afterwards no job and no router may run
that pbstk does not know, and a second ``cancel`` always finishes what an interrupted one left.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import read_calls
from helpers import MODEL, HealthOnly, fake_jobs, pbstk, set_faults, until, wait_for
from test_service import ROUTER, alive, service_json, svc_profile  # noqa: F401  (fixture)
from test_service_pbs import pbs_svc  # noqa: F401  (fixture)

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import keeper_alive, service_dir
from pbs_toolkit.services.router import process as router
from pbs_toolkit.transports.local import LocalRunner

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")

SERVE_PBS = ("serve", MODEL, "--profile", "svcpbs", "--preset", "single")


def start(*args: str, session: bool = False) -> subprocess.Popen[str]:
    """``pbstk ARGS`` as a real process with this test's environment (``session``: in its own process group)."""
    return subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args],  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session)


def block_qsub(home: Path) -> Path:
    """From now on qsub creates its job, then waits until the returned file exists before printing the id."""
    release = home / "release-qsub"
    set_faults(home, qsub_block_until=str(release))
    return release


def nothing_left(home: Path, router_pid: int) -> None:
    """Every fake PBS job ends (F) and the router is gone, without anything else cancelling them."""
    until(lambda: all(s == "F" for s in fake_jobs(home).values()), 20, f"every job to end: {fake_jobs(home)}")
    until(lambda: not alive(router_pid), 15, "the router to stop")


def keeper_pid(name: str) -> int:
    return int(json.loads((service_dir(name) / "keeper.json").read_text())["pid"])


def rec(name: str) -> records.ServiceRecord:
    return records.find(JobStore(), name)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_serve_interrupted_while_a_replica_is_submitted_leaves_nothing_running(pbs_svc: Path,  # noqa: F811
                                                                               sig: signal.Signals) -> None:
    release = block_qsub(pbs_svc)
    proc = start(*SERVE_PBS, "--replicas", "2", "--name", "sx")
    until(lambda: fake_jobs(pbs_svc), 30, "qsub to create the first replica")
    router_pid = rec("sx").router["pid"]
    proc.send_signal(sig)
    release.touch()  # qsub answers now: Ctrl-C/SIGTERM are held until its id is recorded; kill -9 is not
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 130 if sig == signal.SIGINT else 143), err
    assert "Traceback" not in err, err
    if sig == signal.SIGKILL:  # no teardown ran: the service is still recorded, its first launch half done
        assert rec("sx").slots[0].launching == "sx-r0" and not keeper_alive("sx")
        set_faults(pbs_svc)
        # a resumed keeper settles the first replica and launches the second that serve never got to
        assert pbstk("service", "resume", "sx").exit_code == 0
        wait_for(lambda: [s.current for s in rec("sx").slots] == sorted(fake_jobs(pbs_svc)), 15, "two replicas")
        cancelled = pbstk("cancel", "sx")  # and cancel stops them all
        assert cancelled.exit_code == 0, cancelled.output
    nothing_left(pbs_svc, router_pid)
    assert len(fake_jobs(pbs_svc)) == (2 if sig == signal.SIGKILL else 1)
    assert rec("sx").ended is not None and not rec("sx").active
    assert not any(line.startswith("sx ") for line in pbstk("status").stdout.splitlines())  # no service line


def _keep_alive_with_a_blocked_successor(home: Path, name: str) -> tuple[Path, str, int]:
    """A keep-alive service of one replica whose successor's qsub the keeper is stuck in: (release file, the
    successor's job id, router pid)."""
    result = pbstk(*SERVE_PBS, "--replicas", "1", "--name", name, "--keep-alive", "--handover", "60")
    assert result.exit_code == 0, result.output
    release = block_qsub(home)  # the keeper queues the successor as soon as the first job runs
    until(lambda: len(fake_jobs(home)) == 2, 30, "the keeper's qsub of the successor")
    successor = next(j for j in fake_jobs(home) if j != rec(name).slots[0].current)
    assert rec(name).slots[0].launching == f"{name}-r0-g1" and rec(name).slots[0].successor is None
    return release, successor, int(rec(name).router["pid"])


def test_keeper_killed_while_it_submits_a_successor_is_resumed_without_an_orphan(pbs_svc: Path) -> None:  # noqa: F811
    release, successor, router_pid = _keep_alive_with_a_blocked_successor(pbs_svc, "kk")
    os.kill(keeper_pid("kk"), signal.SIGKILL)
    release.touch()
    until(lambda: not keeper_alive("kk"), 10, "the keeper gone")
    resumed = pbstk("service", "resume", "kk")
    assert resumed.exit_code == 0, resumed.output
    # the resumed keeper settles the interrupted launch: the submitted job becomes the successor
    wait_for(lambda: rec("kk").slots[0].successor == successor, 15, "the submitted job to become the successor")
    log = (service_dir("kk") / "keeper.log").read_text()
    assert "already active" not in log and "tick failed" not in log, log
    assert len(fake_jobs(pbs_svc)) == 2  # and no second one was launched
    cancelled = pbstk("cancel", "kk")
    assert cancelled.exit_code == 0, cancelled.output
    nothing_left(pbs_svc, router_pid)


def test_cancel_while_the_keeper_submits_a_successor_stops_it_too(pbs_svc: Path) -> None:  # noqa: F811
    release, successor, router_pid = _keep_alive_with_a_blocked_successor(pbs_svc, "kc")
    proc = start("cancel", "kc")
    wait_for(lambda: rec("kc").state == "STOPPING", 15, "the cancel to begin")
    release.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    nothing_left(pbs_svc, router_pid)
    assert rec("kc").state == "CANCELLED"
    assert any(successor.split(".")[0] in " ".join(argv) for argv in read_calls(pbs_svc, "qdel")), successor


def test_an_interrupted_cancel_keeps_the_service_until_a_second_cancel_finishes_it(pbs_svc: Path) -> None:  # noqa: F811
    result = pbstk(*SERVE_PBS, "--replicas", "2", "--name", "ci")
    assert result.exit_code == 0, result.output
    router_pid = rec("ci").router["pid"]
    jobs = [s.current for s in rec("ci").slots]
    set_faults(pbs_svc, qdel_script=[{"hang": 60}])  # the first qdel hangs: the cancel is killed in it
    proc = start("cancel", "ci", session=True)
    until(lambda: read_calls(pbs_svc, "qdel"), 30, "the cancel's first qdel")
    os.killpg(proc.pid, signal.SIGKILL)  # the whole command, its hanging qdel too
    proc.wait(10)
    set_faults(pbs_svc)
    assert alive(router_pid) and any(s != "F" for s in fake_jobs(pbs_svc).values())
    st = pbstk("status")  # not gone from status: STOPPING, with what to do
    assert "ci " in st.stdout and "STOPPING" in st.stdout, st.output
    assert "pbstk cancel ci" in st.stderr, st.output
    again = pbstk(*SERVE_PBS, "--replicas", "1", "--name", "ci")  # the name is not free yet
    assert again.exit_code == 2 and "pbstk cancel ci" in again.stderr, again.output
    assert set(fake_jobs(pbs_svc)) == set(jobs)  # and nothing of it was submitted
    finished = pbstk("cancel", "ci")
    assert finished.exit_code == 0 and finished.stdout.startswith("ci: cancelled"), finished.output
    nothing_left(pbs_svc, router_pid)
    assert rec("ci").state == "CANCELLED"
    fresh = pbstk(*SERVE_PBS, "--replicas", "1", "--name", "ci")  # now it is
    assert fresh.exit_code == 0, fresh.output
    assert pbstk("cancel", "ci").exit_code == 0


def test_cancel_and_serve_of_one_name_at_once_orphan_nothing(pbs_svc: Path) -> None:  # noqa: F811
    """``serve --name NAME`` while ``cancel NAME`` is under way (marked, its keeper not stopped yet: a slow qstat
    holds it): the old service's replicas and router stop, and the new service is either refused whole or serving."""
    result = pbstk(*SERVE_PBS, "--replicas", "2", "--name", "cs")
    assert result.exit_code == 0, result.output
    old = rec("cs")
    old_jobs = {s.current for s in old.slots}
    set_faults(pbs_svc, slow_qstat=2)
    cancel = start("cancel", "cs")
    until(lambda: rec("cs").ended is not None, 30, "the cancel to mark the service")
    served = pbstk(*SERVE_PBS, "--replicas", "1", "--name", "cs")
    s_out, s_err = served.stdout, served.stderr
    c_out, c_err = cancel.communicate(timeout=60)
    assert cancel.returncode == 0, c_out + c_err
    set_faults(pbs_svc)
    until(lambda: not alive(old.router["pid"]), 15, "the old router to stop")
    until(lambda: all(fake_jobs(pbs_svc)[j] == "F" for j in old_jobs), 20, "the old replicas to end")
    now = rec("cs")
    if served.exit_code == 0:  # it came after the cancel: a service of its own, running
        assert now.created != old.created and now.ended is None and alive(now.router["pid"]), (s_out, s_err)
        assert pbstk("cancel", "cs").exit_code == 0
    else:  # it came first or during: refused, nothing of it runs
        assert served.exit_code == 2 and "pbstk: error:" in s_err, (s_out, s_err)
        assert now.created == old.created and now.state == "CANCELLED"
    until(lambda: all(s == "F" for s in fake_jobs(pbs_svc).values()), 20, "every job to end")


def _failed_replica(name: str) -> tuple[records.ServiceRecord, str]:
    """A local service of two replicas, READY, then replica 1's server killed (not restarted: --max-restarts 0):
    (its record, the failed job id)."""
    result = pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "2", "--name", name,
                   "--max-restarts", "0", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    svc = rec(name)
    victim = JobStore().find(svc.slots[1].current or "")
    os.kill(int(json.loads(Path(victim.run_dir, "server.json").read_text())["pid"]), signal.SIGKILL)
    wait_for(lambda: pbstk("status", victim.job_id, "--json").exit_code == 0 and JobStore().find(
        victim.job_id).final_state, 20, "the replica recorded as ended")
    return svc, victim.job_id


def _ticks_ok(name: str) -> None:
    """The keeper completes a tick after now, and status has no warning about it."""
    from pbs_toolkit.services.keeper.process import last_tick

    now = time.time()
    wait_for(lambda: (last_tick(name).get("ok_at") or 0) > now and not last_tick(name).get("error"), 15,
             "a successful keeper tick")
    shown = pbstk("status", name)
    assert shown.exit_code == 0 and "warning" not in shown.stderr, shown.output


def test_clean_keeps_a_live_services_failed_replica_and_a_lost_one_never_stops_the_keeper(
        svc_profile: str) -> None:  # noqa: F811
    svc, failed = _failed_replica("cl")
    cleaned = pbstk("clean", "--older-than", "0")
    assert cleaned.exit_code == 0, cleaned.output
    assert f"skipped {failed}" in cleaned.stdout and "still a replica of service cl" in cleaned.stdout, cleaned.output
    assert JobStore().find(failed).job_id == failed
    _ticks_ok("cl")
    # a record lost all the same (removed behind pbstk's back): the keeper goes on, the foreign sweep too
    JobStore().remove(JobStore().find(failed))
    _ticks_ok("cl")
    assert service_json("cl")["state"] == "DEGRADED"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HealthOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        foreign = f"http://127.0.0.1:{server.server_address[1]}"
        with router.open_admin(LocalRunner(), router.RouterInfo.from_dict(svc.router)) as admin:
            admin.add_worker(foreign)  # what anyone who reaches the router's port can do (raises if refused)
            # (not asserted present: the keeper's probe may already have swept it)
            wait_for(lambda: foreign not in admin.workers(), 15, "the foreign worker removed")
    finally:
        server.shutdown()
    assert pbstk("cancel", "cl").exit_code == 0


def test_a_corrupt_store_keeps_its_services(svc_profile: str) -> None:  # noqa: F811
    result = pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "1", "--name", "cor",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    svc = rec("cor")
    store = JobStore().path
    store.write_bytes(b"this is not a database" * 100)
    shown = pbstk("status")
    assert shown.exit_code == 0, shown.output
    assert "re-adopted 1 service(s)" in shown.stderr and "cor " in shown.stdout, shown.output
    assert rec("cor").api_key == svc.api_key and rec("cor").slots[0].current == svc.slots[0].current
    _ticks_ok("cor")  # the keeper did not exit: it found its service again
    cancelled = pbstk("cancel", "cor")
    assert cancelled.exit_code == 0, cancelled.output
    until(lambda: not alive(svc.router["pid"]) and not keeper_alive("cor"), 15, "router and keeper gone")


def test_a_locked_store_does_not_kill_the_keeper_and_status_says_when_it_makes_no_progress(
        svc_profile: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("PBSTK_STORE_TIMEOUT", "0.2")  # the keeper inherits it: a lock it meets fails fast
    result = pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "1", "--name", "lk",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    log = service_dir("lk") / "keeper.log"
    conn = sqlite3.connect(JobStore().path, timeout=5)
    conn.execute("BEGIN EXCLUSIVE")  # another process holding the store
    try:
        wait_for(lambda: "locked" in log.read_text(), 15, "a tick that met the lock")
    finally:
        conn.rollback()
        conn.close()
    assert keeper_alive("lk")
    _ticks_ok("lk")
    # a keeper that runs but cannot do its work (the router is gone): status says so, with the error
    os.killpg(int(rec("lk").router["pid"]), signal.SIGKILL)  # the router's wrapper leads its process group
    doc = wait_for(lambda: (d := service_json("lk"))["keeper"]["error"] and d, 15, "a failed tick in status")
    assert doc["keeper_running"] and doc["keeper"]["failures"] >= 1, doc
    shown = pbstk("status", "lk")
    assert "runs but makes no progress" in shown.stderr and "router" in shown.stderr, shown.output
    assert pbstk("cancel", "lk").exit_code == 0


def test_serve_killed_while_its_router_job_is_submitted_the_router_job_is_not_lost(
        isolated_user: Path, standins: Path, fakepbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22: the router job (profile ``router: job``) goes through launch's crash-safe sequence: a ``serve``
    killed -9 between its qsub and the record leaves the id in the run directory, and ``cancel`` stops the job."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "rjc.yaml").write_text(
        "name: rjc\nscheduler: pbs\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nrouter: job\nrouter_command: {ROUTER}\n")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    release = block_qsub(fakepbs)
    proc = start("serve", MODEL, "--profile", "rjc", "--preset", "single", "--name", "rk")
    until(lambda: fake_jobs(fakepbs), 30, "the router job's qsub")
    proc.kill()
    proc.wait(10)
    release.touch()
    [job] = fake_jobs(fakepbs)
    cancelled = pbstk("cancel", "rk")
    assert cancelled.exit_code == 0, cancelled.output
    until(lambda: fake_jobs(fakepbs)[job] == "F", 20, "the router job to end")
    assert rec("rk").state == "CANCELLED" and rec("rk").router_job["job_id"] == job


def test_a_keeper_whose_ticks_stopped_completing_is_reported_without_any_error() -> None:
    """A tick that hangs (a qstat, a tunnel) logs no error: a last successful tick older than 3 polls plus the
    grace is reported too; a recent one, or a keeper not running, is not."""
    from pbs_toolkit.services.keeper.process import poll_seconds
    from pbs_toolkit.services.status import STUCK_GRACE_S, ServiceStatus

    svc = records.ServiceRecord(name="h", model="m", served_model_name="m", profile="p", replicas=1, request={})
    old = time.time() - 3 * poll_seconds() - STUCK_GRACE_S - 5
    hung = ServiceStatus(svc, "READY", 1, [], True, True, keeper_tick={"ok_at": old, "error": None})
    assert hung.keeper_stuck and "none since" in hung.keeper_stuck
    assert ServiceStatus(svc, "READY", 1, [], True, True, keeper_tick={"ok_at": time.time()}).keeper_stuck is None
    assert ServiceStatus(svc, "READY", 1, [], False, True, keeper_tick={"ok_at": old}).keeper_stuck is None
