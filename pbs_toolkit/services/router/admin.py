"""A router's admin API (``/list_workers``, ``/add_worker``, ``/remove_worker``) and plain HTTP to it.

Every request goes through ``transports/http.py`` as the runner's host sees the router (a socket here, an SSH
``direct-tcpip`` channel for a router on a login node): :class:`RouterAdmin` (:func:`open_admin`) for the admin
API, :func:`http_request` and :func:`http_status` for probes and for calls before the router's URL is handed to
anyone. What the router does with these calls (idempotence, waits, no authentication of its own), and how it is
started and stopped: ``services/router/process.py``, which re-exports these names.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Protocol
from urllib.parse import urlencode, urlsplit

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.transports import http
from pbs_toolkit.transports.base import Runner

#: the header the front wants, with the router's admin token, on every admin call (``/add_worker``, ...)
ADMIN_HEADER = "X-Pbstk-Router-Token"
#: how long ``/add_worker`` may wait for the worker's ``/health`` (``--worker-startup-timeout-secs`` in
#: ``router.DEFAULT_ARGS``)
ADD_WAIT_S = 20.0


class RouterError(PbstkError):
    """The router could not be started, reached or stopped (exit 1): the message says which and where."""


def http_status(runner: Runner, host: str, port: int, path: str, timeout: float = 3.0) -> int | None:
    """Status of ``GET path`` as the router's host sees it (a socket or an SSH channel), or None: no answer."""
    return http_request(runner, host, port, path, timeout=timeout, body_limit=0)[0]


def http_request(runner: Runner, host: str, port: int, path: str, *, method: str = "GET",
                 headers: dict[str, str] | None = None, timeout: float = 3.0,
                 body_limit: int = 65536) -> tuple[int | None, bytes]:
    """``(status, body)`` of one request (``transports/http.py``) as the runner's host sees ``host:port``, or
    ``(None, b"")`` when nothing answered (refused, timed out, an SSH channel that did not open). ``headers``
    travel only in the request; at most ``body_limit`` bytes of the body."""
    try:
        answer = http.http_request(runner, host, port, path, method=method, headers=headers, timeout=timeout,
                                   body_limit=body_limit)
    except (OSError, PbstkError):
        return None, b""
    return answer.status, answer.body


def list_workers(runner: Runner, host: str, port: int) -> list[str] | None:
    """The router's current workers (``GET /list_workers``, public), or None when it did not answer with a list."""
    status, body = http_request(runner, host, port, "/list_workers")
    if status != 200:
        return None
    try:
        return [str(u) for u in json.loads(body)["urls"]]
    except (ValueError, KeyError, TypeError):
        return None


class RouterAdmin:
    """The router's admin API (``/list_workers``, ``/add_worker``, ``/remove_worker``): plain synchronous HTTP
    through ``runner`` (``transports/http.py``), so a router on a login node needs no tunnel."""

    def __init__(self, runner: Runner, host: str, port: int, *, base_url: str = "", timeout: float = 5.0,
                 admin_token: str = "") -> None:
        self.runner, self.host, self.port = runner, host, port
        #: the router's URL, for messages
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.timeout = timeout
        # the router's front lets admin calls through only with it (in the request only: never a log or argv)
        self._headers = {ADMIN_HEADER: admin_token} if admin_token else {}

    def _call(self, method: str, path: str, timeout: float, body: bytes | None = None,
              **params: str) -> http.HttpAnswer:
        target = f"{path}?{urlencode(params)}" if params else path
        headers = {**self._headers, "Content-Type": "application/json"} if body is not None else self._headers
        try:
            return http.http_request(self.runner, self.host, self.port, target, method=method, body=body,
                                     headers=headers, timeout=timeout)
        except (OSError, PbstkError) as exc:
            raise RouterError(f"the router at {self.base_url} did not answer {path}: {type(exc).__name__}") from exc

    def workers(self) -> list[str]:
        answer = self._call("GET", "/list_workers", self.timeout)
        try:
            urls = answer.json()["urls"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"the router at {self.base_url} answered /list_workers with "
                              f"{answer.status}: {_text(answer)[:200]}") from exc
        return [str(u) for u in urls]

    def add_worker(self, url: str, model_id: str | None = None) -> None:
        """Add ``url`` (idempotent). The router first waits for the worker's ``/health`` (up to ``ADD_WAIT_S``).
        ``model_id``: the served name requests name it by (a router in multi-model mode, ``--enable-igw``: its
        ``POST /workers`` takes it; ``/add_worker`` would ask the worker's ``/v1/models`` without the key)."""
        _check_url(url)
        if model_id:
            answer = self._call("POST", "/workers", self.timeout + ADD_WAIT_S,
                                body=json.dumps({"url": url, "model_id": model_id}).encode())
        else:
            answer = self._call("POST", "/add_worker", self.timeout + ADD_WAIT_S, url=url)
        if _ok(answer) or (answer.status == 400 and "already exists" in _text(answer)):
            return
        raise RouterError(f"the router at {self.base_url} refused worker {url}: "
                          f"{answer.status} {_text(answer).strip()[:200]}")

    def remove_worker(self, url: str) -> None:
        """Remove ``url`` (idempotent: a URL that is not there is fine)."""
        answer = self._call("POST", "/remove_worker", self.timeout, url=url)
        if _ok(answer) or "not found" in _text(answer):
            return
        raise RouterError(f"the router at {self.base_url} did not remove worker {url}: "
                          f"{answer.status} {_text(answer).strip()[:200]}")

    def close(self) -> None:
        """Nothing to close: each call is one connection of its own."""

    def __enter__(self) -> RouterAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ok(answer: http.HttpAnswer) -> bool:
    return 200 <= answer.status < 400


def _text(answer: http.HttpAnswer) -> str:
    return answer.body.decode(errors="replace")


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterError(f"worker URL {url!r} is not an http(s) URL")


class RouterAddress(Protocol):
    """What the admin client needs of a router (``router.RouterInfo`` has it)."""

    @property
    def transport(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def url(self) -> str: ...
    @property
    def admin_token(self) -> str: ...


@contextlib.contextmanager
def open_admin(runner: Runner, info: RouterAddress) -> Iterator[RouterAdmin]:
    """A :class:`RouterAdmin` for ``info``, through ``runner`` as the router's host sees it: a socket for a router
    on this machine, one ``direct-tcpip`` channel per call for one on a login node."""
    with RouterAdmin(runner, info.host, info.port, base_url=info.url, admin_token=info.admin_token) as admin:
        yield admin
