"""The ``Runner`` interface shared by the local and SSH transports."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket


@dataclass(frozen=True)
class Result:
    """What a command left behind: exit code and decoded output."""

    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


@dataclass(frozen=True)
class FileId:
    """Which file a path names now and its size: (device, inode) tell a rotated or recreated file from the old one."""

    dev: int
    ino: int
    size: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


class OpenFile(abc.ABC):
    """A file held open for following (``Runner.open_file``): it stays the same file when its path is renamed,
    removed or replaced, so what was written to it last can still be read (``drains``)."""

    #: whether reads still reach the file once its path names another one (False: only by path)
    drains: bool = True

    def __init__(self, path: str) -> None:
        self.path = path

    @abc.abstractmethod
    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` of the open file."""

    @abc.abstractmethod
    def size(self) -> int:
        """The open file's size now."""

    @abc.abstractmethod
    def path_names_it(self) -> bool | None:
        """True while ``path`` names this file; False once it names another one; None when it names nothing."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Let go of the file."""


class _PathFile(OpenFile):
    """The fallback ``OpenFile`` for a runner that cannot hold files open: reads by path, identity from
    ``file_id`` (device, inode) asked after each read, so bytes of a replacement are never taken for ours; the
    old file cannot be read once the path moved on."""

    drains = False

    def __init__(self, runner: Runner, path: str) -> None:
        super().__init__(path)
        self.runner = runner
        fid = runner.file_id(path)
        if fid is None:
            raise FileNotFoundError(path)
        self.key, self._size = fid.key, fid.size

    def read(self, offset: int, length: int) -> bytes:
        data = self.runner.read_bytes(self.path, offset, length)
        return data if self.path_names_it() else b""

    def size(self) -> int:
        return self._size

    def path_names_it(self) -> bool | None:
        fid = self.runner.file_id(self.path)
        if fid is None:
            return None
        if fid.key != self.key:
            return False
        self._size = fid.size
        return True


class Runner(abc.ABC):
    """Runs commands and touches files on the machine where jobs are submitted (here or a login node).

    Every command is an argument list. Implementations never use a shell to join arguments; the SSH
    runner quotes each one with ``shlex.join`` because the remote side always has a shell.
    """

    #: a short name for messages and job records: ``local`` or ``ssh:<host>``
    name: str = "local"

    @abc.abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        timeout: float | None = 60.0,
        cwd: str | None = None,
    ) -> Result:
        """Run ``argv`` and wait. ``env`` adds variables to the inherited environment.

        Raises ``TransportError`` when the command cannot be started at all (missing executable gives
        rc 127 instead, like a shell would, so callers can say "<command> not found on HOST").
        """

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes (all when ``None``) from ``offset``. Raises ``FileNotFoundError``."""

    @abc.abstractmethod
    def size(self, path: str) -> int | None:
        """Size of the file in bytes, or ``None`` when it does not exist."""

    def file_id(self, path: str) -> FileId | None:
        """Device, inode and size of the file ``path`` names (symlinks followed), or ``None`` when it does not exist.

        This default runs ``stat -L -c '%d %i %s'`` through ``run``: over SSH that is one command on the same
        connection, since SFTP attributes carry no inode. Where ``stat`` cannot answer (no GNU coreutils), the
        identity is unknown and reads as (0, 0) every time, so followers fall back to tracking offsets only.
        """
        result = self.run(["stat", "-L", "-c", "%d %i %s", "--", path], env={"LC_ALL": "C"}, timeout=30.0)
        fields = result.stdout.split()
        if result.ok and len(fields) == 3 and all(field.isdigit() for field in fields):
            return FileId(int(fields[0]), int(fields[1]), int(fields[2]))
        size = self.size(path)
        return None if size is None else FileId(0, 0, size)

    def open_file(self, path: str) -> OpenFile:
        """``path`` held open for following; raises ``FileNotFoundError``. The default reads by path (no drain)."""
        return _PathFile(self, path)

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file atomically (temp file + rename in the same directory) with ``mode``."""

    @abc.abstractmethod
    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """Create a directory and its parents; no error when it exists."""

    @abc.abstractmethod
    def home(self) -> str:
        """The home directory of the user on that machine."""

    @abc.abstractmethod
    def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
        """A connected stream socket (or socket-like channel) to ``host:port`` as seen from that machine.

        Over SSH this is a ``direct-tcpip`` channel, so compute nodes that the user's laptop cannot route
        to are still reachable. Raises ``OSError`` (e.g. ``ConnectionRefusedError``) when nothing listens.
        """

    def expanduser(self, path: str) -> str:
        """Expand a leading ``~`` or ``$HOME`` against this machine's home directory."""
        if path == "~" or path.startswith("~/"):
            return self.home() + path[1:]
        if path.startswith("$HOME"):
            return self.home() + path[len("$HOME") :]
        return path

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Safe to call more than once."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WrappingRunner(Runner):
    """A runner that changes how commands run and hands everything else to ``inner`` (subclasses override ``run``).

    Not closed by ``close()``: the wrapped runner belongs to whoever opened it."""

    def __init__(self, inner: Runner) -> None:
        self.inner, self.name = inner, inner.name

    def run(self, argv: Sequence[str], **kw: Any) -> Result:
        return self.inner.run(argv, **kw)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read_bytes(path, offset, length)

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.inner.write_bytes(path, data, mode)

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        self.inner.makedirs(path, mode)

    def home(self) -> str:
        return self.inner.home()

    def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
        return self.inner.open_connection(host, port, timeout)


def tcp_connect(host: str, port: int, timeout: float) -> socket.socket:
    """Plain TCP connection from this machine (used by ``LocalRunner.open_connection``)."""
    import socket  # here: a command that only reads files (`pbstk logs -n`) never loads the socket module

    return socket.create_connection((host, port), timeout=timeout)
