"""``pbstk clean``: housekeeping of run directories and job records."""

from __future__ import annotations

import click

from pbs_toolkit.cli.options import echo_json


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@click.command()
@click.option("--older-than", "older_than", default="7d", show_default=True, metavar="DURATION",
              help="Only jobs that ended at least this long ago: 30m, 12h, 1d12h, 2w (0: every ended job; "
              "docs/settings.md#durations).")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True)
def clean(older_than: str, dry_run: bool, as_json: bool) -> None:
    """Remove run directories and job records of jobs that ended (locally and over SSH).

    What goes, per job: its run directory (logs, job and start scripts, server.json, the local scheduler's
    spool) and its record (`pbstk jobs`, `status`, `logs` no longer know it). What stays: its figures in
    `pbstk usage` (wall time, nodes, GPUs, requests, tokens: kept in the job store's usage ledger), its
    service's record, and every registry file (clean never edits one).

    Never touches a job that is running, queued or UNKNOWN (jobs not recorded as ended get one status
    query first), nor a replica an active service still names, nor a directory that is not a pbstk run
    directory directly inside its runs root.

    \b
      pbstk clean --dry-run
      pbstk clean --older-than 12h
    """
    from pbs_toolkit.client import Client
    from pbs_toolkit.durations import parse

    # refused before anything is asked or removed; a bare number needs its unit here (7 could mean days)
    seconds = parse(older_than, "--older-than", zero=True, bare=False)
    with Client() as c:
        report = c.clean(seconds, dry_run=dry_run)
    for warning in report.warnings:
        click.echo(f"pbstk: warning: {warning}", err=True)
    if as_json:
        echo_json(report.to_dict())
        return
    for item in report.items:
        what = f"{item.job_id} ({item.name}, {item.state} {_age(item.age_s)} ago): {item.run_dir}"
        click.echo(f"{item.action} {what}" + (f" ({item.detail})" if item.detail else ""))
    done = sum(1 for i in report.items if i.action != "skipped")
    verb = "would remove" if dry_run else "removed"
    kept = "; `pbstk usage` keeps their figures" if done else ""
    click.echo(f"{verb} {done} job(s); left {report.active} not ended, {report.recent} ended less than "
               f"{older_than} ago, {len(report.items) - done} skipped{kept}", err=True)


COMMANDS = [clean]
