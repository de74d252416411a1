"""Only the owner changes the router's membership: the real vllm-router behind pbstk's front
(``server/router_front.py``: the router in a private network namespace), a stand-in replica with the service's key,
and a rogue worker on loopback that another user re-adds through the public URL every 50 ms.

The rogue runs 3 s here, not the 20 s of ``benchmarks/cpu/bench_router_rogue.py`` (which prints the counts): without the
front the router hands it about a third of the requests within the first second (the last test keeps that under
test), so 3 s of round-robin traffic at tens of requests a second cannot miss it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import STANDINS
from helpers import until

from pbs_toolkit.services.router.process import ADMIN_HEADER, RouterInfo, open_admin, start_router, stop_router
from pbs_toolkit.transports.local import LocalRunner

ROUTER = Path(sys.executable).parent / "vllm-router"
KEY = "the-service-key"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


class Rogue:
    """Another user's worker on loopback: answers everything 200 and records every request it gets."""

    def __init__(self) -> None:
        seen: list[tuple[str, str, str]] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, self.headers.get("Authorization") or ""))
                body = b'{"choices": [{"message": {"role": "assistant", "content": "stolen"}}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _start_replica() -> tuple[subprocess.Popen[bytes], str]:
    """A stand-in vLLM server that wants the service's key, answering."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_API_KEY": KEY, "PBSTK_TEST_STANDIN_DELAY": "0"}
    proc = subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, str(STANDINS / "vllm"), "serve", "m", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    until(lambda: _status(f"{url}/health") == 200, 15, "the stand-in replica")
    return proc, url


@pytest.fixture
def replica() -> Iterator[str]:
    proc, url = _start_replica()
    try:
        yield url
    finally:
        proc.kill()
        proc.wait(5)


@pytest.fixture
def rogue() -> Iterator[Rogue]:
    r = Rogue()
    yield r
    r.close()


@pytest.fixture
def router(tmp_path: Path, replica: str) -> Iterator[Any]:
    started: list[RouterInfo] = []

    def start(isolate: bool = True) -> RouterInfo:
        info = start_router(LocalRunner(), str(tmp_path / "router"), command=[str(ROUTER)], worker_urls=[replica],
                            isolate=isolate)
        started.append(info)
        return info

    yield start
    for info in started:
        stop_router(LocalRunner(), info, timeout=3)


def _status(url: str, method: str = "GET", **kw: Any) -> int | None:
    try:
        return requests.request(method, url, timeout=2, **kw).status_code
    except requests.RequestException:
        return None


def _attack(info: RouterInfo, rogue: Rogue, seconds: float) -> tuple[Counter[int | None], Counter[int | None]]:
    """Re-add the rogue every 50 ms (as plain admin calls and through path tricks) while a client sends
    authenticated requests through the service URL; the admin answers and the client's answers, counted."""
    stop = threading.Event()
    adds: Counter[int | None] = Counter()
    tricks = [f"/add_worker?url={rogue.url}", f"//add_worker?url={rogue.url}", f"/v1/../add_worker?url={rogue.url}",
              f"/v1/%2e%2e/add_worker?url={rogue.url}", f"/%61dd_worker?url={rogue.url}"]

    def attacker() -> None:
        i = 0
        while not stop.is_set():
            headers = {ADMIN_HEADER: "guessed"} if i % 2 else {}
            adds[_status(info.url + tricks[i % len(tricks)], "POST", headers=headers)] += 1
            i += 1
            stop.wait(0.05)

    thread = threading.Thread(target=attacker)
    thread.start()
    answers: Counter[int | None] = Counter()
    deadline = time.monotonic() + seconds
    try:
        with requests.Session() as client:
            while time.monotonic() < deadline:
                try:
                    answer = client.post(f"{info.url}/v1/chat/completions", json=CHAT, timeout=10,
                                         headers={"Authorization": f"Bearer {KEY}"})
                    answers[answer.status_code] += 1
                except requests.RequestException:
                    answers[None] += 1
    finally:
        stop.set()
        thread.join(10)
    return adds, answers


def test_a_worker_re_added_every_50ms_by_another_user_gets_no_request(router: Any, rogue: Rogue,
                                                                     replica: str) -> None:
    info = router()
    adds, answers = _attack(info, rogue, 3.0)
    assert rogue.seen == []  # not a request, not even a health check: the key never reached it
    assert set(adds) <= {400, 403} and adds[403] > 10, adds
    assert set(answers) == {200} and answers[200] >= 10, answers  # without the front, ~half go to the rogue
    with open_admin(LocalRunner(), info) as admin:  # the owner (who holds the token) still manages it
        assert admin.workers() == [replica]
        admin.remove_worker(replica)
        assert admin.workers() == []
        admin.add_worker(replica)
        assert admin.workers() == [replica]


