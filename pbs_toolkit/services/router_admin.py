"""A router's admin API (``/list_workers``, ``/add_worker``, ``/remove_worker``) and plain HTTP to it.

Two ways in: :class:`RouterAdmin` (``requests``, from this machine, directly or through an SSH tunnel:
:func:`open_admin`), and :func:`http_request` (one HTTP/1.0 request as the runner's host sees the router: a socket
here, an SSH channel on a login node), for probes and for calls before the router's URL is handed to anyone.
What the router does with these calls (idempotence, waits, no authentication of its own), and how it is
started and stopped: ``services/router.py``, which re-exports these names.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import requests

from pbs_toolkit.errors import PbstkError

if TYPE_CHECKING:
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
    """``(status, body)`` of one HTTP/1.0 request as the runner's host sees ``host:port`` (a socket here, an SSH
    channel on a login node), or ``(None, b"")`` when nothing answered. ``headers`` travel only in the request
    (an ``Authorization`` header never reaches an argv or a log). At most ``body_limit`` bytes of the body."""
    try:
        conn = runner.open_connection(host, port, timeout)
    except (OSError, PbstkError):
        return None, b""
    try:
        conn.settimeout(timeout)
        lines = [f"{method} {path} HTTP/1.0", f"Host: {host}", "Connection: close", "Content-Length: 0",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while len(data) < body_limit + 8192:
            chunk = conn.recv(8192)
            if not chunk:
                break
            data += chunk
            if not body_limit and b"\r\n" in data:
                break
        head, _, body = data.partition(b"\r\n\r\n")
        fields = head.split(b"\r\n", 1)[0].split()
        status = int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else None
        return status, body[:body_limit]
    except OSError:
        return None, b""
    finally:
        with contextlib.suppress(OSError):
            conn.close()


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
    """The router's admin API (``/list_workers``, ``/add_worker``, ``/remove_worker``): plain synchronous HTTP."""

    def __init__(self, base_url: str, timeout: float = 5.0, admin_token: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        self.session.trust_env = False  # a proxy from the environment must not see (or break) loopback calls
        if admin_token:  # the router's front lets admin calls through only with it (never in a log or argv)
            self.session.headers[ADMIN_HEADER] = admin_token

    def _call(self, method: str, path: str, timeout: float, **params: str) -> requests.Response:
        try:
            return self.session.request(method, f"{self.base_url}{path}", params=params or None, timeout=timeout)
        except requests.RequestException as exc:
            raise RouterError(f"the router at {self.base_url} did not answer {path}: {type(exc).__name__}") from exc

    def workers(self) -> list[str]:
        response = self._call("GET", "/list_workers", self.timeout)
        try:
            urls = response.json()["urls"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"the router at {self.base_url} answered /list_workers with "
                              f"{response.status_code}: {response.text[:200]}") from exc
        return [str(u) for u in urls]

    def add_worker(self, url: str) -> None:
        """Add ``url`` (idempotent). The router first waits for the worker's ``/health`` (up to ``ADD_WAIT_S``)."""
        _check_url(url)
        response = self._call("POST", "/add_worker", self.timeout + ADD_WAIT_S, url=url)
        if response.ok or (response.status_code == 400 and "already exists" in response.text):
            return
        raise RouterError(f"the router at {self.base_url} refused worker {url}: "
                          f"{response.status_code} {response.text.strip()[:200]}")

    def remove_worker(self, url: str) -> None:
        """Remove ``url`` (idempotent: a URL that is not there is fine)."""
        response = self._call("POST", "/remove_worker", self.timeout, url=url)
        if response.ok or "not found" in response.text:
            return
        raise RouterError(f"the router at {self.base_url} did not remove worker {url}: "
                          f"{response.status_code} {response.text.strip()[:200]}")

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> RouterAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """A :class:`RouterAdmin` for ``info``: direct for a router on this machine, through an SSH tunnel
    (``transports/tunnel.py``, one ``direct-tcpip`` channel per connection) for one on a login node."""
    if not info.transport:
        with RouterAdmin(info.url, admin_token=info.admin_token) as admin:
            yield admin
        return
    from pbs_toolkit.transports.tunnel import start_tunnel

    with start_tunnel(runner, info.host, info.port) as tunnel, \
            RouterAdmin(tunnel.url, admin_token=info.admin_token) as admin:
        yield admin
