"""Transports: the one way the toolkit runs commands, reads run-directory files and opens TCP connections.

``LocalRunner`` (this machine) and ``SSHRunner`` (a login node over paramiko) implement :class:`Runner`.
Nothing else in the package spawns processes or opens SSH connections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pbs_toolkit.transports.base import Result, Runner

if TYPE_CHECKING:
    from pbs_toolkit.transports.local import LocalRunner


def open_runner(ssh_host: str | None, *, accept_unknown_host: bool = False) -> Runner:
    """Return a runner for ``ssh_host`` (SSH, imported lazily) or this machine when it is ``None``."""
    if not ssh_host:
        from pbs_toolkit.transports.local import LocalRunner  # see __getattr__

        return LocalRunner()
    from pbs_toolkit.transports.ssh import SSHRunner

    return SSHRunner(ssh_host, accept_unknown_host=accept_unknown_host)


def __getattr__(name: str) -> Any:
    """``LocalRunner``, imported when first asked for: importing this package (``pbstk logs -n`` reads through
    ``transports.local_files``) must not load ``subprocess`` and the command log that running commands needs."""
    if name == "LocalRunner":
        from pbs_toolkit.transports.local import LocalRunner

        return LocalRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Result", "Runner", "LocalRunner", "open_runner"]
