"""Local port forwarding through a :class:`Runner`: ``localhost:PORT`` -> a server as the login node sees it.

Each accepted connection gets its own ``runner.open_connection(remote_host, remote_port)`` (a plain socket
for ``LocalRunner``, a ``direct-tcpip`` channel on the one SSH connection for ``SSHRunner``), so a laptop
can reach a vLLM server on a compute node that only the login node can route to.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pbs_toolkit.errors import TransportError, UsageError
from pbs_toolkit.schema import stamp
from pbs_toolkit.signal_scope import handled_by
from pbs_toolkit.transports.base import Runner

log = logging.getLogger(__name__)
_CHUNK = 65536


class Tunnel:
    """Listens on ``bind:local_port`` and forwards every connection to ``remote_host:remote_port``."""

    def __init__(
        self,
        runner: Runner,
        remote_host: str,
        remote_port: int,
        local_port: int = 0,
        bind: str = "127.0.0.1",
        connect_timeout: float = 10.0,
    ) -> None:
        self.runner = runner
        self.remote_host = remote_host
        self.remote_port = remote_port
        self.bind = bind
        self.connect_timeout = connect_timeout
        if isinstance(local_port, bool) or not isinstance(local_port, int) or not 0 <= local_port <= 65535:
            # socket.bind raises OverflowError (not OSError) for these: refuse before any socket exists
            raise UsageError(f"local port {local_port!r} must be between 0 (any free port) and 65535")
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((bind, local_port))
        except OSError as exc:
            self._listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise TransportError(
                    f"local port {local_port} on {bind} is already in use; choose another port "
                    "(or 0 for any free one)"
                ) from exc
            raise TransportError(f"cannot listen on {bind}:{local_port}: {exc.strerror or exc}") from exc
        self._listener.listen(64)
        self.local_port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()  # wakes the accept loop on close (portable)
        self._closed = threading.Event()
        self._close_lock = threading.Lock()  # a second close() waits until the first has closed the sockets
        self._shut = False
        self._streams: set[Any] = set()
        self._streams_lock = threading.Lock()
        self._on_close: list[Callable[[], object]] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="pbstk-tunnel")
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (the address clients on this machine should use)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bind, self.bind)
        return f"http://[{host}]:{self.local_port}" if ":" in host else f"http://{host}:{self.local_port}"

    def to_dict(self, status: Any = None) -> dict[str, Any]:
        """A ``tunnel`` object (``tunnel --json``; docs/json.md); ``status``: the job's READY ``JobStatus``."""
        record = getattr(status, "record", None)
        return stamp("tunnel", {
            "job_id": record.job_id if record else None, "model": record.served_model_name if record else None,
            "local_url": f"{self.url}/v1", "local_port": self.local_port,
            "remote_url": getattr(status, "url", None) or f"http://{self.remote_host}:{self.remote_port}/v1",
        })

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._listener, self._wake_r], [], [])
            except (OSError, ValueError):
                return
            if self._wake_r in ready or self._closed.is_set():
                return
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            threading.Thread(
                target=self._forward, args=(client,), daemon=True, name="pbstk-tunnel-conn"
            ).start()

    def _forward(self, client: socket.socket) -> None:
        try:
            remote = self.runner.open_connection(self.remote_host, self.remote_port, self.connect_timeout)
        except (OSError, TransportError) as exc:
            log.warning("tunnel: cannot reach %s:%s: %s", self.remote_host, self.remote_port, exc)
            client.close()
            return
        remote.settimeout(None)  # an idle keep-alive connection is not an error
        with self._streams_lock:
            if self._closed.is_set():
                client.close()
                remote.close()
                return
            self._streams.update((client, remote))
        upstream = threading.Thread(target=_pump, args=(client, remote), daemon=True, name="pbstk-tunnel-up")
        upstream.start()
        _pump(remote, client)
        upstream.join()
        with self._streams_lock:
            self._streams.difference_update((client, remote))
        for stream in (client, remote):
            _quiet_close(stream)

    def close(self) -> None:
        """Stop listening and drop every forwarded connection. Safe to call more than once, also from several
        threads at once: every call returns only once the port is closed (serve_forever's own close() used to
        return while another thread's close() was still joining the accept loop, the listener still open)."""
        with self._close_lock:
            if self._shut:
                return
            self._closed.set()
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join(timeout=5)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            with self._streams_lock:
                streams, self._streams = list(self._streams), set()
            for stream in streams:
                _quiet_close(stream)
            self._shut = True
            hooks, self._on_close = self._on_close, []
        for hook in hooks:  # the port is closed: what was only valid while it was open goes now
            hook()

    def on_close(self, hook: Callable[[], object]) -> None:
        """Call ``hook`` once when the tunnel closes (``update-endpoint --via-tunnel`` takes its registry
        entry back then: the local URL dies with the tunnel)."""
        with self._close_lock:
            if not self._shut:
                self._on_close.append(hook)
                return
        hook()

    def serve_forever(self) -> None:
        """Block until Ctrl-C, SIGTERM or SIGHUP (``kill``, a closed terminal), or ``close()`` from another
        thread; then close, so the close hooks run whichever way it ends."""
        with _stop_signals():
            try:
                while not self._closed.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            finally:
                self.close()

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``KeyboardInterrupt`` while serving (main thread only; elsewhere, as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with handled_by(interrupt, (signal.SIGTERM, signal.SIGHUP)):
        yield


def start_tunnel(
    runner: Runner, remote_host: str, remote_port: int, local_port: int = 0, bind: str = "127.0.0.1"
) -> Tunnel:
    """Forward ``bind:local_port`` (0: any free port) to ``remote_host:remote_port`` as the runner sees it."""
    return Tunnel(runner, remote_host, remote_port, local_port=local_port, bind=bind)


def _pump(source: Any, destination: Any) -> None:
    """Copy until EOF, then half-close ``destination`` so the other side sees the end too."""
    try:
        while True:
            data = source.recv(_CHUNK)
            if not data:
                break
            destination.sendall(data)
    except OSError:
        pass
    try:
        if hasattr(destination, "shutdown_write"):  # paramiko Channel
            destination.shutdown_write()
        else:
            destination.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _quiet_close(stream: Any) -> None:
    try:
        if isinstance(stream, socket.socket):
            stream.shutdown(socket.SHUT_RDWR)  # wakes a pump thread blocked in recv (close alone may not)
    except OSError:
        pass
    try:
        stream.close()
    except OSError:
        pass
