"""The client side of the SSH connection holder: where holders listen, the wire protocol, and ``MuxClient``.

Sites with MFA ask for a passcode on every new SSH connection. A holder (:mod:`.ssh_holder`) is a background
process that keeps one authenticated connection to one destination and serves later ``pbstk`` commands over
a Unix socket, so a working day costs one login. Only this user can reach it: the socket is 0600 in a 0700
directory owned by the user, and both ends check the peer's uid (``SO_PEERCRED``).

Protocol: one connection per operation. The client sends one JSON line (``{"op": ...}``), the holder answers
one JSON line (``{"ok": true, ...}`` or ``{"ok": false, "code": ..., "error": ...}``), then:

* ``exec``: frames ``TYPE(1 byte) LENGTH(4 bytes, big endian) PAYLOAD``: ``o`` stdout, ``e`` stderr, then ``x``
  (the exit status, 4-byte signed) or ``!`` (an error message). Closing the socket ends the remote command.
* ``sftp`` and ``direct-tcpip``: raw bytes both ways (an SFTP session, a TCP stream), half-close relayed.
* ``info`` and ``close``: the answer line only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError, TransportError
from pbs_toolkit.schema import stamp
from pbs_toolkit.settings.yamlio import user_config

if TYPE_CHECKING:
    from pbs_toolkit.transports.ssh_destination import SSHDestination

#: how long the holder queues an exec or SFTP request for a free session slot (sshd's MaxSessions)
SESSION_QUEUE_S = 30.0
#: idle seconds before a holder logs out: a working day
DEFAULT_PERSIST_S = 8 * 3600.0
PERSIST_ENV = "PBSTK_SSH_PERSIST"
SOCKET_DIR_ENV = "PBSTK_SSH_SOCKET_DIR"
_SUN_PATH_MAX = 100  # sockaddr_un holds 108 bytes; keep a margin
_FRAME = struct.Struct(">cI")
_CREDS = struct.Struct("3i")


class RelaySocket(socket.socket):
    """The Unix socket of a relayed channel; ``get_name`` is what paramiko's SFTP logging asks a channel for."""

    def get_name(self) -> str:
        return "pbstk-holder"


class HolderGone(Exception):
    """The holder is not there (no socket, refused) or its SSH connection dropped: start a new one.

    ``existed``: there was one (a socket nobody answers on, a dropped connection), so starting another is a
    second login the user must hear about; ``False`` only when no socket exists at all."""

    def __init__(self, message: str, existed: bool = True) -> None:
        super().__init__(message)
        self.existed = existed


def persist_seconds() -> float:
    """Idle seconds a holder lives: ``PBSTK_SSH_PERSIST``, else ``ssh_persist`` in config.yaml, else 8 h; 0 = off."""
    raw: Any = os.environ.get(PERSIST_ENV)
    source = PERSIST_ENV
    if raw is None or raw == "":
        raw = user_config().get("ssh_persist")
        source = f"{paths.user_config_dir() / 'config.yaml'}: key 'ssh_persist'"
        if raw is None:
            return DEFAULT_PERSIST_S
    try:
        value = float(raw) if not isinstance(raw, bool) else -1.0
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value <= 30 * 86400:  # NaN fails too
        raise ConfigError(f"{source}: bad value {raw!r} (expected seconds from 0 to 2592000; 0 turns the "
                          "connection holder off)")
    return value


def _private_dir(path: Path) -> Path:
    """``path`` created 0700; refused unless it is a real directory owned by this user and closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise TransportError(f"{path} is not a directory owned by you; refusing to put SSH sockets there")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_dir() -> Path:
    """Where holders listen: ``$PBSTK_SSH_SOCKET_DIR``, else ``$XDG_RUNTIME_DIR/pbstk``, else the state dir."""
    override = os.environ.get(SOCKET_DIR_ENV)
    if override:
        return _private_dir(Path(override))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return _private_dir(Path(runtime) / "pbstk")

    return _private_dir(paths.user_state_dir() / "ssh")


def holder_key(runner: SSHDestination) -> str:
    """A short name for a destination as this runner reaches it (the same alias in two configs differs)."""
    parts = [runner.host, runner.user, runner.hostname, str(runner.port), str(runner.config_path),
             str(runner.known_hosts_path), runner.proxy_jump or "", runner.proxy_command or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def socket_path(runner: SSHDestination) -> Path:
    path = socket_dir() / f"{holder_key(runner)}.sock"
    if len(str(path)) > _SUN_PATH_MAX:  # a deep state dir: fall back to a private dir in /tmp, like ssh-agent
        path = _private_dir(Path(tempfile.gettempdir()) / f"pbstk-{os.getuid()}") / path.name
    return path


def dropped_marker(path: Path) -> Path:
    """Left next to a holder's socket when its SSH connection dropped, so the next command can say why it logs
    in again even though the holder (and its socket) are gone."""
    return path.with_suffix(".dropped")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (Linux ``SO_PEERCRED``)."""
    _pid, uid, _gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return int(uid)


