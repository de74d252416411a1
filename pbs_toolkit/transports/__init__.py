"""Transports: the one way the toolkit runs commands, reads run-directory files and opens TCP connections.

``LocalRunner`` (this machine) and ``SSHRunner`` (a login node over paramiko) implement :class:`Runner`.
Nothing else in the package spawns processes or opens SSH connections.
"""

from __future__ import annotations

from pbs_toolkit.transports.base import Result, Runner
from pbs_toolkit.transports.local import LocalRunner


def open_runner(ssh_host: str | None, *, accept_unknown_host: bool = False) -> Runner:
    """Return a runner for ``ssh_host`` (SSH, imported lazily) or this machine when it is ``None``."""
    if not ssh_host:
        return LocalRunner()
    from pbs_toolkit.transports.ssh import SSHRunner

    return SSHRunner(ssh_host, accept_unknown_host=accept_unknown_host)


__all__ = ["Result", "Runner", "LocalRunner", "open_runner"]
