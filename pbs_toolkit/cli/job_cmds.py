"""``pbstk launch``, ``status``, ``jobs``, ``cancel``, ``wait`` (``logs``: cli/logs_cmds.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_job
from pbs_toolkit.cli.lazy import LazyChoice, backend_names
from pbs_toolkit.cli.options import SECONDS, STAGE_OPTION, build_request, echo_json, read_key_env, render_options, table
from pbs_toolkit.cli.output import state_cell, time_cells
from pbs_toolkit.cli.progress import interrupt_hint, progress_printer
from pbs_toolkit.cli.render_cmds import layout_text
from pbs_toolkit.durations import short


def _read_key_env(name: str | None) -> str | None:
    return read_key_env(name, os.environ)  # validated (HTTP-header safe) before anything is submitted


@click.command()
@click.argument("model")
@render_options
@click.option("--scheduler", type=LazyChoice(backend_names), help="Override the profile's scheduler.")
@click.option("--ssh", "ssh_host",
              help="Submit through this SSH host (a ~/.ssh/config alias works); none: on this machine, no SSH.")
@click.option("--accept-new-host-key", is_flag=True, help="Trust an SSH host key not yet in known_hosts.")
@click.option("--api-key-env", help="Take the server's API key from this environment variable.")
@click.option("--no-api-key", is_flag=True, help="Serve without an API key (anyone on the network can use it).")
@click.option("--dry-run", is_flag=True, help="Render and validate only; write and submit nothing.")
@click.option("--wait", "wait_ready", is_flag=True, help="Wait until the server is ready.")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait with --wait.")
@click.option("--json", "as_json", is_flag=True)
@STAGE_OPTION
def launch(model: str, scheduler: str | None, ssh_host: str | None, accept_new_host_key: bool,
           api_key_env: str | None, no_api_key: bool, dry_run: bool, wait_ready: bool, timeout: float,
           as_json: bool, stage_weights: bool, **kw: Any) -> None:
    """Render, submit and record a vLLM server job for MODEL."""
    from pbs_toolkit.client import Client

    req = build_request(model, scheduler=scheduler, ssh_host=ssh_host, **kw)
    with Client(accept_new_host_key=accept_new_host_key) as c:  # one connection submits and waits
        result = c.launch_request(req, api_key=_read_key_env(api_key_env), use_api_key=not no_api_key,
                                  dry_run=dry_run, stage=stage_weights)
        _show_launch(result, dry_run, as_json)  # the id at once: a long queue must not hide which job it is
        if not dry_run and (note := c.shared_name_note(result.record.name, "job")):  # a service of that name
            click.echo(f"pbstk: note: {note}", err=True)
        ready = None
        if wait_ready and not dry_run:
            with interrupt_hint(result.record.job_id), progress_printer(as_json) as show:
                ready = c.wait(result.record, timeout, show)
    if not dry_run:
        _show_ready(result, ready, as_json)


def _show_ready(result: Any, ready: Any, as_json: bool) -> None:
    """The end of a launch: the one JSON document, or the ready line after the wait."""
    rec = result.record
    if as_json:  # the job object; with --wait, the READY status's (the same fields and the state ones)
        echo_json({**(ready or rec).to_dict(), "notes": result.rendered.notes})
    elif ready is not None:
        click.echo(f"ready: {ready.url}  (model {rec.served_model_name})")


def _show_launch(result: Any, dry_run: bool, as_json: bool) -> None:
    """What the launch did, printed the moment the scheduler took the job (JSON waits for the end instead)."""
    rec, job = result.record, result.rendered
    for note in job.notes:
        click.echo(f"pbstk: note: {note}", err=True)
    if dry_run:
        if as_json:
            echo_json(job.to_dict(dry_run=True))
        else:
            click.echo(f"dry run: {job.preset.name} ({layout_text(job)}) with profile {job.profile.name}; "
                       f"would write {job.run_dir}\n{job.job_script}", nl=False)
        return
    if as_json:
        return
    click.echo(f"submitted {rec.job_id} ({rec.preset}: {layout_text(job)}, profile {rec.profile})")
    click.echo(f"run directory: {rec.run_dir}")
    click.echo("next:")
    click.echo(f"  pbstk logs {rec.job_id} -f")
    click.echo(f"  pbstk update-endpoint {rec.job_id}")
    click.echo(f"  pbstk cancel {rec.job_id}")


@click.command()
@click.argument("jobs", nargs=-1, shell_complete=complete_job)
@click.option("--all", "show_all", is_flag=True, help="Include jobs that already ended.")
@click.option("--json", "as_json", is_flag=True)
def status(jobs: tuple[str, ...], show_all: bool, as_json: bool) -> None:
    """State of jobs: PENDING, STARTING, READY, FAILED, FINISHED, CANCELLED, LOST.

    UNKNOWN means the scheduler did not answer (after retries) and the run directory does not tell;
    nothing is recorded then. With no JOB: every job that has not ended (``--all`` for all).
    UPTIME and WALLTIME-LEFT come from the scheduler; ``!`` marks a job within 10 minutes of its walltime.
    A job over several nodes is READY only with every node up (DETAIL ``2/2 nodes``); a failed node is named.
    While STARTING, DETAIL adds the start-up phase under way and its seconds so far, and the longest phase when a
    finished one took longer (``--json``: the ``startup`` object, seconds per phase; docs/coldstart.md).
    One scheduler query per call.
    """
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.startup_phases import startup_text
    from pbs_toolkit.jobs.status_types import ServerState

    with Client() as c:
        both = service_cmds.status_services(c, jobs, show_all, as_json)  # services above jobs, one query
        if both is None:  # only service names: shown in full
            return
        services, results = both
    if as_json:
        echo_json([s.to_dict() for s in services] + [s.to_dict() for s in results])
        return
    if service_cmds.print_service_lines(services, bool(results)) and not results:
        return
    if not results:
        click.echo("no active jobs (`pbstk jobs --all` lists earlier ones)")
        return
    rows = []
    for s in results:
        detail = (s.phase if s.state is ServerState.STARTING
                  else s.comment if s.state is ServerState.PENDING else s.reason)
        if s.state is ServerState.STARTING and (took := startup_text(s.startup)):  # docs/coldstart.md
            detail = f"{detail} ({took})" if detail else took
        if s.state is ServerState.READY and s.nodes_text:  # READY 2/2 nodes
            detail = f"{s.nodes_text}; {detail}" if detail else s.nodes_text
        uptime, left = time_cells(s)
        if s.walltime_ending:
            detail = f"ending in {short(s.walltime_left_s or 0)} (walltime); {detail or ''}".rstrip("; ")
        detail = f"{s.busy}; {detail}" if s.busy and detail else (s.busy or detail)
        rows.append([s.record.job_id, s.record.name, state_cell(s), s.scheduler_state or "-",
                     uptime, left, s.url or "-", detail or ""])
    click.echo(table(rows, ["JOB", "NAME", "STATE", "SCHED", "UPTIME", "WALLTIME-LEFT", "URL", "DETAIL"]))
    for s in results:
        if s.state.value == "FAILED" and s.log_excerpt:
            click.echo(f"\n{s.record.job_id}: {s.reason}")
            for line in s.log_excerpt:
                click.echo(f"  | {line}")


@click.command()
@click.option("--all", "show_all", is_flag=True, help="Include jobs that already ended.")
@click.option("--json", "as_json", is_flag=True)
def jobs(show_all: bool, as_json: bool) -> None:
    """Jobs pbstk launched (from the local job store; no scheduler query)."""
    from pbs_toolkit.client import Client

    with Client() as c:
        records, intents = c.records(all=show_all), c.unrecorded_launches()
    for intent in intents:  # launches not recorded yet: never let a submitted job go unmentioned
        via = f" via {intent.transport}" if intent.transport else ""
        later = f"the next launch{via}" if via else "pbstk, once that launch has ended,"
        click.echo(f"pbstk: note: the launch of {intent.name!r}{via} is not recorded yet (being submitted, or "
                   f"interrupted: {later} adopts the id in {intent.run_dir}/job_id)", err=True)
    if as_json:
        echo_json([r.to_dict() for r in records])
        return
    if not records:
        click.echo("no active jobs (`pbstk jobs --all` lists earlier ones)")
        return
    rows = [[r.job_id, r.name, r.preset, r.profile, r.transport or "local", r.final_state or "active",
             time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)), r.run_dir] for r in records]
    click.echo(table(rows, ["JOB", "NAME", "PRESET", "PROFILE", "VIA", "RECORDED", "LAUNCHED", "RUN DIR"]))


@click.command()
@click.argument("jobs", nargs=-1, shell_complete=complete_job)
@click.option("--all", "everything", is_flag=True,
              help="Every active service and job in this machine's job store, whatever the profile (no prompt).")
@click.option("--keep-endpoint", is_flag=True, help="Leave the jobs' registry entries in place (default: removed).")
@click.option("--json", "as_json", is_flag=True, help="Print a list of cancellation objects.")
def cancel(jobs: tuple[str, ...], everything: bool, keep_endpoint: bool, as_json: bool) -> None:
    """Stop jobs (or services) through their scheduler. Already-ended jobs are not an error.

    Registry entries the jobs wrote (update-endpoint) are removed, if they still point at them. `--all` stops
    every service and job this machine's store records as active, each through the login node it was launched
    through; jobs submitted by hand or from another machine are not touched."""
    from pbs_toolkit.client import Cancellation, Client
    from pbs_toolkit.errors import UsageError

    if everything and jobs:
        raise UsageError("cancel takes JOB names or --all, not both")
    if not everything and not jobs:
        raise UsageError("cancel needs JOB (a job id, name or service), or --all for every active one")
    if everything:
        _cancel_all(keep_endpoint, as_json)
        return
    done = []
    with Client() as c:
        services = {j: c.service(j) for j in jobs}  # a service name (no job of that name): docs/services.md
        records = [c.record(j) for j in jobs if services[j] is None]  # every name resolves before anything stops
        for name, svc in services.items():
            if svc is None:
                continue
            stopped = c.cancel_service(svc, keep_endpoint=keep_endpoint)
            done.extend(stopped)
            if not as_json:
                click.echo(f"{name}: {'cancelled' if stopped else 'already ended'} (service: "
                           f"{len(stopped)} job(s), router, keeper)")
        for record in records:
            done.append(Cancellation(record.job_id, record.name, c.cancel(record, keep_endpoint=keep_endpoint)))
            if not as_json:
                click.echo(f"{record.job_id}: {done[-1].outcome}")
    if as_json:
        echo_json([d.to_dict() for d in done])


def _cancel_all(keep_endpoint: bool, as_json: bool) -> None:
    """``cancel --all``: one line per service and job stopped (or a list of cancellation objects); a job that
    could not be stopped gets a warning line, and the first such error decides the exit code at the end."""
    from pbs_toolkit.client import Client
    from pbs_toolkit.services.cancel_all import cancel_all

    with Client() as c:
        result = cancel_all(c, keep_endpoint=keep_endpoint, on_done=None if as_json else click.echo)
    if as_json:
        echo_json([d.to_dict() for _, stopped in result.services for d in stopped]
                  + [d.to_dict() for d in result.jobs])
    elif not result.services and not result.jobs and not result.failures:
        click.echo("no active jobs or services to cancel")
    for what, exc in result.failures[1:]:
        click.echo(f"pbstk: warning: {what} was not cancelled: {exc.message}", err=True)
    if result.failures:
        what, exc = result.failures[0]
        exc.message = f"{what} was not cancelled: {exc.message}"
        raise exc


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON; no progress lines.")
def wait(job: str | None, timeout: float, as_json: bool) -> None:
    """Wait until JOB's server answers; fail fast with the cause if it cannot.

    JOB may name a service (`pbstk serve`): then wait until the service is READY."""
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client

    with Client() as c:
        svc = service_cmds.named_service(c, job)  # docs/services.md
        if svc is not None:
            sst = service_cmds.wait_service(c, svc, timeout, as_json)
            if as_json:
                echo_json(sst.to_dict())
            else:
                click.echo(f"service {svc.name} ready: {sst.url} ({sst.summary}, model {svc.served_model_name})")
            return
        record = c.record(job)
        with interrupt_hint(record.job_id), progress_printer(as_json) as show:
            st = c.wait(record, timeout, show)
    if as_json:
        echo_json(st.to_dict())
    else:
        click.echo(f"{st.record.job_id} ready: {st.url} (model {st.record.served_model_name})")


COMMANDS = [launch, status, jobs, cancel, wait]
