"""The keeper keeps one router connection across its ticks (for a login-node router that is one SSH tunnel for
the keeper's life, not one per tick) and opens it afresh only after a failure or for a new router.

The router is the real vllm-router on loopback; ``open_admin`` (the real one) is wrapped to count the opens.
"""

from __future__ import annotations

import contextlib
import http.server
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import HealthOnly

from pbs_toolkit.client import Client
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.services.keeper import loop as keeper
from pbs_toolkit.services.record import ServiceRecord
from pbs_toolkit.services.router import process as router
from pbs_toolkit.transports.local import LocalRunner

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each ``open_admin`` the keeper makes, by the router URL it opened."""
    seen: list[str] = []
    real = router.open_admin

    @contextlib.contextmanager
    def counting(runner: Any, info: router.RouterInfo) -> Iterator[router.RouterAdmin]:
        seen.append(info.url)
        with real(runner, info) as admin:
            yield admin

    monkeypatch.setattr(router, "open_admin", counting)
    return seen


def test_one_router_connection_across_ticks_reopened_after_a_failure(isolated_user: Path, tmp_path: Path,
                                                                     opens: list[str]) -> None:
    runner = LocalRunner()
    first = router.start_router(runner, str(tmp_path / "r1"), command=[str(ROUTER)])
    second = None
    try:
        rec = ServiceRecord(name="k", model="m", served_model_name="m", profile="p", replicas=0, request={},
                            router=first.to_dict())
        with Client(on_removal=lambda r: None) as client, keeper.AdminLink(client.service_session()) as link:
            for _ in range(5):
                keeper.tick(client.service_session(), rec, link)
            assert opens == [first.url]  # five ticks, one connection
            router.stop_router(runner, first, timeout=5)
            with pytest.raises(PbstkError):
                keeper.tick(client.service_session(), rec, link)  # the router is gone: the tick fails, link dropped
            with pytest.raises(PbstkError):
                keeper.tick(client.service_session(), rec, link)  # and tried afresh on the next tick
            assert opens == [first.url] * 2  # the first failing tick used the kept one
            second = router.start_router(runner, str(tmp_path / "r2"), command=[str(ROUTER)])
            rec.router = second.to_dict()  # a new router: a new connection, then kept again
            for _ in range(3):
                keeper.tick(client.service_session(), rec, link)
            assert opens == [first.url] * 2 + [second.url]
    finally:
        for info in (first, second):
            if info is not None:
                router.stop_router(runner, info, timeout=3)


def test_a_worker_someone_else_added_is_removed_in_the_next_tick(isolated_user: Path, tmp_path: Path) -> None:
    """The router's admin API has no authentication: a worker the service did not add (it would receive prompts
    with the service's key) leaves the router in the keeper's next tick."""
    runner = LocalRunner()
    info = router.start_router(runner, str(tmp_path / "r"), command=[str(ROUTER)])
    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HealthOnly)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{foreign.server_address[1]}"
        with router.open_admin(runner, info) as admin:
            admin.add_worker(url)  # what anyone who reaches the port can do
            assert admin.workers() == [url]
            rec = ServiceRecord(name="f", model="m", served_model_name="m", profile="p", replicas=0, request={},
                                router=info.to_dict())
            with Client(on_removal=lambda r: None) as client:
                keeper.tick(client.service_session(), rec)
            assert admin.workers() == []
    finally:
        foreign.shutdown()
        router.stop_router(runner, info, timeout=3)


@pytest.mark.ssh
def test_a_login_node_router_is_reached_over_the_ssh_connection_across_ticks(
        login_node: Any, isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router on the login node (real sshd on loopback): ten ticks, one admin client, no tunnel (each admin
    call is a channel of the runner's SSH connection), still answering."""
    from pbs_toolkit.transports import tunnel

    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    tunnels: list[Any] = []
    real = tunnel.start_tunnel

    def counting(*args: Any, **kwargs: Any) -> Any:
        tunnels.append(real(*args, **kwargs))
        return tunnels[-1]

    monkeypatch.setattr(tunnel, "start_tunnel", counting)
    with Client(on_removal=lambda r: None) as client:
        runner = client.runner(login_node.alias)
        info = router.start_router(runner, f"{runner.home()}/.pbstk/test-keeper-router", command=[str(ROUTER)])
        try:
            assert info.transport == login_node.alias
            rec = ServiceRecord(name="k", model="m", served_model_name="m", profile="p", replicas=0, request={},
                                transport=login_node.alias, router=info.to_dict())
            with keeper.AdminLink(client.service_session()) as link:
                for _ in range(10):
                    keeper.tick(client.service_session(), rec, link)
                assert tunnels == [] and link.opened == 1
                assert link.get(rec).workers() == []  # the SSH connection still carries admin calls
        finally:
            router.stop_router(runner, info, timeout=5)


def test_a_long_tick_is_logged_with_where_its_time_went_and_a_quick_one_is_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU run's keeper log said nothing of the ticks between a burst and the scale-up 50 s later: a tick longer
    than LONG_TICK_S now says how long it took and on what; a quick one (most of a service's life) writes nothing."""
    seen = keeper.Look(spent={"job status": 6.04, "router and scaling": 3.01})
    keeper.log_long_tick(9.1, seen)
    keeper.log_long_tick(keeper.LONG_TICK_S / 2, seen)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("tick took 9.1 s (job status 6.0 s, router and scaling 3.0 s)"), lines
