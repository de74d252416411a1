"""The SSH connection holder: one background process per destination keeping one authenticated connection.

Started by :func:`~pbs_toolkit.transports.ssh_mux.spawn_holder` as ``python -m pbs_toolkit.transports.ssh_holder``.
It logs in with the very ``SSHRunner`` code a direct connection uses (same host key checks, same prompts, on
the user's terminal), then detaches (new session, standard streams on /dev/null), listens on a 0600 Unix socket
and tells the starting command over a pipe. It serves only its own user (``SO_PEERCRED``) and exits when idle
for ``--persist`` seconds, when its SSH connection drops (it never logs in again by itself: nobody could answer
a prompt), when its socket is removed or replaced, on ``{"op": "close"}`` and on SIGTERM. See
:mod:`~pbs_toolkit.transports.ssh_mux` for the protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import IO, Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.transports.ssh_mux import SESSION_QUEUE_S, dropped_marker, peer_uid, read_line, send_frame, send_line

_CHUNK = 65536
#: sshd's MaxSessions default: exec and SFTP sessions one connection may have open at once (TCP forwards are not
#: sessions); a site with a lower limit refuses one more, and the holder then waits for a session to end
HELD_SESSIONS = 10
#: slots SFTP sessions (held for a whole command) leave to short exec sessions, so commands holding an SFTP
#: session and waiting for an exec cannot take every slot and wait on each other
EXEC_RESERVE = 2


class SessionGate:
    """Exec and SFTP sessions on the held connection: at most ``limit`` open, queued beyond that.

    Without it, 15 parallel ``pbstk status`` opened 15 SFTP sessions plus their execs on one connection and sshd
    refused the ones past MaxSessions. A request waits (up to ``SESSION_QUEUE_S``) for a slot; one that sshd
    refuses anyway (its MaxSessions is lower) waits for another session to end and tries again; it fails at
    once when every open session is a long-lived SFTP session of the very process asking (nothing would end)."""

    def __init__(self, limit: int = HELD_SESSIONS, reserve: int = EXEC_RESERVE) -> None:
        self.limit, self.reserve = limit, reserve
        self._cond = threading.Condition()
        self._open: dict[int, tuple[str, int]] = {}
        self._next = 0
        self._closed = 0

    def _room(self, kind: str) -> bool:
        if len(self._open) >= self.limit:
            return False
        sftp = sum(1 for k, _ in self._open.values() if k == "sftp")
        return kind != "sftp" or sftp < max(1, self.limit - self.reserve)

    def _hopeless(self, pid: int) -> bool:
        return bool(self._open) and all(k == "sftp" and p == pid for k, p in self._open.values())

    def acquire(self, kind: str, pid: int, deadline: float) -> int | None:
        """A slot (its token), or ``None`` past ``deadline`` or when waiting cannot help."""
        with self._cond:
            while not self._room(kind):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._hopeless(pid):
                    return None
                self._cond.wait(min(remaining, 0.5))
            self._next += 1
            self._open[self._next] = (kind, pid)
            return self._next

    def release(self, token: int) -> None:
        with self._cond:
            if self._open.pop(token, None) is not None:
                self._closed += 1
            self._cond.notify_all()

    def wait_for_release(self, pid: int, deadline: float) -> bool:
        """After sshd refused a session: wait until one of ours ends (sshd frees its slot a moment later), or
        briefly when none is open; ``False`` when that cannot help or time is up."""
        with self._cond:
            if self._hopeless(pid):
                return False
            seen, until = self._closed, min(deadline, time.monotonic() + (0.25 if not self._open else SESSION_QUEUE_S))
            while self._closed == seen and self._open:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.5))
        time.sleep(0.1)  # sshd frees the slot just after the channel's close
        return time.monotonic() < deadline


class Holder:
    """Serves one SSH transport on a Unix socket until idle, dropped, closed or replaced."""

    def __init__(self, runner: Any, path: Path, persist: float) -> None:
        self.runner = runner
        self.path = path
        self.persist = persist
        self.since = time.time()
        self._last = time.monotonic()
        self._active = 0
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._inode = 0
        self.gate = SessionGate()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def listen(self) -> None:
        """Bind under a temporary name (0600 from the start), then rename onto the final path atomically."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        old = os.umask(0o177)
        try:
            tmp.unlink(missing_ok=True)
            self._server.bind(str(tmp))
        finally:
            os.umask(old)
        os.chmod(tmp, 0o600)
        self._server.listen(32)
        os.rename(tmp, self.path)
        self._inode = os.stat(self.path).st_ino

    def transport(self) -> Any:
        client = self.runner._client
        transport = client.get_transport() if client is not None else None
        return transport if transport is not None and transport.is_active() else None

    def _ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def _should_exit(self) -> bool:
        if self.stop.is_set() or self.transport() is None:
            return True
        with self._lock:
            if self._active:
                return False
            return time.monotonic() - self._last > self.persist or not self._ours()

    def serve(self) -> None:
        self._server.settimeout(min(1.0, max(0.05, self.persist / 4)))
        try:
            while not self._should_exit():
                try:
                    conn, _ = self._server.accept()
                except TimeoutError:
                    continue
                with self._lock:
                    self._active += 1  # not idle while it is served (``_last`` moves for real work only)
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            self._server.close()
            if self._ours():
                if self.transport() is None:  # dropped, not idle or closed: the next command says so (README)
                    with contextlib.suppress(OSError):
                        dropped_marker(self.path).write_text("its SSH connection dropped\n")
                self.path.unlink(missing_ok=True)
            self.runner.close()

    # -- one request -------------------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        runner = self.runner
        with self._lock:
            active = self._active - 1  # not counting the connection asking
            idle = 0.0 if active else time.monotonic() - self._last
        return {"ok": True, "destination": f"{runner.user}@{runner.hostname}:{runner.port}", "host": runner.host,
                "pid": os.getpid(), "since": self.since, "idle": idle, "persist": self.persist, "active": active}

    def _handle(self, conn: socket.socket) -> None:
        work = False  # ``info`` and ``close`` (pbstk ssh status/close) do not count as use
        try:
            with conn:
                if peer_uid(conn) != os.getuid():
                    return  # another user: not a word
                conn.settimeout(10.0)
                message = read_line(conn, limit=16 << 20)
                conn.settimeout(None)
                work = message.get("op") not in ("info", "close")
                if work:
                    self._touch()
                self._dispatch(conn, message)
        except (OSError, EOFError, ValueError):
            pass
        except Exception:  # noqa: BLE001, S110 - paramiko raises many kinds; one request must not end the holder
            pass
        finally:
            with self._lock:
                self._active -= 1
                if work:
                    self._last = time.monotonic()

    def _touch(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def _dispatch(self, conn: socket.socket, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "info":
            send_line(conn, self.info())
            return
        if op == "close":
            send_line(conn, {"ok": True})
            self.stop.set()
            return
        transport = self.transport()
        if transport is None:
            send_line(conn, {"ok": False, "code": "dropped", "error": "the SSH connection dropped"})
            self.stop.set()
            return
        if op == "exec":
            self._exec(conn, transport, str(message["command"]), message.get("stdin"))
        elif op == "sftp":
            opened = self._session(conn, "sftp", lambda: _sftp_channel(transport, self.runner.connect_timeout))
            if opened is not None:
                token, channel = opened
                try:
                    send_line(conn, {"ok": True})
                    _relay(conn, channel)
                finally:
                    channel.close()
                    self.gate.release(token)
        elif op == "direct-tcpip":
            host, port = str(message["host"]), int(message["port"])
            timeout = float(message.get("timeout") or 5.0)
            self._open_and_relay(conn, lambda: transport.open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout))
        else:
            send_line(conn, {"ok": False, "code": "usage", "error": f"unknown op {op!r}"})

    def _failure(self, exc: BaseException, *, session: bool = False) -> dict[str, Any]:
        import paramiko

        if self.transport() is None:
            self.stop.set()
            return {"ok": False, "code": "dropped", "error": f"the SSH connection dropped: {exc}"}
        if session and (isinstance(exc, paramiko.ChannelException) or "Unable to open channel" in str(exc)):
            text = getattr(exc, "text", None) or str(exc)
            return {"ok": False, "code": "busy", "error": (
                f"{self.runner.host} refused one more session on the held connection ({text}; sshd's "
                "MaxSessions, 10 by default): end some `pbstk logs -f`, or set PBSTK_SSH_PERSIST=0")}
        if isinstance(exc, paramiko.ChannelException):
            return {"ok": False, "code": "forbidden" if exc.code == 1 else "refused", "error": exc.text}
        if "Timeout" in str(exc) or isinstance(exc, TimeoutError):
            return {"ok": False, "code": "timeout", "error": str(exc) or "timed out"}
        return {"ok": False, "code": "failed", "error": str(exc) or type(exc).__name__}

    def _open_and_relay(self, conn: socket.socket, opener: Any, *, session: bool = False) -> None:
        import paramiko

        try:
            channel = opener()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            send_line(conn, self._failure(exc, session=session))
            return
        try:
            send_line(conn, {"ok": True})
            _relay(conn, channel)
        finally:
            channel.close()

    def _session(self, conn: socket.socket, kind: str, opener: Any) -> tuple[int, Any] | None:
        """A session slot and the channel ``opener`` opened in it, queued behind sshd's MaxSessions; ``None``
        once the failure was sent."""
        import paramiko

        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        deadline = time.monotonic() + SESSION_QUEUE_S
        while True:
            token = self.gate.acquire(kind, pid, deadline)
            if token is None:
                send_line(conn, self._failure(paramiko.ChannelException(2, "no session slot became free"),
                                              session=True))
                return None
            try:
                return token, opener()
            except (paramiko.SSHException, OSError, EOFError) as exc:
                self.gate.release(token)
                # sshd's refusal is a ChannelException, or "Unable to open channel." when another thread took the
                # transport's saved exception first
                busy = isinstance(exc, paramiko.SSHException) and self.transport() is not None
                if not busy or not self.gate.wait_for_release(pid, deadline):
                    send_line(conn, self._failure(exc, session=True))
                    return None

    def _exec(self, conn: socket.socket, transport: Any, command: str, stdin: Any) -> None:
        from pbs_toolkit.transports.ssh_channel import feed_stdin  # paramiko: loaded once the holder has a login

        def start() -> Any:
            channel = transport.open_session(timeout=self.runner.connect_timeout)
            channel.exec_command(command)
            return channel

        opened = self._session(conn, "exec", start)
        if opened is None:
            return
        token, channel = opened
        try:
            send_line(conn, {"ok": True})
            feed_stdin(channel, stdin if isinstance(stdin, str) else None)
            if _stream(conn, channel):
                send_frame(conn, b"x", struct.pack(">i", channel.recv_exit_status()))
        finally:
            channel.close()
            self.gate.release(token)


def _sftp_channel(transport: Any, timeout: float) -> Any:
    channel = transport.open_session(timeout=timeout)
    channel.invoke_subsystem("sftp")
    return channel


def _client_gone(conn: socket.socket) -> bool:
    """The client sends nothing after its request: readable means it closed (timed out, interrupted)."""
    ready, _, _ = select.select([conn], [], [], 0)
    return bool(ready) and not conn.recv(1)


def _stream(conn: socket.socket, channel: Any) -> bool:
    """Frames of stdout and stderr until EOF and the exit status; False when the client went away first."""
    while True:
        ready, _, _ = select.select([channel, conn], [], [], 1.0)
        if conn in ready and _client_gone(conn):
            return False
        while channel.recv_stderr_ready():
            send_frame(conn, b"e", channel.recv_stderr(_CHUNK))
        if channel.recv_ready():
            send_frame(conn, b"o", channel.recv(_CHUNK))
            continue
        if channel.eof_received or channel.closed:
            break
    while channel.recv_stderr_ready():
        send_frame(conn, b"e", channel.recv_stderr(_CHUNK))
    while not channel.status_event.wait(1.0):
        if _client_gone(conn):
            return False
    return True


def _relay(conn: socket.socket, channel: Any) -> None:
    """Bytes both ways until both sides ended (half-close passed on) or the channel closed."""
    conn_open = chan_open = True
    while (conn_open or chan_open) and not channel.closed:
        watched = ([conn] if conn_open else []) + ([channel] if chan_open else [])
        ready, _, _ = select.select(watched, [], [], 1.0)
        if conn in ready:
            data = conn.recv(_CHUNK)
            if data:
                channel.sendall(data)
            else:
                conn_open = False
                channel.shutdown_write()
        if channel in ready:
            data = channel.recv(_CHUNK)
            if data:
                conn.sendall(data)
            else:
                chan_open = False
                conn.shutdown(socket.SHUT_WR)


# -- process ---------------------------------------------------------------------------------------------------


def _detach() -> None:
    """Leave the terminal: a new session, /dev/null for the standard streams, / as working directory."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    os.chdir("/")


def _answer(ready: IO[str], message: dict[str, Any]) -> None:
    ready.write(json.dumps(message) + "\n")
    ready.flush()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pbstk-ssh-holder")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--persist", type=float, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--known-hosts", required=True)
    parser.add_argument("--accept-new-host-key", action="store_true")
    parser.add_argument("host")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if os.fork() > 0:  # the starter waits for this process only; the holder lives on, adopted by init
        os._exit(0)
    ready = os.fdopen(args.ready_fd, "w", encoding="utf-8")
    from pbs_toolkit.transports.ssh import SSHRunner

    try:
        runner = SSHRunner(args.host, accept_unknown_host=args.accept_new_host_key, config_path=args.config,
                           known_hosts_path=args.known_hosts, persist=0)
        runner._transport()  # connect and log in, prompting on the user's terminal
        holder = Holder(runner, Path(args.socket), args.persist)
        holder.listen()
    except PbstkError as exc:
        _answer(ready, {"ok": False, "error": exc.message, "details": exc.details, "exit_code": exc.exit_code})
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - reported to the starter as one line, never a traceback
        _answer(ready, {"ok": False, "error": f"the SSH connection holder failed: {exc or type(exc).__name__}"})
        return 1
    signal.signal(signal.SIGTERM, lambda *_: holder.stop.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _detach()
    _answer(ready, {"ok": True, "pid": os.getpid()})
    ready.close()
    holder.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
