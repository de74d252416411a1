"""The ``Runner`` interface shared by the local and SSH transports."""

from __future__ import annotations

import abc
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Result:
    """What a command left behind: exit code and decoded output."""

    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


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
        rc 127 instead, like a shell would, so callers can say "qsub not found on HOST").
        """

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes (all when ``None``) from ``offset``. Raises ``FileNotFoundError``."""

    @abc.abstractmethod
    def size(self, path: str) -> int | None:
        """Size of the file in bytes, or ``None`` when it does not exist."""

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


def tcp_connect(host: str, port: int, timeout: float) -> socket.socket:
    """Plain TCP connection from this machine (used by ``LocalRunner.open_connection``)."""
    return socket.create_connection((host, port), timeout=timeout)
