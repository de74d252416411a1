"""HTTP requests to a server *as seen from the runner's machine*: the package's one HTTP client.

Over SSH the connection is a ``direct-tcpip`` channel opened by the login node, so compute nodes that are
not routable from a laptop still answer. ``http.client`` works on any socket-like object. Everything that talks
HTTP to a server, a replica or a router goes through :func:`http_request` (``tests/test_one_of_each.py`` checks that
no other module speaks HTTP on a raw socket).
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.transports.base import Runner

#: a server that accepts but does not answer costs at most this long per request (``PBSTK_PROBE_TIMEOUT_S``)
DEFAULT_PROBE_TIMEOUT_S = 3.0


def probe_timeout() -> float:
    """Seconds one status probe may take; short, since ``status`` asks every job's server."""
    return env_float("PBSTK_PROBE_TIMEOUT_S", DEFAULT_PROBE_TIMEOUT_S, lambda v: 0 < v < float("inf"))


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
    headers: dict[str, str] | None = None,
    body_limit: int | None = None,
) -> HttpAnswer:
    """One request; raises ``OSError`` (connection refused, timeout) when nothing answers.

    ``headers`` travel only in the request (a token in them never reaches an argv or a log); at most
    ``body_limit`` bytes of the answer's body are read (``0``: the status alone), all of it when ``None``.
    """
    conn = _RunnerConnection(runner, host, port, timeout)
    sent = {"Accept": "application/json"}
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    if body is not None:
        sent["Content-Type"] = "application/json"
    sent.update(headers or {})
    try:
        conn.request(method, path, body=body, headers=sent)
        resp = conn.getresponse()
        return HttpAnswer(resp.status, resp.read() if body_limit is None else resp.read(body_limit))
    except (TimeoutError, http.client.HTTPException) as exc:
        raise OSError(f"bad HTTP answer from {host}:{port}{path}: {exc}") from exc
    finally:
        conn.close()
        if conn.stream is not None:
            conn.stream.close()


def metrics_text(runner: Runner, host: str, port: int, *, api_key: str | None = None, timeout: float = 5.0,
                 what: str = "") -> str:
    """The ``/metrics`` text of the server at ``host:port``: the one fetch of every Prometheus scrape (a vLLM
    server's, ``perf/scrape.py``; the router's, ``services/router/metrics.py``; status's busy check). Raises
    ``ServerFailed`` when nothing answered or the answer was not 200 (``what`` names the server in the message);
    a ``PbstkError`` of the transport (an SSH connection that did not open) passes through."""
    where = what or f"{host}:{port}/metrics"
    try:
        answer = http_request(runner, host, port, "/metrics", api_key=api_key, timeout=timeout)
    except OSError as exc:
        raise ServerFailed(f"cannot reach {where}: {exc}") from exc
    if answer.status != 200:
        raise ServerFailed(f"{where} answered HTTP {answer.status}")
    return answer.body.decode("utf-8", "replace")


def health(runner: Runner, host: str, port: int, timeout: float | None = None) -> int | None:
    """HTTP status of ``/health``, or ``None`` when nothing answers."""
    try:
        return http_request(runner, host, port, "/health", timeout=timeout or probe_timeout()).status
    except OSError:
        return None


def reach(runner: Runner, host: str, port: int, timeout: float | None = None) -> tuple[int | None, str | None]:
    """(HTTP status of ``/health``, ``None``) or (``None``, why nothing answered: the resolver's or the socket's
    own words, e.g. ``Name or service not known``, ``Connection refused``)."""
    try:
        return http_request(runner, host, port, "/health", timeout=timeout or probe_timeout()).status, None
    except OSError as exc:
        words = exc.strerror if isinstance(exc.strerror, str) and exc.strerror else str(exc)
        return None, words or type(exc).__name__


def served_models(
    runner: Runner, host: str, port: int, api_key: str | None, timeout: float | None = None
) -> tuple[int, list[str]]:
    """(HTTP status, model ids) of ``/v1/models``."""
    answer = http_request(runner, host, port, "/v1/models", api_key=api_key, timeout=timeout or probe_timeout())
    if answer.status != 200:
        return answer.status, []
    try:
        data = answer.json()
        return 200, [str(m.get("id")) for m in data.get("data", [])]
    except (ValueError, AttributeError, TypeError):
        return answer.status, []


def held_requests(runner: Runner, host: str, port: int, api_key: str | None, timeout: float | None = None) -> int:
    """Requests in flight at a swapping model's API server by its guard's count (``GET /pbstk/inflight``,
    server/start/pbstk_dev_guard.py): those held for a sleeping engine too, which no ``/metrics`` gauge shows.
    0 where nothing answers it (a model that does not swap has no guard: vLLM's 404)."""
    try:
        answer = http_request(runner, host, port, "/pbstk/inflight", api_key=api_key,
                              timeout=timeout or probe_timeout())
        count = answer.json().get("inflight") if answer.status == 200 else 0
    except (OSError, ValueError, AttributeError):
        return 0
    return count if isinstance(count, int) else 0


@dataclass(frozen=True)
class Identity:
    """Whether the server on a job's address and port proved to be that job's own.

    ``/health`` answers anyone, so a server that merely answers may be another job's that took the port
    (two jobs on one node racing for a free port). Only the key-authenticated ``/v1/models`` listing the
    served name is proof; sending the key anywhere else would hand it to a stranger.
    """

    ours: bool
    #: the answer proves another server holds the port (key refused, other model), not just "not up yet"
    foreign: bool = False
    #: why not, in words that follow "the server": ``rejected the API key (401)``
    detail: str = ""


def identify(runner: Runner, host: str, port: int, api_key: str | None, served_name: str,
             timeout: float | None = None) -> Identity:
    """Ask ``/v1/models`` with the job's key whether ``served_name`` is served at ``host:port``."""
    try:
        code, models = served_models(runner, host, port, api_key, timeout)
    except OSError as exc:
        return Identity(False, detail=f"did not answer /v1/models ({exc})")
    if code in (401, 403):
        return Identity(False, foreign=True, detail=f"rejected the API key ({code})")
    if code != 200:
        return Identity(False, detail=f"answered /v1/models with {code}")
    if served_name not in models:
        return Identity(False, foreign=True, detail=f"serves {', '.join(models) or 'nothing'}, not {served_name}")
    return Identity(True)
