"""``SSHRunner``: commands, files and TCP connections on a login node over ONE paramiko connection.

Login nodes of most sites ask for MFA on every new connection, so a runner opens a single connection
lazily and reuses it for every exec channel, the SFTP session and ``direct-tcpip`` forwards. Only the
``ssh*`` modules of this package import paramiko: this one, :mod:`.ssh_destination` (the config lookup),
:mod:`.ssh_auth` (host keys, authentication), :mod:`.ssh_channel` (one exec channel's I/O) and
:mod:`.ssh_sftp` (a file held open); ``open_runner`` imports this one lazily, which keeps ``pbstk --help`` fast.

Between commands the login is kept by a connection holder (:mod:`.ssh_holder`, reached through
:mod:`.ssh_mux`) unless ``persist`` is 0: the runner then sends its exec, SFTP and ``direct-tcpip`` requests
to the holder instead of opening a connection of its own, so a day of commands costs one MFA prompt.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import paramiko

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.base import OpenFile, Result, Runner
from pbs_toolkit.transports.ssh_auth import Authenticator, HostKeyPolicy, known_hosts_name, terminal_prompt
from pbs_toolkit.transports.ssh_channel import build_remote_command, collect
from pbs_toolkit.transports.ssh_destination import (
    AUTH_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    KEEPALIVE_S,
    PasswordPrompt,
    SSHDestination,
    split_destination,
)
from pbs_toolkit.transports.ssh_mux import MuxClient, persist_seconds
from pbs_toolkit.transports.ssh_sftp import SftpFile
from pbs_toolkit.transports.trace import log_command

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

_T = TypeVar("_T")

# paramiko logs a dropped connection at ERROR, with two tracebacks, from its transport thread. With no handler
# configured, Python's last-resort handler prints them on stderr before our one-line error: give paramiko's
# logger a handler that drops them (records still propagate to any handler a caller configures).
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SSHRunner(SSHDestination, Runner):
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
        self.name = f"ssh:{host}"
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

        SSHDestination.__init__(self, host, accept_unknown_host=accept_unknown_host, config_path=config_path,
                                known_hosts_path=known_hosts_path, password_prompt=password_prompt)

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
            rc, out, err = collect(channel, stdin, timeout)
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
        host, an SFTP call ~1 ms). See ``SftpFile`` (ssh_sftp.py) for how identity is judged without inodes."""
        return SftpFile(path, self._sftp_call)

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


