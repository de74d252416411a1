"""One replica-health judgement (services/health.py) and the busy look it rests on (jobs/rundir.py ``busy``,
jobs/judge.py): pure rules, and one look at a real loopback server whose ``/health`` answers late."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pbs_toolkit.jobs.rundir import VERIFIED_KEY, look
from pbs_toolkit.jobs.status import JobStatus, ServerState, combine
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.services import health
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.transports.local import LocalRunner

URL = "http://127.0.0.1:9001"


def _record(job: str = "1.x", run_dir: str = "/nonexistent") -> JobRecord:
    return JobRecord(job_id=job, scheduler="local", profile="p", model="m", served_model_name="m", preset="x",
                     name=job, run_dir=run_dir)


def _st(state: str, job: str = "1.x", busy: str | None = None) -> JobStatus:
    return JobStatus(record=_record(job), state=ServerState(state), address="127.0.0.1", port=9001, busy=busy)


def _rec() -> ServiceRecord:
    return ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=1, request={},
                         slots=[Slot(0, current="1.x")])


def test_a_routable_replica_leaves_the_router_after_patience_or_at_once_when_it_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PBSTK_SERVICE_UNHEALTHY_LOOKS", raising=False)
    monkeypatch.delenv("PBSTK_SERVICE_UNHEALTHY_S", raising=False)
    rec = _rec()
    # failed looks: kept until 3 of them span 15 s (vllm-router's own 3 checks x 5 s)
    assert health.leave_router(rec, _st("STARTING"), 100.0) is None
    assert health.leave_router(rec, _st("UNKNOWN"), 105.0) is None
    assert health.leave_router(rec, _st("STARTING"), 110.0) is None  # 3 looks, only 10 s
    assert health.leave_router(rec, _st("READY"), 111.0) is None and rec.health == {}  # a good look: count again
    for t in (120.0, 121.0, 122.0, 130.0):
        assert health.leave_router(rec, _st("STARTING"), t) is None
    why = health.leave_router(rec, _st("STARTING"), 135.0)
    assert why == "STARTING on 5 looks in a row over 15 s" and rec.health == {}
    # an ended job leaves at once
    st = _st("FAILED")
    st.reason = "vLLM exited with code 137"
    assert health.leave_router(rec, st, 200.0) == "FAILED: vLLM exited with code 137"
    # the bounds come from the environment
    monkeypatch.setenv("PBSTK_SERVICE_UNHEALTHY_LOOKS", "1")
    monkeypatch.setenv("PBSTK_SERVICE_UNHEALTHY_S", "0")
    assert health.leave_router(_rec(), _st("STARTING"), 0.0) == "STARTING on 1 looks in a row over 0 s"


def test_routable_is_in_the_router_and_not_ended_and_scale_down_takes_a_slow_one_last() -> None:
    routed = {URL}
    assert health.routable(_st("READY"), routed) and health.routable(_st("STARTING"), routed)
    assert not health.routable(_st("FAILED"), routed) and not health.routable(_st("READY"), set())
    slot = Slot(0, current="1.x")
    assert health.routable_count([slot], {"1.x": _st("STARTING")}, routed) == 1
    assert not health.still_starting([slot], {"1.x": _st("STARTING")}, routed)  # it serves: not on its way
    assert health.still_starting([slot], {"1.x": _st("STARTING")}, set())
    assert health.slow(_st("READY", busy="probe slow; 2 running, 6 waiting"), routed)
    assert health.slow(_st("STARTING"), routed) and not health.slow(_st("READY"), routed)


def test_scale_down_drains_a_slow_serving_replica_and_picks_a_brisk_one_first() -> None:
    from pbs_toolkit.services.keeper.autoscale import Decision
    from pbs_toolkit.services.keeper.scaler import shrink, to_cancel

    one = JobStatus(record=_record("1.x"), state=ServerState.READY, address="127.0.0.1", port=9001)
    two = JobStatus(record=_record("2.x"), state=ServerState.STARTING, address="127.0.0.1", port=9002)
    statuses = {"1.x": one, "2.x": two}
    routed = {URL, "http://127.0.0.1:9002"}
    rec = ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=2, request={},
                        slots=[Slot(0, current="1.x"), Slot(1, current="2.x")], scale={"spec": {}})
    shrink(rec, statuses, routed, Decision("down", "calm"))
    assert [s.retiring for s in rec.slots] == [True, False]  # the newest is slow (its look failed): kept
    slow = Slot(1, current="2.x", retiring=True)
    assert to_cancel(slow, statuses, routed) == [] and slow.draining == "2.x"  # routable: drained, not cut off


def test_a_probe_that_timed_out_while_metrics_show_requests_is_busy_not_starting() -> None:
    marker = {"phase": "ready", "port": 9001, "address": "127.0.0.1"}
    busy = "probe slow; 2 running, 6 waiting"
    st = combine(_record(), None, marker, [], None, answered=False, busy=busy)  # the scheduler silent: not READY
    assert st.state is ServerState.UNKNOWN
    from pbs_toolkit.schedulers import SchedState, SchedulerJob

    running = SchedulerJob("1.x", SchedState.RUNNING, "R")
    st = combine(_record(), running, marker, [], None, busy=busy)
    assert (st.state, st.busy) == (ServerState.READY, busy)
    assert combine(_record(), running, marker, [], None).state is ServerState.STARTING
    assert combine(_record(), running, marker, ["torch.OutOfMemoryError: CUDA out of memory."], None,
                   busy=busy).state is ServerState.FAILED


class _Slow(http.server.BaseHTTPRequestHandler):
    """``/health`` late (overloaded), ``/metrics`` at once with requests running."""

    running = 2

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            time.sleep(1.5)
        body = (f"vllm:num_requests_running {self.running}\nvllm:num_requests_waiting 6\n".encode()
                if self.path == "/metrics" else b"")
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:  # the probe gave up before the late answer: as pbstk does
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_look_asks_metrics_when_health_times_out_only_for_a_server_proved_ours(
        slow_server: http.server.ThreadingHTTPServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_PROBE_TIMEOUT_S", "0.3")
    port = slow_server.server_address[1]
    (tmp_path / "server.json").write_text(f'{{"phase": "ready", "port": {port}, "address": "127.0.0.1"}}')
    record = _record(run_dir=str(tmp_path))
    assert look(LocalRunner(), record, None).busy is None  # never verified at this address: no claim
    record.extra[VERIFIED_KEY] = f"127.0.0.1:{port}"
    view = look(LocalRunner(), record, None)
    assert view.health is None and view.busy == "probe slow; 2 running, 6 waiting"
    monkeypatch.setattr(_Slow, "running", 0)
    assert look(LocalRunner(), record, None).busy == "probe slow; 0 running, 6 waiting"
    slow_server.shutdown()
    slow_server.server_close()  # gone: connections refused, nothing busy about it
    assert look(LocalRunner(), record, None).busy is None


def test_the_patience_comes_from_the_profile_as_serve_recorded_it_and_the_environment_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PBSTK_SERVICE_UNHEALTHY_LOOKS", raising=False)
    monkeypatch.delenv("PBSTK_SERVICE_UNHEALTHY_S", raising=False)
    rec = _rec()
    rec.health_rule = {"looks": 2, "seconds": 4.0}  # replica_unhealthy_looks: 2, replica_unhealthy_after: 4s
    assert (health.unhealthy_looks(rec), health.unhealthy_seconds(rec)) == (2, 4.0)
    assert health.leave_router(rec, _st("STARTING"), 0.0) is None
    assert health.leave_router(rec, _st("STARTING"), 4.0) == "STARTING on 2 looks in a row over 4 s"
    monkeypatch.setenv("PBSTK_SERVICE_UNHEALTHY_LOOKS", "5")
    assert health.unhealthy_looks(rec) == 5 and health.unhealthy_looks() == 5


@pytest.mark.parametrize(("line", "words"), [
    ("replica_unhealthy_looks: 0\n", "'replica_unhealthy_looks' must be a whole number from 1 to 1000"),
    ("replica_unhealthy_after: soon\n", "replica_unhealthy_after 'soon': expected a duration"),
])
def test_a_bad_patience_in_the_profile_is_one_error_line(isolated_user: Any, standins: Any, line: str,
                                                         words: str) -> None:
    from helpers import MODEL, pbstk

    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "svc.yaml").write_text("name: svc\nscheduler: local\nnodes: 1\ngpus_per_node: 1\n" + line)
    result = pbstk("serve", MODEL, "--profile", "svc", "--replicas", "1")
    assert result.exit_code != 0 and result.output.count("pbstk: error:") == 1, result.output
    assert words in result.output, result.output


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A worker whose ``/health`` is fine and that answers every request 503 (overloaded)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_the_autoscaler_reads_the_requests_the_real_router_failed(isolated_user: Any, tmp_path: Any) -> None:
    """The real vllm-router (behind pbstk's front) in front of a worker that answers 503: the requests it gave up
    on reach the policy as ``refused``, counted from the previous tick."""
    import sys
    from pathlib import Path

    import requests

    from pbs_toolkit.client import Client
    from pbs_toolkit.services.keeper import scaler
    from pbs_toolkit.services.router import process as router

    binary = Path(sys.executable).parent / "vllm-router"
    if not binary.exists():
        pytest.skip("vllm-router is not installed next to this Python")
    worker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    worker.daemon_threads = True
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    runner = LocalRunner()
    info = router.start_router(runner, str(tmp_path / "r"), command=[str(binary)])
    try:
        with router.open_admin(runner, info) as admin:
            admin.add_worker(f"http://127.0.0.1:{worker.server_address[1]}")
        rec = ServiceRecord(name="f", model="m", served_model_name="m", profile="p", replicas=1, request={},
                            router=info.to_dict(), scale={"spec": {}})
        with Client(on_removal=lambda r: None) as client:
            session = client.service_session()
            # what the scaler's tick does: one look at the router's Prometheus port, then the count since the last
            assert scaler.refused_since(rec, scaler.router_look(session, rec)) is None  # the first only sets the mark
            for _ in range(2):
                answer = requests.post(f"{info.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
                assert answer.status_code == 503
            refused = scaler.refused_since(rec, scaler.router_look(session, rec))
            assert refused is not None and refused >= 2, (refused, rec.scale)
            assert scaler.refused_since(rec, scaler.router_look(session, rec)) == 0  # nothing failed since
    finally:
        router.stop_router(runner, info, timeout=3)
        worker.shutdown()
        worker.server_close()


class _Holding(http.server.BaseHTTPRequestHandler):
    """A worker that holds every request until ``release`` is set (requests open at the router), then answers."""

    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.release.wait(60)
        body = b'{"choices": [{"text": "x"}]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_the_autoscaler_reads_the_requests_open_at_the_real_router(isolated_user: Any, tmp_path: Any,
                                                                   policy: str) -> None:
    """The real vllm-router (behind pbstk's front) with 5 requests held by its workers: the scaler's look at its
    Prometheus port counts 5 open (``running_requests`` with power_of_two; sent less ended with round_robin, which
    exports no such gauge), and 0 once they are answered."""
    import sys
    from pathlib import Path

    import requests

    from pbs_toolkit.client import Client
    from pbs_toolkit.services.keeper import scaler
    from pbs_toolkit.services.router import process as router

    binary = Path(sys.executable).parent / "vllm-router"
    if not binary.exists():
        pytest.skip("vllm-router is not installed next to this Python")
    _Holding.release = threading.Event()
    workers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Holding) for _ in range(2)]
    for w in workers:
        w.daemon_threads = True
        threading.Thread(target=w.serve_forever, daemon=True).start()
    runner = LocalRunner()
    urls = [f"http://127.0.0.1:{w.server_address[1]}" for w in workers]
    info = router.start_router(runner, str(tmp_path / "r"), command=[str(binary)], policy=policy, worker_urls=urls)
    codes: list[Any] = []

    def ask() -> None:
        try:
            codes.append(requests.post(f"{info.url}/v1/completions", json={"model": "m", "prompt": "x"},
                                       timeout=60).status_code)
        except requests.RequestException as exc:
            codes.append(repr(exc))

    clients = [threading.Thread(target=ask, daemon=True) for _ in range(5)]
    try:
        rec = ServiceRecord(name="f", model="m", served_model_name="m", profile="p", replicas=1, request={},
                            router=info.to_dict(), scale={"spec": {}})
        with Client(on_removal=lambda r: None) as client:
            session = client.service_session()
            for t in clients:
                t.start()
            seen: list[Any] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not seen or seen[-1] != 5.0):
                seen.append((snap := scaler.router_look(session, rec)) and snap.in_flight)
                time.sleep(0.1)
            assert seen[-1] == 5.0, seen
            _Holding.release.set()
            for t in clients:
                t.join(60)
            assert codes == [200] * 5, codes
            assert (snap := scaler.router_look(session, rec)) is not None and snap.in_flight == 0.0
    finally:
        _Holding.release.set()
        router.stop_router(runner, info, timeout=3)
        for w in workers:
            w.shutdown()
            w.server_close()


def test_a_failed_look_is_busy_while_the_router_sees_its_requests_end() -> None:
    """vLLM's /metrics times out with its /health under overload: the router's view decides. Requests open to the
    replica and some ended since the previous look: READY (busy); none ended (a hung engine): the failed look
    stands; a replica out of the router or one that ended is never marked."""
    from pbs_toolkit.services.router.metrics import parse_router_metrics

    def snap(processed: int, ended: int) -> Any:
        return parse_router_metrics(f'vllm_router_processed_requests_total{{worker="{URL}"}} {processed}\n'
                                    f'vllm_router_cb_outcomes_total{{worker="{URL}",outcome="success"}} {ended}\n',
                                    0.0)

    health._SUCCEEDED_BEFORE.clear()
    first = {"1.x": _st("STARTING")}
    assert health.needs_router_view(first, {URL}) and not health.needs_router_view(first, set())
    why: dict[str, str] = {}
    assert health.busy_at_router(first, {URL}, snap(10, 2), why) == []  # the first look only sets the mark
    assert first["1.x"].state is ServerState.STARTING
    assert why == {"1.x": "the router's first count of its answers: nothing to compare yet"}
    moving = {"1.x": _st("STARTING")}
    why.clear()
    assert health.busy_at_router(moving, {URL}, snap(20, 5), why) == ["1.x"] and why == {}
    assert moving["1.x"].state is ServerState.READY
    assert moving["1.x"].busy == "probe slow; 15 open at the router, 3 answered since the last look"
    hung = {"1.x": _st("STARTING")}
    assert health.busy_at_router(hung, {URL}, snap(20, 5), why) == [] and hung["1.x"].state is ServerState.STARTING
    assert why == {"1.x": "15 open at the router, none answered since the last look"}
    # requests ended, none open: nothing says it is busy (on one H200 a load sent straight to the replica, past
    # the router, kept its probes timing out: three such looks took it out of the router)
    idle = {"1.x": _st("UNKNOWN")}
    assert health.busy_at_router(idle, {URL}, snap(20, 20), why) == [] and idle["1.x"].state is ServerState.UNKNOWN
    assert why["1.x"] == "no request open to it at the router"
    ended = {"1.x": _st("FAILED")}
    assert health.busy_at_router(ended, {URL}, snap(30, 21)) == [] and ended["1.x"].state is ServerState.FAILED
    assert health.busy_at_router({"1.x": _st("STARTING")}, set(), snap(40, 30)) == []


def test_requests_failing_at_the_router_do_not_make_a_replica_busy() -> None:
    """A dead worker's requests end too, as failures: only successes since the previous look show progress."""
    from pbs_toolkit.services.router.metrics import parse_router_metrics

    def snap(processed: int, ok: int, failed: int) -> Any:
        return parse_router_metrics(f'vllm_router_processed_requests_total{{worker="{URL}"}} {processed}\n'
                                    f'vllm_router_cb_outcomes_total{{worker="{URL}",outcome="success"}} {ok}\n'
                                    f'vllm_router_cb_outcomes_total{{worker="{URL}",outcome="failure"}} {failed}\n',
                                    0.0)

    health._SUCCEEDED_BEFORE.clear()
    assert snap(20, 5, 3).open_to(URL) == 12 and snap(20, 5, 3).in_flight == 12
    assert health.busy_at_router({"1.x": _st("STARTING")}, {URL}, snap(20, 5, 3)) == []
    dead = {"1.x": _st("STARTING")}
    assert health.busy_at_router(dead, {URL}, snap(30, 5, 9)) == [] and dead["1.x"].state is ServerState.STARTING


def test_a_failed_look_the_router_cannot_vouch_for_counts_and_the_keepers_log_says_why(
        isolated_user: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed look that the router's figures cannot vouch for counts, and the keeper's log says why (on one H200
    the log of a replica taken out after three failed looks said nothing of what the router saw)."""
    import socket

    from pbs_toolkit.client import Client
    from pbs_toolkit.services.keeper import scaler

    with socket.socket() as s:  # a port that nothing listens on: the router's Prometheus port, gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = _rec()
    rec.router = {"host": "127.0.0.1", "port": port, "prometheus_port": port}
    health._SUCCEEDED_BEFORE.clear()
    with Client(on_removal=lambda r: None) as client:
        session = client.service_session()
        assert scaler.step(session, rec, {"1.x": _st("READY")}, {URL}) is None
        assert capsys.readouterr().err == ""  # a READY look needs no verdict: the router is not asked
        failed = {"1.x": _st("STARTING")}
        assert scaler.step(session, rec, failed, {URL}) is None
    log = capsys.readouterr().err
    assert "the router's figures could not be read (" in log and f"127.0.0.1:{port}" in log, log
    assert "a routable replica's failed look counts" in log and failed["1.x"].state is ServerState.STARTING
    assert health.leave_router(rec, failed["1.x"], time.time()) is None  # one failed look of 3: still routed