def test_the_routers_own_port_is_not_on_the_hosts_network(router: Any, replica: str) -> None:
    info = router()
    log = Path(info.run_dir, "router.log").read_text(errors="replace")
    inner = int(re.findall(r"Starting server on 127\.0\.0\.1:(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", log))[-1])
    assert inner not in (info.port, info.prometheus_port)
    try:
        answer = requests.get(f"http://127.0.0.1:{inner}/list_workers", timeout=2).text
    except requests.ConnectionError:
        answer = ""  # refused: nothing listens there on the host
    assert replica not in answer
    # the public endpoints still work: the service URL, its worker list, the router's Prometheus metrics
    assert requests.get(f"{info.url}/list_workers", timeout=5).json()["urls"] == [replica]
    assert _status(f"{info.url}/v1/chat/completions", "POST", json=CHAT) == 401  # no key: the replica's 401
    assert "vllm_router" in requests.get(f"http://127.0.0.1:{info.prometheus_port}/metrics", timeout=5).text
    # every other path is the owner's: 403 without the token, passed on with it
    assert _status(f"{info.url}/get_loads") == 403
    assert _status(f"{info.url}/get_loads", headers={ADMIN_HEADER: info.admin_token}) == 200
    # a chunked request body and a streamed answer pass through whole
    body = iter([b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], ',
                 b'"max_tokens": 2, "stream": true}'])
    streamed = requests.post(f"{info.url}/v1/chat/completions", data=body, timeout=10,
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    with socket.create_connection(("127.0.0.1", info.port), timeout=5) as s:  # a head over 64 KiB: refused
        s.sendall(b"GET /v1/models HTTP/1.1\r\nX: " + b"0" * 70000 + b"\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 431 ")


def test_without_the_front_the_rogue_gets_traffic(router: Any, rogue: Rogue) -> None:
    """What the front closes (router_isolation: none): anyone who reaches the port adds a worker and gets
    requests with the service's key."""
    info = router(isolate=False)
    _adds, _answers = _attack(info, rogue, 3.0)
    stolen = [auth for method, path, auth in rogue.seen if path == "/v1/chat/completions"]
    assert stolen and set(stolen) == {f"Bearer {KEY}"}


@pytest.mark.ssh
def test_a_login_node_router_is_behind_the_front_too(login_node: Any, replica: str, tmp_path: Path) -> None:
    """The login placement (over SSH, real sshd on loopback): the router started there is in its own namespace;
    its admin API answers the owner's token only, also through pbstk's tunnel."""
    from pbs_toolkit.transports.ssh import SSHRunner
    from pbs_toolkit.transports.tunnel import start_tunnel

    with SSHRunner(login_node.alias, config_path=login_node.ssh_config,
                   known_hosts_path=login_node.known_hosts) as runner:
        info = start_router(runner, str(tmp_path / "login-router"), command=[str(ROUTER)])
        try:
            assert info.admin_token == info.token and info.admin_token not in repr(info)
            with start_tunnel(runner, info.host, info.port) as tunnel:
                assert _status(f"{tunnel.url}/add_worker?url={replica}", "POST") == 403
            with open_admin(runner, info) as admin:
                admin.add_worker(replica)
                assert admin.workers() == [replica]
            assert "pbstk-router-front: router pid" in runner.read_bytes(f"{info.run_dir}/router.log").decode()
        finally:
            stop_router(runner, info, timeout=3)


def test_no_python3_on_the_routers_host_or_a_bad_isolation_key_is_one_clear_error(
        isolated_user: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from helpers import MODEL, pbstk

    from pbs_toolkit.services.router.process import RouterError

    bin_dir = tmp_path / "bin"  # a host with bash and the router, but no python3 (next to the router or on PATH)
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    (bin_dir / "vllm-router").symlink_to(ROUTER)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(RouterError, match="python3 not found on this machine: the router's front needs it"):
        start_router(LocalRunner(), str(tmp_path / "r"), command=["vllm-router"])
    monkeypatch.setenv("PATH", path)
    (isolated_user / "config" / "pbstk" / "profiles").mkdir(parents=True, exist_ok=True)
    (isolated_user / "config" / "pbstk" / "profiles" / "iso.yaml").write_text(
        "name: iso\nscheduler: local\naddress: loopback\nrouter_isolation: open\n")
    result = pbstk("serve", MODEL, "--profile", "iso")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "key 'router_isolation' must be one of netns, none, got 'open'" in result.stderr


def test_where_user_namespaces_are_off_the_front_refuses_in_one_line(tmp_path: Path) -> None:
    """A host whose limit on user namespaces is 0 (set here in a namespace of the test's own, so nothing else
    is touched): the front says why and what to do, exits 1, and starts no router."""
    from pbs_toolkit.services.router.process import FRONT_SOURCE

    marker = tmp_path / "router-started"
    script = 'echo 0 >/proc/sys/user/max_user_namespaces && exec "$@"'
    result = subprocess.run(  # noqa: S603 - argument list
        ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", sys.executable, str(FRONT_SOURCE),
         "127.0.0.1", "0", "0", "--", "touch", str(marker)],  # ports 0: any free ones
        env={**os.environ, "PBSTK_ROUTER_TOKEN": "t"}, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1 and not marker.exists(), result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        "pbstk-router-front: error: cannot give the router a private network namespace ("), result.stderr
    assert "set router_isolation: none in the profile to run it unprotected" in result.stderr


@pytest.mark.parametrize("isolate", [True, False], ids=["netns", "none"])
def test_a_replica_killed_under_a_request_loop_costs_no_request(tmp_path: Path, isolate: bool) -> None:
    """Two replicas, 3 clients in a loop that retry nothing; one replica SIGTERMed: the router retries what its
    dead worker refused on the other one, through the front as without it (issue 28, item 4)."""
    started = [_start_replica(), _start_replica()]
    info = start_router(LocalRunner(), str(tmp_path / "router"), command=[str(ROUTER)],
                        worker_urls=[url for _, url in started], isolate=isolate, policy="power_of_two")
    answers: Counter[Any] = Counter()
    stop = threading.Event()
    deadline = time.monotonic() + 120  # bounded whatever happens

    def client() -> None:
        with requests.Session() as session:
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    answers[session.post(f"{info.url}/v1/chat/completions", json=CHAT, timeout=30,
                                         headers={"Authorization": f"Bearer {KEY}"}).status_code] += 1
                except requests.RequestException as exc:
                    answers[type(exc).__name__] += 1

    threads = [threading.Thread(target=client) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        until(lambda: answers[200] >= 30, 30, "steady traffic through both replicas")
        victim = started[0][0]
        victim.terminate()
        victim.wait(10)
        after = sum(answers.values())
        until(lambda: sum(answers.values()) >= after + 60, 60, "60 more requests after the kill")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        stop_router(LocalRunner(), info, timeout=3)
        for proc, _ in started:
            proc.kill()
            proc.wait(5)
    assert set(answers) == {200}, answers


class KeepAliveWorker:
    """A worker that keeps connections open (HTTP/1.1, as vLLM's server does) and counts those it was given:
    chat answers with a Content-Length, streams chunked."""

    def __init__(self, idle_close_s: float | None = None) -> None:
        self.connections = self.closed = 0
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close_s  # an idle connection is closed by the worker after so long

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                worker.connections += 1

            def finish(self) -> None:
                super().finish()
                worker.closed += 1

            def do_GET(self) -> None:  # /health
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                if json.loads(body or b"{}").get("stream"):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in (b"data: {}\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                answer = b'{"choices": [{"message": {"content": "kept"}}]}'
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_front_keeps_its_connections_to_a_worker_open_between_requests(tmp_path: Path) -> None:
    """Behind the front, the router's requests reach a worker that keeps connections open on connections the
    front kept (as the router alone does), not on a new one each: vLLM's API server then spends no CPU on a new
    connection per request (docs/services.md, "Where a service's time to first token goes"). Answers and streams
    pass whole."""
    worker = KeepAliveWorker()
    info = start_router(LocalRunner(), str(tmp_path / "router"), command=[str(ROUTER)], worker_urls=[worker.url])
    try:
        first = worker.connections
        for i in range(30):
            stream = i % 3 == 0
            answer = requests.post(f"{info.url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
            assert answer.status_code == 200, answer.text
            assert answer.text.endswith("data: [DONE]\n\n") if stream else answer.json()["choices"], answer.text
        used = worker.connections - first
    finally:
        stop_router(LocalRunner(), info, timeout=3)
        worker.server.shutdown()
        worker.server.server_close()
    assert used <= 10, f"{used} connections for 30 requests"  # one per request without kept connections


def test_a_kept_connection_the_worker_closed_is_not_used(tmp_path: Path) -> None:
    """A worker that closes its idle connections (as vLLM's uvicorn does after 5 s): each request after such a close
    goes on a new connection and is answered at the first try; none meets the closed one (which the router would
    retry: its retry counter must not move)."""
    worker = KeepAliveWorker(idle_close_s=0.2)
    info = start_router(LocalRunner(), str(tmp_path / "router"), command=[str(ROUTER)], worker_urls=[worker.url])

    def retries() -> float:
        text = requests.get(f"http://127.0.0.1:{info.prometheus_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm_router_retries_total"))

    try:
        before = retries()
        for _ in range(8):
            until(lambda: worker.closed == worker.connections, 10, "the worker to close its idle connections")
            answer = requests.post(f"{info.url}/v1/chat/completions", json=CHAT, timeout=10)
            assert answer.status_code == 200 and answer.json()["choices"], answer.text
        assert retries() == before
    finally:
        stop_router(LocalRunner(), info, timeout=3)
        worker.server.shutdown()
        worker.server.server_close()