# -- wire format -----------------------------------------------------------------------------------------------


def send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def read_line(sock: socket.socket, limit: int = 1 << 20) -> dict[str, Any]:
    """One JSON line, read byte by byte so that nothing after it (raw relay bytes) is consumed."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise EOFError("the connection holder closed the connection")
        data += chunk
        if len(data) > limit:
            raise EOFError("the connection holder sent an overlong line")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise EOFError("the connection holder sent a malformed answer")
    return message


def send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 16))
        if not chunk:
            raise EOFError("the connection holder closed the connection")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, size = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    return kind, _recv_exact(sock, size)


# -- client ----------------------------------------------------------------------------------------------------


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    """A connection to the holder at ``path``; ``HolderGone`` when nothing (of ours) listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise TransportError(f"{path} is served by another user; refusing to use it")
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise HolderGone(str(exc), existed=not isinstance(exc, FileNotFoundError)) from None
    except BaseException:
        sock.close()
        raise
    return sock


def request(path: Path, message: dict[str, Any], timeout: float = 5.0) -> tuple[socket.socket, dict[str, Any]]:
    """Send ``message`` to the holder at ``path``: the open socket and the holder's answer line.

    ``HolderGone`` when no holder answers or its SSH connection dropped (it exits then)."""
    sock = connect(path, timeout)
    try:
        send_line(sock, message)
        answer = read_line(sock)
    except (OSError, EOFError, ValueError) as exc:
        sock.close()
        raise HolderGone(str(exc) or type(exc).__name__) from None
    if not answer.get("ok") and answer.get("code") == "dropped":
        sock.close()
        raise HolderGone(str(answer.get("error", "the connection dropped")))
    return sock, answer


class MuxClient:
    """Operations of one ``SSHRunner`` through its destination's holder; starts the holder when there is none."""

    def __init__(self, runner: SSHDestination, persist: float) -> None:
        self.runner = runner
        self.persist = persist
        self.path = socket_path(runner)
        #: holders this client started (each one is one authentication)
        self.started = 0
        self._spawn_lock = threading.Lock()

    def _spawn(self, note: str | None) -> None:
        if note:
            sys.stderr.write(f"pbstk: {note}; logging in to {self.runner.host} again\n")
            sys.stderr.flush()
        spawn_holder(self.runner, self.path, self.persist)
        self.started += 1

    def open(self, message: dict[str, Any], timeout: float = 10.0) -> tuple[socket.socket, dict[str, Any]]:
        """``request`` to this destination's holder, starting one (one login) if none answers or it lost its
        connection; a holder that vanished after answering before is said on stderr."""
        if message.get("op") in ("exec", "sftp"):  # the holder may queue them for a session slot
            timeout = max(timeout, SESSION_QUEUE_S + 15)
        try:
            return request(self.path, message, timeout)
        except HolderGone as exc:
            reason, existed = str(exc), exc.existed
        # one login for all: threads of this process and other pbstk processes wait for the first one's holder
        with self._spawn_lock, _file_lock(self.path.with_suffix(".lock")):
            try:
                return request(self.path, message, timeout)
            except HolderGone:
                pass
            marker = dropped_marker(self.path)
            if marker.exists():  # a holder whose connection dropped removed its socket but left this
                existed, reason = True, marker.read_text(errors="replace").strip() or reason
                marker.unlink(missing_ok=True)
            existed = existed or self.path.exists() or bool(self.started)
            self._spawn(f"the held SSH connection is gone ({reason})" if existed else None)
        try:
            return request(self.path, message, timeout)
        except HolderGone as exc:
            raise TransportError(f"the SSH connection holder for {self.runner.host} does not answer: {exc}") from None

    def alive(self) -> bool:
        try:
            sock, answer = request(self.path, {"op": "info"}, 5.0)
        except (HolderGone, TransportError):
            return False
        sock.close()
        return bool(answer.get("ok"))

    def exec(self, command: str, stdin: str | None, timeout: float | None) -> tuple[int, bytes, bytes]:
        """Run ``command`` through the holder: (rc, stdout, stderr). ``TimeoutError`` past ``timeout`` (the
        remote command is ended), ``EOFError``/``OSError`` when the holder went away mid-command."""
        sock, answer = self.open({"op": "exec", "command": command, "stdin": stdin})
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            if not answer.get("ok"):
                raise TransportError(f"cannot run a command on {self.runner.host}: {answer.get('error')}")
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                kind, payload = read_frame(sock)  # socket.timeout is TimeoutError
                if kind == b"o":
                    out.append(payload)
                elif kind == b"e":
                    err.append(payload)
                elif kind == b"x":
                    return int(struct.unpack(">i", payload)[0]), b"".join(out), b"".join(err)
                else:
                    raise OSError(payload.decode("utf-8", "replace"))
        finally:
            sock.close()

    def channel(self, message: dict[str, Any], timeout: float = 10.0) -> socket.socket:
        """A raw relay (``sftp`` or ``direct-tcpip``); ``OSError`` subclasses for a refused one."""
        sock, answer = self.open(message, timeout)
        if answer.get("ok"):
            relay = RelaySocket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=sock.detach())
            relay.settimeout(None)
            return relay
        sock.close()
        code, text = answer.get("code"), str(answer.get("error", ""))
        if code == "forbidden":
            raise TransportError(f"{self.runner.host} does not allow TCP forwarding (AllowTcpForwarding): {text}")
        if code == "refused":
            import errno

            raise ConnectionRefusedError(errno.ECONNREFUSED, text)
        if code == "timeout":
            raise TimeoutError(text)
        if code == "busy":
            raise TransportError(f"cannot open SFTP on {self.runner.host}: {text}")
        raise TransportError(f"through {self.runner.host}: {text}")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (0600, in the private socket dir) for the duration of the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def spawn_holder(runner: SSHDestination, path: Path, persist: float) -> None:
    """Start a holder for ``runner``'s destination and wait until it has logged in (or failed).

    It runs on this terminal until then, so passcode prompts reach the user; then it detaches. Its failure is
    raised here as the same one-line error a direct connection gives."""
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "pbs_toolkit.transports.ssh_holder", "--socket", str(path),
            "--ready-fd", str(write_fd), "--persist", repr(persist), "--config", str(runner.config_path),
            "--known-hosts", str(runner.known_hosts_path)]
    if runner.accept_unknown_host:
        argv.append("--accept-new-host-key")
    argv += ["--", runner.host]
    package_root = str(Path(__file__).resolve().parents[2])  # the directory that holds pbs_toolkit/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(argv, pass_fds=(write_fd,), env=env)  # noqa: S603 - argument list
    finally:
        os.close(write_fd)
    try:
        proc.wait()  # it forks at once: the holder is its child, adopted by init
        answer = _read_ready(read_fd, runner)
    finally:
        os.close(read_fd)
    if answer.get("ok"):
        return
    message = str(answer.get("error") or f"the SSH connection holder for {runner.host} failed")
    details = [str(d) for d in answer.get("details") or []]
    if answer.get("exit_code") == 2:
        raise ConfigError(message, details=details)
    raise TransportError(message, details=details)


