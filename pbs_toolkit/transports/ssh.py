"""``SSHRunner``: commands, files and TCP connections on a login node over ONE paramiko connection.

Login nodes of most sites ask for MFA on every new connection, so a runner opens a single connection
lazily and reuses it for every exec channel, the SFTP session and ``direct-tcpip`` forwards. Only this
module and :mod:`~pbs_toolkit.transports.ssh_auth` (host keys, authentication) import paramiko
(``open_runner`` imports this one lazily), which keeps ``pbstk --help`` fast.

Between commands the login is kept by a connection holder (:mod:`.ssh_holder`, reached through
:mod:`.ssh_mux`) unless ``persist`` is 0: the runner then sends its exec, SFTP and ``direct-tcpip`` requests
to the holder instead of opening a connection of its own, so a day of commands costs one MFA prompt.
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import re
import secrets
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import paramiko

from pbs_toolkit.errors import ConfigError, TransportError
from pbs_toolkit.transports.base import OpenFile, Result, Runner
from pbs_toolkit.transports.ssh_auth import (
    Authenticator,
    HostKeyPolicy,
    PasswordPrompt,
    known_hosts_name,
    terminal_prompt,
)
from pbs_toolkit.transports.ssh_mux import MuxClient, persist_seconds

__all__ = [
    "AUTH_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_S",
    "PasswordPrompt",
    "SSHRunner",
    "build_remote_command",
    "split_destination",
    "terminal_prompt",
]

CONNECT_TIMEOUT_S = 10.0
#: keyboard-interactive waits for a person (MFA codes, push approvals): give them time
AUTH_TIMEOUT_S = 180.0
KEEPALIVE_S = 30
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_T = TypeVar("_T")

# paramiko logs a dropped connection at ERROR, with two tracebacks, from its transport thread. With no handler
# configured, Python's last-resort handler prints them on stderr before our one-line error: give paramiko's
# logger a handler that drops them (records still propagate to any handler a caller configures).
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def build_remote_command(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
) -> str:
    """The shell line run on the login node: every value quoted; env set through ``env`` (no AcceptEnv)."""
    if not argv:
        raise ValueError("argv must not be empty")
    parts = []
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} && ")
    if env:
        for key in env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"invalid environment variable name: {key!r}")
        parts.append("env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " ")
    parts.append(shlex.join(argv))
    return "".join(parts)


def _config_number(cfg: Mapping[str, Any], key: str, default: float, config_file: Path, alias: str,
                   *, integer: bool = False) -> Any:
    """A numeric ``~/.ssh/config`` value (``Port``, ``ConnectTimeout``) checked like ssh(1) does, so
    ``Port notaport`` is one clear line naming the file and the key instead of a traceback."""
    raw = cfg.get(key)
    if raw is None:
        return int(default) if integer else default
    try:
        value = int(raw) if integer else float(raw)
    except (TypeError, ValueError):
        value = None
    low, high = (1, 65535) if integer else (0.001, 86400.0)
    if value is None or not low <= value <= high:  # NaN fails the comparison too
        raise ConfigError(f"{config_file}: host {alias}: bad {key} {raw!r} (expected a number "
                          f"from {low:g} to {high:g})")
    return value


def split_destination(destination: str) -> tuple[str | None, str, int | None]:
    """``user@host:port`` -> (user, host, port); host may be an ``~/.ssh/config`` alias or ``[v6]:port``."""
    user = None
    if "@" in destination:
        user, destination = destination.rsplit("@", 1)
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", destination) or re.fullmatch(
        r"([^:]+):(\d+)", destination
    )
    if match:
        return user or None, match.group(1), int(match.group(2)) if match.group(2) else None
    return user or None, destination, None


class SSHRunner(Runner):
    """A :class:`Runner` on ``host`` (config alias, or ``user@host:port``) over one reused SSH connection."""

    def __init__(
        self,
        host: str,
        *,
        accept_unknown_host: bool = False,
        config_path: str | os.PathLike[str] | None = None,
        known_hosts_path: str | os.PathLike[str] | None = None,
        password_prompt: PasswordPrompt | None = None,
        persist: float | None = None,
    ) -> None:
        self.host = host
        self.name = f"ssh:{host}"
        self.accept_unknown_host = accept_unknown_host
        self.password_prompt = password_prompt
        #: how many SSH connections this runner opened (1 unless the connection dropped)
        self.connections_opened = 0
        self._lock = threading.RLock()
        self._sftp_lock = threading.Lock()
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._jump: SSHRunner | None = None
        #: idle seconds a connection holder keeps the login (``None``: the setting; 0: connect directly)
        self.persist = persist
        self._mux: MuxClient | None = None

        config_file = Path(config_path or os.environ.get("PBSTK_SSH_CONFIG") or "~/.ssh/config").expanduser()
        self.config_path = config_file
        try:
            self._ssh_config = (
                paramiko.SSHConfig.from_path(str(config_file))
                if config_file.exists()
                else paramiko.SSHConfig()
            )
        except (OSError, paramiko.ssh_exception.ConfigParseError) as exc:
            raise TransportError(f"cannot read SSH config {config_file}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"cannot read SSH config {config_file}: not UTF-8 text (byte {exc.start})") from None
        except ValueError as exc:  # shlex inside paramiko: ``Match exec "false`` (no closing quotation)
            raise ConfigError(f"cannot read SSH config {config_file}: {exc}") from None
        user, alias, port = split_destination(host)
        cfg = self._ssh_config.lookup(alias)
        self.hostname: str = cfg.get("hostname", alias)
        self.port: int = port or _config_number(cfg, "port", 22, config_file, alias, integer=True)
        self.user: str = user or cfg.get("user") or getpass.getuser()
        self.identity_files: list[str] = list(cfg.get("identityfile", []))
        self.identities_only = cfg.get("identitiesonly", "no").lower() == "yes"
        self.proxy_command: str | None = (
            cfg.get("proxycommand") if cfg.get("proxycommand", "none") != "none" else None
        )
        if self.proxy_command is not None:
            try:  # paramiko splits it only when connecting: a bad one is a config error, found now
                shlex.split(self.proxy_command)
            except ValueError as exc:
                raise ConfigError(f"{config_file}: host {alias}: bad proxycommand: {exc}") from None
        self.proxy_jump: str | None = cfg.get("proxyjump") if cfg.get("proxyjump", "none") != "none" else None
        self.connect_timeout = _config_number(cfg, "connecttimeout", CONNECT_TIMEOUT_S, config_file, alias)
        user_known = cfg.get("userknownhostsfile", "").split()
        self.known_hosts_path = Path(
            known_hosts_path
            or os.environ.get("PBSTK_KNOWN_HOSTS")
            or (user_known[0] if user_known else "")
            or "~/.ssh/known_hosts"
        ).expanduser()

    # -- connection -------------------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if os.path.exists("/etc/ssh/ssh_known_hosts"):
            client.load_system_host_keys("/etc/ssh/ssh_known_hosts")
        if self.known_hosts_path.exists():
            client.load_host_keys(str(self.known_hosts_path))
        client.set_missing_host_key_policy(HostKeyPolicy(self))
        try:
            client.connect(
                self.hostname,
                port=self.port,
                username=self.user,
                sock=self._proxy_sock(),
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=AUTH_TIMEOUT_S,
                auth_strategy=Authenticator(self),
            )
        except TransportError:
            client.close()
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            raise self._connect_error(exc) from exc
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(KEEPALIVE_S)
        self.connections_opened += 1
        return client

    def _proxy_sock(self) -> Any:
        """The socket to this host through ProxyJump or ProxyCommand; ``None``: connect directly."""
        if self.proxy_jump:
            # ProxyJump a,b: reach b through a, then this host through b (one connection per hop)
            hops = [hop.strip() for hop in self.proxy_jump.split(",")]
            self._jump = SSHRunner(
                hops[-1],
                accept_unknown_host=self.accept_unknown_host,
                config_path=self.config_path,
                known_hosts_path=self.known_hosts_path,
                password_prompt=self.password_prompt,
            )
            if len(hops) > 1:
                self._jump.proxy_jump = ",".join(hops[:-1])
            return self._jump.open_connection(self.hostname, self.port, self.connect_timeout)
        if self.proxy_command:
            return paramiko.ProxyCommand(self.proxy_command)
        return None

    def _connect_error(self, exc: BaseException) -> TransportError:
        """The one-line ``TransportError`` for a failed connect: what went wrong, in ssh's own words."""
        where = f"{self.hostname}:{self.port}"
        if isinstance(exc, paramiko.BadHostKeyException):
            return TransportError(
                f"host key for {self.hostname}:{self.port} has CHANGED: {self.known_hosts_path} has "
                f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the server sent "
                f"{exc.key.get_name()} {exc.key.fingerprint}. This may be an attack; if the key was "
                f"changed on purpose, remove the old line (ssh-keygen -R {known_hosts_name(self)}) "
                "and connect once with ssh"
            )
        if isinstance(exc, (socket.gaierror, paramiko.ssh_exception.NoValidConnectionsError)):
            reason = exc.strerror if isinstance(exc, socket.gaierror) else "connection refused"
            return TransportError(f"cannot reach {where}: {reason}")
        if isinstance(exc, TimeoutError):
            return TransportError(f"cannot reach {where}: timed out after {self.connect_timeout:g} s")
        if isinstance(exc, (paramiko.ProxyCommandFailure, ConnectionRefusedError)):
            return TransportError(f"cannot reach {where}: {exc}")
        if isinstance(exc, paramiko.AuthenticationException):
            return TransportError(f"authentication to {self.host} failed: {exc}")
        return TransportError(f"cannot reach {where}: {str(exc) or type(exc).__name__}")

    def _transport(self) -> paramiko.Transport:
        """The live transport; opens the connection on first use and again once after a drop."""
        with self._lock:
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return transport
                self._close_client()
            self._client = self._connect()
            transport = self._client.get_transport()
            assert transport is not None
            return transport

    def _with_reconnect(self, operation: Callable[[paramiko.Transport], _T]) -> _T:
        """Run ``operation``; if the connection died under it, reconnect once and run it again.

        Only for operations that are safe to repeat (channel opens, SFTP reads, atomic writes).
        """
        transport = self._transport()
        try:
            return operation(transport)
        except (paramiko.SSHException, EOFError, OSError):
            if transport.is_active():
                raise
        return operation(self._transport())

    def _close_sftp(self) -> None:
        if self._sftp is not None:
            try:
                self._sftp.close()
            except Exception:  # noqa: S110 - closing a dead session may fail in many ways
                pass
            self._sftp = None

    def _close_client(self) -> None:
        self._close_sftp()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None

    def close(self) -> None:
        with self._lock:
            self._close_client()

    def _holder(self) -> MuxClient | None:
        """The connection holder client when logins are kept between commands (``persist`` > 0), else ``None``.

        A caller's own ``password_prompt`` cannot reach a background process: such a runner connects itself."""
        with self._lock:
            if self._mux is None:
                if self.persist is None:
                    self.persist = persist_seconds()
                if self.persist <= 0 or self.password_prompt is not None:
                    return None
                self._mux = MuxClient(self, self.persist)
            return self._mux

    # -- commands ---------------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        timeout: float | None = 60.0,
        cwd: str | None = None,
    ) -> Result:
        from pbs_toolkit.transports.trace import log_command  # ``pbstk -v``; here so the hook is one hunk

        log_command(f"ssh {self.host}", argv, env=env, cwd=cwd, stdin=stdin)
        command = build_remote_command(argv, env, cwd)
        mux = self._holder()
        if mux is not None:
            return self._run_held(mux, argv[0], command, stdin, timeout)

        def start(transport: paramiko.Transport) -> paramiko.Channel:
            channel = transport.open_session(timeout=self.connect_timeout)
            channel.exec_command(command)
            return channel

        try:
            channel = self._with_reconnect(start)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise TransportError(f"cannot run {argv[0]} on {self.host}: {exc}") from exc
        try:
            rc, out, err = _collect(channel, stdin, timeout)
        except TimeoutError as exc:
            raise TransportError(f"{argv[0]} on {self.host} did not finish within {timeout:g} s") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise TransportError(
                f"lost the connection to {self.host} while running {argv[0]}: {exc}"
            ) from exc
        finally:
            channel.close()
        return Result(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def _run_held(self, mux: MuxClient, name: str, command: str, stdin: str | None,
                  timeout: float | None) -> Result:
        try:
            rc, out, err = mux.exec(command, stdin, timeout)
        except TimeoutError as exc:
            raise TransportError(f"{name} on {self.host} did not finish within {timeout:g} s") from exc
        except (EOFError, OSError) as exc:
            raise TransportError(f"lost the connection to {self.host} while running {name}: {exc}") from exc
        return Result(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    # -- files ------------------------------------------------------------------------------------

    def _held_sftp_call(self, mux: MuxClient, operation: Callable[[paramiko.SFTPClient], _T]) -> _T:
        """``operation`` on an SFTP session relayed by the holder; once more on a new one if the holder is gone."""

        def call() -> _T:
            with self._sftp_lock:
                if self._sftp is None:
                    self._sftp = paramiko.SFTPClient(cast(Any, mux.channel({"op": "sftp"})))
                return operation(self._sftp)

        try:
            try:
                return call()
            except (FileNotFoundError, PermissionError, FileExistsError):
                raise
            except (paramiko.SSHException, EOFError, OSError):
                if mux.alive():
                    raise
            with self._lock:
                self._close_sftp()
            return call()
        except (FileNotFoundError, PermissionError, FileExistsError):
            raise
        except (paramiko.SSHException, EOFError) as exc:
            raise TransportError(f"SFTP on {self.host} failed: {exc}") from exc

    def _sftp_call(self, operation: Callable[[paramiko.SFTPClient], _T]) -> _T:
        mux = self._holder()
        if mux is not None:
            return self._held_sftp_call(mux, operation)

        def call(transport: paramiko.Transport) -> _T:
            with self._sftp_lock:
                sftp = self._sftp
                channel = sftp.get_channel() if sftp is not None else None
                if sftp is None or channel is None or channel.get_transport() is not transport:
                    sftp = self._sftp = paramiko.SFTPClient.from_transport(transport)
                    assert sftp is not None
                return operation(sftp)

        try:
            return self._with_reconnect(call)
        except (FileNotFoundError, PermissionError, FileExistsError):
            raise
        except (paramiko.SSHException, EOFError) as exc:
            raise TransportError(f"SFTP on {self.host} failed: {exc}") from exc

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        def read(sftp: paramiko.SFTPClient) -> bytes:
            with sftp.open(path, "rb") as fh:
                if offset:
                    fh.seek(offset)
                if length is None:
                    fh.prefetch()
                    return fh.read()
                return fh.read(length)

        return self._sftp_call(read)

    def size(self, path: str) -> int | None:
        def stat(sftp: paramiko.SFTPClient) -> int | None:
            try:
                return sftp.stat(path).st_size
            except FileNotFoundError:
                return None

        return self._sftp_call(stat)

    def open_file(self, path: str) -> OpenFile:
        """An SFTP handle on ``path``: no ``stat`` command per poll (an exec channel cost ~0.7 s on a loaded
        host, an SFTP call ~1 ms). See ``_SftpFile`` for how identity is judged without inodes."""
        return _SftpFile(self, path)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        directory, base = os.path.split(path)
        tmp = os.path.join(directory, f".tmp-{base}-{secrets.token_hex(4)}")

        def write(sftp: paramiko.SFTPClient) -> None:
            try:
                with sftp.open(tmp, "wb") as fh:
                    fh.chmod(mode)
                    fh.write(data)
                sftp.posix_rename(tmp, path)
            except BaseException:
                try:
                    sftp.remove(tmp)
                except (OSError, paramiko.SSHException):
                    pass
                raise

        self._sftp_call(write)

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        def makedirs(sftp: paramiko.SFTPClient) -> None:
            missing = []
            current = path.rstrip("/") or "/"
            while current not in ("", "/", "."):
                try:
                    sftp.stat(current)
                    break
                except FileNotFoundError:
                    missing.append(current)
                    current = os.path.dirname(current)
            for directory in reversed(missing):
                try:
                    sftp.mkdir(directory, mode)
                except OSError:
                    sftp.stat(directory)  # created meanwhile by someone else: fine; else raise

        self._sftp_call(makedirs)

    def home(self) -> str:
        if self._home is None:
            self._home = self._sftp_call(lambda sftp: sftp.normalize("."))
        return self._home

    # -- TCP --------------------------------------------------------------------------------------

    def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
        """A ``direct-tcpip`` channel to ``host:port`` as the login node sees it (socket-like; through a
        connection holder, a Unix socket relaying the channel)."""
        mux = self._holder()
        if mux is not None:
            try:
                stream = mux.channel({"op": "direct-tcpip", "host": host, "port": port, "timeout": timeout},
                                     timeout=max(timeout, 10.0))
                stream.settimeout(timeout)  # like the channel's below: reads time out as the caller asked
                return stream
            except ConnectionRefusedError as exc:
                raise ConnectionRefusedError(
                    errno.ECONNREFUSED, f"connection to {host}:{port} from {self.host} failed: {exc.strerror}"
                ) from exc
            except TimeoutError as exc:
                raise TimeoutError(f"opening {host}:{port} through {self.host} timed out") from exc

        def open_channel(transport: paramiko.Transport) -> paramiko.Channel:
            return transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout)

        try:
            channel = self._with_reconnect(open_channel)
        except paramiko.ChannelException as exc:
            if exc.code == 1:
                raise TransportError(
                    f"{self.host} does not allow TCP forwarding (AllowTcpForwarding): {exc.text}"
                ) from exc
            # code 2 'Connect failed' covers refused, unreachable and unknown names on the far side
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"connection to {host}:{port} from {self.host} failed: {exc.text}"
            ) from exc
        except paramiko.SSHException as exc:
            if "Timeout" in str(exc):
                raise TimeoutError(f"opening {host}:{port} through {self.host} timed out") from exc
            raise TransportError(f"cannot open {host}:{port} through {self.host}: {exc}") from exc
        channel.settimeout(timeout)
        return channel


