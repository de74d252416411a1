"""HTTP requests to a server *as seen from the runner's machine*.

Over SSH the connection is a ``direct-tcpip`` channel opened by the login node, so compute nodes that are
not routable from a laptop still answer. ``http.client`` works on any socket-like object.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.transports.base import Runner


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _DeferredClose:
    """A socket-like object whose ``close()`` waits for us.

    ``http.client`` closes the connection as soon as it has read the headers of a response that ends with
    the connection (HTTP/1.0, ``Connection: close``) and then reads the body through ``makefile()``. A real
    socket stays open until that file is closed too; a paramiko channel closes at once and the body is
    lost (``IncompleteRead``). ``http_request`` closes the real stream after reading the body.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class _RunnerConnection(http.client.HTTPConnection):
    def __init__(self, runner: Runner, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._runner = runner
        self.stream: Any = None

    def connect(self) -> None:
        self.stream = self._runner.open_connection(self.host, self.port, timeout=self.timeout or 5.0)
        self.sock = _DeferredClose(self.stream)  # type: ignore[assignment]


def http_request(
    runner: Runner,
    host: str,
    port: int,
    path: str,
    *,
    api_key: str | None = None,
    timeout: float = 5.0,
    method: str = "GET",
    body: bytes | None = None,
) -> HttpAnswer:
    """One request; raises ``OSError`` (connection refused, timeout) when nothing answers."""
    conn = _RunnerConnection(runner, host, port, timeout)
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return HttpAnswer(resp.status, resp.read())
    except (TimeoutError, http.client.HTTPException) as exc:
        raise OSError(f"bad HTTP answer from {host}:{port}{path}: {exc}") from exc
    finally:
        conn.close()
        if conn.stream is not None:
            conn.stream.close()


def health(runner: Runner, host: str, port: int, timeout: float = 3.0) -> int | None:
    """HTTP status of ``/health``, or ``None`` when nothing answers."""
    try:
        return http_request(runner, host, port, "/health", timeout=timeout).status
    except OSError:
        return None


def served_models(
    runner: Runner, host: str, port: int, api_key: str | None, timeout: float = 5.0
) -> tuple[int, list[str]]:
    """(HTTP status, model ids) of ``/v1/models``."""
    answer = http_request(runner, host, port, "/v1/models", api_key=api_key, timeout=timeout)
    if answer.status != 200:
        return answer.status, []
    try:
        data = answer.json()
        return 200, [str(m.get("id")) for m in data.get("data", [])]
    except (ValueError, AttributeError):
        return answer.status, []
