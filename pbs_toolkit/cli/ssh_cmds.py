"""``pbstk ssh status`` and ``pbstk ssh close``: the background SSH connection holders (one login per day).

Errors here are SSH errors: exit 4."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from pbs_toolkit.cli.options import echo_json
from pbs_toolkit.errors import TransportError
from pbs_toolkit.textutil import table

if TYPE_CHECKING:
    from pbs_toolkit.transports.ssh_mux import HolderInfo


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _holders() -> list[HolderInfo]:
    from pbs_toolkit.transports import ssh_mux

    try:
        return list(ssh_mux.holders())
    except OSError as exc:
        raise TransportError(f"cannot list SSH connection holders: {exc}") from None


@click.group("ssh")
def ssh_group() -> None:
    """SSH connections pbstk keeps open between commands (one login, one MFA prompt, per working day).

    \b
      pbstk ssh status            # which logins are held, idle for how long
      pbstk ssh close --all       # log out now

    Idle time before a held login ends: PBSTK_SSH_PERSIST or `ssh_persist:` in config.yaml (seconds,
    default 28800 = 8 h; 0 = connect anew for every command)."""


@ssh_group.command("status")
@click.option("--json", "as_json", is_flag=True)
def ssh_status(as_json: bool) -> None:
    """List the held SSH connections: destination, pid, since, idle, socket."""
    holders = _holders()
    if as_json:
        echo_json([h.public() for h in holders])
        return
    if not holders:
        click.echo("no SSH connection held")
        return
    rows = [[h.host, h.destination, str(h.pid), time.strftime("%Y-%m-%d %H:%M", time.localtime(h.since)),
             "in use" if h.active else _duration(h.idle), _duration(h.persist), h.socket] for h in holders]
    click.echo(table(rows, ["HOST", "DESTINATION", "PID", "SINCE", "IDLE", "ENDS AFTER IDLE", "SOCKET"]))


@ssh_group.command("close")
@click.argument("destination", required=False)
@click.option("--all", "close_all", is_flag=True, help="Close every held connection.")
@click.option("--json", "as_json", is_flag=True, help="Print the list of connections closed.")
def ssh_close(destination: str | None, close_all: bool, as_json: bool) -> None:
    """Log out of DESTINATION (a host as given to --ssh, or user@host:port as `pbstk ssh status` shows it)."""
    from pbs_toolkit.errors import UsageError
    from pbs_toolkit.transports import ssh_mux

    if bool(destination) == close_all:
        raise UsageError("pbstk ssh close: give a DESTINATION or --all (not both)")
    holders = [h for h in _holders() if close_all or destination in (h.host, h.destination)]
    if not holders and not close_all:
        raise TransportError(f"no SSH connection held for {destination} (see pbstk ssh status)")
    closed = [holder for holder in holders if ssh_mux.close_holder(holder)]
    if as_json:
        echo_json([h.public() for h in closed])
        return
    for holder in closed:
        click.echo(f"closed {holder.host} ({holder.destination}, pid {holder.pid})")
    if not holders:
        click.echo("no SSH connection held")


COMMANDS = [ssh_group]