def _collect(channel: paramiko.Channel, stdin: str | None, timeout: float | None) -> tuple[int, bytes, bytes]:
    """Feed stdin and drain stdout and stderr together (no deadlock on large outputs); return rc and both."""
    _feed_stdin(channel, stdin)
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = _drain_channel(channel, deadline)
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not channel.status_event.wait(remaining):
        raise TimeoutError
    return channel.recv_exit_status(), out, err


def _feed_stdin(channel: paramiko.Channel, stdin: str | None) -> None:
    """Send ``stdin`` from a thread (a command that writes before reading must not block us), then EOF."""
    if stdin is None:
        channel.shutdown_write()
        return
    data = stdin.encode()

    def feed() -> None:
        try:
            channel.sendall(data)
            channel.shutdown_write()
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True, name="pbstk-ssh-stdin").start()


def _drain_channel(channel: paramiko.Channel, deadline: float | None) -> tuple[bytes, bytes]:
    """stdout and stderr until stdout's EOF (``TimeoutError`` past ``deadline``)."""
    out: list[bytes] = []
    err: list[bytes] = []
    stdout_open = True
    while stdout_open:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([channel], [], [], remaining)
        if not ready:
            raise TimeoutError
        while channel.recv_stderr_ready():
            err.append(channel.recv_stderr(65536))
        if channel.recv_ready() or channel.eof_received or channel.closed:
            chunk = channel.recv(65536)
            if chunk:
                out.append(chunk)
            elif not channel.recv_ready():
                stdout_open = False
    while True:  # EOF covers both streams: what is left of stderr is already buffered
        chunk = channel.recv_stderr(65536) if channel.recv_stderr_ready() else b""
        if not chunk:
            break
        err.append(chunk)
    return b"".join(out), b"".join(err)