def _read_ready(fd: int, runner: SSHDestination) -> dict[str, Any]:
    """The holder's one answer line; bounded by the connect and authentication time a person may take."""
    from pbs_toolkit.transports.ssh_destination import AUTH_TIMEOUT_S

    deadline = time.monotonic() + 2 * float(runner.connect_timeout) + AUTH_TIMEOUT_S + 30
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
        if not ready:
            return {"ok": False, "error": f"logging in to {runner.host} took too long"}
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        answer = json.loads(data) if data.strip() else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return {"ok": False, "error": f"the SSH connection holder for {runner.host} exited before logging in"}
    return answer


# -- listing and closing (``pbstk ssh status`` / ``close``) ----------------------------------------------------


@dataclass(frozen=True)
class HolderInfo:
    destination: str  # user@hostname:port
    host: str  # as the user named it (an ~/.ssh/config alias, or user@host:port)
    pid: int
    since: float
    idle: float
    persist: float
    socket: str
    active: int

    def public(self) -> dict[str, Any]:
        return stamp("ssh_connection", self.__dict__)


def holders() -> Iterator[HolderInfo]:
    """Every live holder of this user; stale sockets (a holder that was killed) are removed on the way."""
    directory = socket_dir()
    for path in sorted(directory.glob("*.sock")):
        try:
            sock, answer = request(path, {"op": "info"}, 5.0)
        except HolderGone:
            _remove_stale(path)
            continue
        except TransportError:
            continue
        sock.close()
        if answer.get("ok"):
            yield HolderInfo(destination=str(answer["destination"]), host=str(answer["host"]), pid=int(answer["pid"]),
                             since=float(answer["since"]), idle=float(answer["idle"]),
                             persist=float(answer["persist"]), socket=str(path), active=int(answer["active"]))


def _remove_stale(path: Path) -> None:
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with probe:
            probe.settimeout(1.0)
            probe.connect(str(path))
        return  # someone listens after all
    except ConnectionRefusedError:
        pass
    except OSError:
        return
    try:
        path.unlink()
    except OSError:
        pass


def close_holder(info: HolderInfo) -> bool:
    """Ask a holder to log out and exit; False when it was gone already."""
    try:
        sock, answer = request(Path(info.socket), {"op": "close"}, 5.0)
    except HolderGone:
        return False
    sock.close()
    return bool(answer.get("ok"))
