"""Tunnels through LocalRunner and SSHRunner (a real sshd on 127.0.0.1) to a local http.server."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sshd import SshdInfo, start_sshd

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.transports.local import LocalRunner
from pbs_toolkit.transports.tunnel import Tunnel, start_tunnel


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like real clients

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = json.dumps({"path": self.path, "big": "x" * 200_000}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def login_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdInfo]:
    with start_sshd(tmp_path_factory.mktemp("tunnel-login")) as info:
        yield info


def _get(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback test URL
        return json.loads(response.read())  # type: ignore[no-any-return]


def _check_tunnel(runner: Runner, http_port: int) -> None:
    with start_tunnel(runner, "127.0.0.1", http_port) as tunnel:
        assert tunnel.url == f"http://127.0.0.1:{tunnel.local_port}"
        assert _get(tunnel.url + "/health")["path"] == "/health"
        with ThreadPoolExecutor(8) as pool:  # concurrent connections, each with its own forward
            paths = list(pool.map(lambda i: _get(f"{tunnel.url}/v1/{i}")["path"], range(16)))
        assert paths == [f"/v1/{i}" for i in range(16)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=2).recv(1)


def test_tunnel_through_local_runner(http_port: int) -> None:
    _check_tunnel(LocalRunner(), http_port)


@pytest.mark.ssh
def test_tunnel_through_ssh_runner(login_node: SshdInfo, http_port: int) -> None:
    from pbs_toolkit.transports.ssh import SSHRunner

    with SSHRunner(
        login_node.alias, config_path=login_node.ssh_config, known_hosts_path=login_node.known_hosts
    ) as runner:
        assert isinstance(runner, SSHRunner)
        _check_tunnel(runner, http_port)
        assert runner.connections_opened == 1


def test_refused_remote_closes_the_client_only(http_port: int) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with start_tunnel(LocalRunner(), "127.0.0.1", closed_port) as tunnel:
        with socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=5) as client:
            assert client.recv(1) == b""  # closed at once, the tunnel keeps listening
        with socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=5) as client:
            assert client.recv(1) == b""


def test_local_port_in_use(http_port: int) -> None:
    with pytest.raises(TransportError, match=f"local port {http_port} on 127.0.0.1 is already in use"):
        start_tunnel(LocalRunner(), "127.0.0.1", http_port, local_port=http_port)


def test_serve_forever_returns_after_close(http_port: int, tmp_path: Path) -> None:
    tunnel = Tunnel(LocalRunner(), "127.0.0.1", http_port)
    # would block until Ctrl-C; close() from another thread ends it too. In a thread of its own, so that a
    # serve_forever that never returns fails here within seconds instead of hanging the suite.
    server = threading.Thread(target=tunnel.serve_forever, daemon=True)
    server.start()
    threading.Timer(0.2, tunnel.close).start()
    server.join(5)
    assert not server.is_alive(), "serve_forever still blocks 5 s after close()"
    tunnel.close()  # idempotent
    with pytest.raises(ConnectionRefusedError):  # and the local port is closed
        socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=2).close()


def test_close_hooks_run_once_after_the_port_is_closed(http_port: int) -> None:
    seen: list[bool] = []
    tunnel = Tunnel(LocalRunner(), "127.0.0.1", http_port)

    def hook() -> None:  # the port is already closed when the hook runs
        with socket.socket() as probe:
            seen.append(probe.connect_ex(("127.0.0.1", tunnel.local_port)) != 0)

    tunnel.on_close(hook)
    tunnel.close()
    tunnel.close()
    assert seen == [True]
    tunnel.on_close(lambda: seen.append(False))  # added after the close: runs at once
    assert seen == [True, False]