class _SftpFile(OpenFile):
    """A file held open over SFTP: reads reach the same file after a rename or an unlink (sftp-server keeps it
    open), so a rotated log is drained to its end.

    SFTP attributes carry no inode, so "the path still names it" is judged from (size, mtime): fstat the
    handle, stat the path, fstat again; the path is this file when its attributes equal the handle's at either
    end or, while the file grows, its size lies between the two. A replacement with exactly the old size and
    mtime second would pass for the old file until either changes. After a dropped connection the handle is
    gone: the path is opened again and taken for the same file.
    """

    def __init__(self, runner: SSHRunner, path: str) -> None:
        super().__init__(path)
        self.runner = runner
        self._fh: paramiko.SFTPFile | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._call(lambda _fh: None)  # opens it now: FileNotFoundError when missing

    def _call(self, operation: Callable[[paramiko.SFTPFile], _T]) -> _T:
        def call(sftp: paramiko.SFTPClient) -> _T:
            if self._fh is None or self._sftp is not sftp:  # first use, or a new session after a drop
                self._fh, self._sftp = sftp.open(self.path, "rb"), sftp
            return operation(self._fh)

        return self.runner._sftp_call(call)

    def read(self, offset: int, length: int) -> bytes:
        def read(fh: paramiko.SFTPFile) -> bytes:
            fh.seek(offset)
            return fh.read(length)

        return self._call(read)

    def size(self) -> int:
        return int(self._call(lambda fh: fh.stat().st_size) or 0)

    def path_names_it(self) -> bool | None:
        def check(fh: paramiko.SFTPFile) -> bool | None:
            before = fh.stat()
            try:
                now = fh.sftp.stat(self.path)
            except FileNotFoundError:
                return None
            after = fh.stat()
            ends = {(before.st_size, before.st_mtime), (after.st_size, after.st_mtime)}
            if (now.st_size, now.st_mtime) in ends:
                return True
            grew = (before.st_size or 0) < (after.st_size or 0)
            return grew and (before.st_size or 0) <= (now.st_size or 0) <= (after.st_size or 0)

        return self._call(check)

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except Exception:  # noqa: S110 - closing on a dead session may fail in many ways
                pass
            self._fh = None
