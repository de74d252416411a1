"""An interrupted ``pbstk serve`` orphans no router (issue 32, item 5). Real parts: ``pbstk serve --replicas 2`` as
a real process on the local scheduler with the stand-in ``vllm``, the real vllm-router behind pbstk's front, real
signals. The router is started through a wrapper that waits a little before it runs vllm-router, so that "while
serve waits for the router to answer" is a moment the test can reach by an event (the router's ``router.pid``),
not by a guess of how long a start takes.

The router's process group is the pid in ``RUN_DIR/router.pid`` (its wrapper leads the group): afterwards no
process of that group may be left, and a ``pbstk cancel`` stops what a serve killed outright left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MODEL, group_alive, interrupting, local_service_profile, pbstk, until, wait_recorded

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import keeper_alive, service_dir

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def slow_router_profile(isolated_user: Path, standins: Path, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local profile whose router command waits until the test lets it go (``go``), then runs vllm-router."""
    go = tmp_path / "router-go"
    slow = tmp_path / "slow-router"
    slow.write_text(f"#!/bin/sh\nn=0\nwhile [ ! -e '{go}' ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done\n"
                    f"exec '{ROUTER}' \"$@\"\n")
    slow.chmod(0o755)
    local_service_profile(isolated_user, slow)
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    yield str(go)
    group = _router_group("si")
    if group and group_alive(group):  # a failed test must not leave the router it started running
        os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(Exception):
        pbstk("cancel", "--all")


def _serve(name: str) -> subprocess.Popen[str]:
    """``pbstk serve --replicas 2`` as a real process, SIGINT at its default (Python then raises KeyboardInterrupt)."""
    return subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "pbs_toolkit", "serve", MODEL, "--profile", "svc", "--preset", "single",
         "--replicas", "2", "--name", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509


def _router_group(name: str) -> int:
    """The router's process group: its wrapper's pid, which the wrapper writes first thing (0: none yet)."""
    try:
        text = (service_dir(name) / "router" / "router.pid").read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0



def _replica_recorded(name: str) -> bool:
    return any(r.name == f"{name}-r0" for r in JobStore().all())


#: the moments of serve's start a SIGINT arrives at: the router launched and not answering yet (the orphan of
#: issue 32), the router answering and no replica yet, a replica recorded
POINTS = ("router starting", "router ready", "replica launched")


@pytest.mark.parametrize("point", POINTS)
def test_sigint_during_serve_leaves_no_process_of_the_service(slow_router_profile: str, point: str) -> None:
    go = Path(slow_router_profile)
    proc = _serve("si")
    with interrupting(proc, 120) as interrupt:
        group = until(lambda: _router_group("si"), 60, "the router's wrapper to start")
        if point != "router starting":
            go.touch()
            until(lambda: (service_dir("si") / "router" / "router.json").exists(), 60, "the router to answer")
            if point == "replica launched":
                until(lambda: _replica_recorded("si"), 60, "a replica to be recorded")
        err = interrupt()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    until(lambda: not group_alive(group), 30, f"the router's process group {group} to end")
    svc = records.load(JobStore(), "si")
    assert svc is not None and svc.state == "ENDED", svc
    assert not keeper_alive("si")
    for job in JobStore().all():  # a replica launched before the SIGINT was cancelled by serve's teardown
        assert wait_recorded(job.job_id, "CANCELLED", timeout=30)["state"] == "CANCELLED"
    assert pbstk("cancel", "--all").exit_code == 0 and not group_alive(group)


def test_sigterm_during_run_with_replicas_leaves_no_router(slow_router_profile: str) -> None:
    """``pbstk run --replicas 2`` starts its service the same way: SIGTERM while the router starts stops it."""
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "pbs_toolkit", "run", MODEL, "--profile", "svc", "--preset", "single", "--replicas",
         "2", "--name", "si", "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group = until(lambda: _router_group("si"), 60, "the router's wrapper to start")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    until(lambda: not group_alive(group), 30, f"the router's process group {group} to end")
    svc = records.load(JobStore(), "si")
    assert svc is not None and not svc.active, svc


@pytest.mark.parametrize("cancel", [("cancel", "si"), ("cancel", "--all")])
def test_serve_killed_while_its_router_starts_is_stopped_by_cancel(slow_router_profile: str,
                                                                   cancel: tuple[str, str]) -> None:
    """kill -9 leaves no teardown: the service and its router, recorded before serve waited, are what a later
    ``pbstk cancel NAME`` or ``cancel --all`` stops."""
    proc = _serve("si")
    try:
        group = until(lambda: _router_group("si"), 60, "the router's wrapper to start")
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert group_alive(group)
    svc = records.find(JobStore(), "si")
    assert svc is not None and svc.router.get("token"), "the router was not recorded before serve waited for it"
    cancelled = pbstk(*cancel)
    assert cancelled.exit_code == 0, cancelled.output
    until(lambda: not group_alive(group), 30, f"the router's process group {group} to end")


def test_a_router_recorded_before_its_pid_is_stopped_by_its_token(tmp_path: Path) -> None:
    """What ``start_router`` records first (pid 0: not known yet) is enough to stop the router: it is found by the
    token its wrapper carries, and only its own process group is signalled."""
    from pbs_toolkit.services.router.process import RouterInfo, router_alive, start_router, stop_router
    from pbs_toolkit.transports.local import LocalRunner

    heard: list[RouterInfo] = []
    runner = LocalRunner()
    info = start_router(runner, str(tmp_path / "router"), command=[str(ROUTER)],
                        record=lambda i: heard.append(RouterInfo.from_dict(i.to_dict())))
    try:
        assert [h.pid for h in heard] == [0, info.pid, info.pid] and heard[0].token == info.token
        # the ports come last: the start script picks them on the router's host
        assert heard[0].port == 0 and heard[-1] == info and heard[0].run_dir == info.run_dir
        assert router_alive(runner, info)
        other = RouterInfo.from_dict({**heard[0].to_dict(), "token": "not-this-routers-token"})
        assert stop_router(runner, other, timeout=2) is False and router_alive(runner, info)
        assert stop_router(runner, heard[0], timeout=5) is True
        until(lambda: not group_alive(info.pid), 30, "the router's process group to end")
    finally:
        stop_router(runner, info, timeout=2)
