"""``pbstk launch``, ``status``, ``jobs``, ``cancel``, ``logs``, ``wait``."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from pbs_toolkit.cli.options import SECONDS, build_request, echo_json, read_key_env, render_options, table
from pbs_toolkit.jobs.logs import STREAMS
from pbs_toolkit.schedulers import BACKENDS, stream_aliases


def progress_printer(quiet: bool = False) -> Any:
    """An ``on_progress`` callback that prints one line per change to stderr."""

    def show(st: Any, elapsed: float) -> None:
        if quiet:
            return
        detail = st.phase or st.comment or st.reason or ""
        if st.state.value == "PENDING":  # the scheduler's own state and explanation
            said = f"({st.record.scheduler.upper()} {st.scheduler_state or '?'})"
            detail = f"{said} {st.comment or st.reason or ''}".rstrip()
        elif st.state.final:
            detail = st.reason or detail
        click.echo(f"[{elapsed:6.0f}s] {st.state.value:<8} {detail}", err=True)

    return show


def _read_key_env(name: str | None) -> str | None:
    return read_key_env(name, os.environ)  # validated (HTTP-header safe) before anything is submitted


@click.command()
@click.argument("model")
@render_options
@click.option("--scheduler", type=click.Choice(list(BACKENDS)), help="Override the profile's scheduler.")
@click.option("--ssh", "ssh_host", help="Submit through this SSH host (a ~/.ssh/config alias works).")
@click.option("--accept-new-host-key", is_flag=True, help="Trust an SSH host key not yet in known_hosts.")
@click.option("--api-key-env", help="Take the server's API key from this environment variable.")
@click.option("--no-api-key", is_flag=True, help="Serve without an API key (anyone on the network can use it).")
@click.option("--dry-run", is_flag=True, help="Render and validate only; write and submit nothing.")
@click.option("--wait", "wait_ready", is_flag=True, help="Wait until the server is ready.")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait with --wait.")
@click.option("--json", "as_json", is_flag=True)
def launch(model: str, scheduler: str | None, ssh_host: str | None, accept_new_host_key: bool,
           api_key_env: str | None, no_api_key: bool, dry_run: bool, wait_ready: bool, timeout: float,
           as_json: bool, **kw: Any) -> None:
    """Render, submit and record a vLLM server job for MODEL."""
    from pbs_toolkit.jobs.launch import launch as do_launch
    from pbs_toolkit.jobs.store import JobStore

    req = build_request(model, scheduler=scheduler, ssh_host=ssh_host, **kw)
    store = JobStore()
    result = do_launch(req, store=store, api_key=_read_key_env(api_key_env), use_api_key=not no_api_key,
                       dry_run=dry_run, accept_unknown_host=accept_new_host_key)
    rec, job = result.record, result.rendered
    for note in job.notes:
        click.echo(f"pbstk: note: {note}", err=True)
    if dry_run:
        if as_json:
            echo_json({"dry_run": True, **job.summary()})
        else:
            click.echo(f"dry run: {job.preset.name} ({job.preset.layout()}) on {job.profile.name}; "
                       f"would write {job.run_dir}\n{job.job_script}", nl=False)
        return
    ready = None
    if wait_ready:
        from pbs_toolkit.jobs.readiness import wait_until_ready

        ready = wait_until_ready(rec, timeout=timeout, store=store, on_progress=progress_printer(as_json))
    if as_json:
        data = {"job_id": rec.job_id, "name": rec.name, "model": rec.model, "preset": rec.preset,
                "scheduler": rec.scheduler, "run_dir": rec.run_dir, "notes": job.notes}
        if ready is not None:
            data.update(ready.to_dict())
        echo_json(data)
        return
    click.echo(f"submitted {rec.job_id} ({rec.preset}: {job.preset.layout()}, profile {rec.profile})")
    click.echo(f"run directory: {rec.run_dir}")
    if ready is not None:
        click.echo(f"ready: {ready.url}  (model {rec.served_model_name})")
    click.echo("next:")
    click.echo(f"  pbstk logs {rec.job_id} -f")
    click.echo(f"  pbstk update-endpoint {rec.job_id}")
    click.echo(f"  pbstk cancel {rec.job_id}")


@click.command()
@click.argument("jobs", nargs=-1)
@click.option("--all", "show_all", is_flag=True, help="Include jobs that already ended.")
@click.option("--json", "as_json", is_flag=True)
def status(jobs: tuple[str, ...], show_all: bool, as_json: bool) -> None:
    """State of jobs: PENDING, STARTING, READY, FAILED, FINISHED, CANCELLED, LOST.

    UNKNOWN means the scheduler did not answer (after retries) and the run directory does not tell;
    nothing is recorded then. With no JOB: every job that has not ended (``--all`` for all).
    One scheduler query per call.
    """
    from pbs_toolkit.jobs.status import status as do_status
    from pbs_toolkit.jobs.store import JobStore

    store = JobStore()
    if jobs:
        records = [store.find(j) for j in jobs]
    else:
        records = [r for r in store.all() if show_all or not r.final_state]
    results = do_status(records, store)
    if as_json:
        echo_json([s.to_dict() for s in results])
        return
    if not results:
        click.echo("no active jobs (`pbstk jobs --all` lists earlier ones)")
        return
    rows = []
    for s in results:
        detail = s.phase if s.state.value == "STARTING" else (s.comment if s.state.value == "PENDING" else s.reason)
        rows.append([s.record.job_id, s.record.name, s.state.value, s.scheduler_state or "-",
                     s.url or "-", detail or ""])
    click.echo(table(rows, ["JOB", "NAME", "STATE", "SCHED", "URL", "DETAIL"]))
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
    from pbs_toolkit.jobs.store import JobStore

    store = JobStore()
    records = [r for r in store.all() if show_all or not r.final_state]
    for intent in store.intents():  # launches not recorded yet: never let a submitted job go unmentioned
        via = f" via {intent.transport}" if intent.transport else ""
        later = f"the next launch{via}" if via else "pbstk, once that launch has ended,"
        click.echo(f"pbstk: note: the launch of {intent.name!r}{via} is not recorded yet (being submitted, or "
                   f"interrupted: {later} adopts the id in {intent.run_dir}/job_id)", err=True)
    if as_json:
        echo_json([r.public() for r in records])
        return
    if not records:
        click.echo("no active jobs (`pbstk jobs --all` lists earlier ones)")
        return
    rows = [[r.job_id, r.name, r.preset, r.profile, r.transport or "local", r.final_state or "active",
             time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)), r.run_dir] for r in records]
    click.echo(table(rows, ["JOB", "NAME", "PRESET", "PROFILE", "VIA", "RECORDED", "LAUNCHED", "RUN DIR"]))


@click.command()
@click.argument("jobs", nargs=-1, required=True)
def cancel(jobs: tuple[str, ...]) -> None:
    """Stop jobs through their scheduler. Already-ended jobs are not an error."""
    from pbs_toolkit.jobs.launch import cancel as do_cancel
    from pbs_toolkit.jobs.store import JobStore

    store = JobStore()
    records = [store.find(j) for j in jobs]
    for record in records:
        stopped = do_cancel(record)
        click.echo(f"{record.job_id}: {'cancelled' if stopped else 'already ended'}")


@click.command()
@click.argument("job", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines from the end to show first.")
@click.option("--stream", type=click.Choice(STREAMS), default="vllm", show_default=True,
              help=f"vllm, or the scheduler's job output (sched-out, sched-err; {', '.join(stream_aliases())} "
              "still work).")
def logs(job: str | None, follow: bool, lines: int, stream: str) -> None:
    """The realtime vLLM log of JOB (default: the newest job), locally or over SSH."""
    from pbs_toolkit.errors import TransportError, UsageError
    from pbs_toolkit.jobs.logs import decoded_pieces, stream_path, tail_blocks
    from pbs_toolkit.jobs.logs import follow as do_follow
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.transports import open_runner

    if lines < 0:
        raise UsageError("-n must not be negative")
    store = JobStore()
    record = store.find(job)
    path = stream_path(record.run_dir, record.scheduler, stream)
    runner = open_runner(record.transport or None)
    try:
        if not follow:
            try:
                blocks, _ = tail_blocks(runner, path, lines)
            except FileNotFoundError:
                raise UsageError(f"{path} does not exist yet (job {record.job_id} not started?)") from None
            for piece in decoded_pieces(blocks):  # -n 1000000: no second full copy of the text
                click.echo(piece, nl=False)
            return

        from pbs_toolkit.jobs.status import status as do_status  # only -f needs it (http.client: ~20 ms)

        def is_final() -> bool:
            return do_status([record], store, runners={record.transport: runner})[0].state.final

        try:
            do_follow(runner, path, click.echo, lines=lines, is_final=is_final,
                      notice=lambda m: click.echo(f"pbstk: {m}", err=True))
        except TransportError as exc:
            raise TransportError(f"lost the connection while following {path}: {exc}") from exc
    finally:
        runner.close()


@click.command()
@click.argument("job", required=False)
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON; no progress lines.")
def wait(job: str | None, timeout: float, as_json: bool) -> None:
    """Wait until JOB's server answers; fail fast with the cause if it cannot."""
    from pbs_toolkit.jobs.readiness import wait_until_ready
    from pbs_toolkit.jobs.store import JobStore

    store = JobStore()
    record = store.find(job)
    st = wait_until_ready(record, timeout=timeout, store=store, on_progress=progress_printer(as_json))
    if as_json:
        echo_json(st.to_dict())
    else:
        click.echo(f"{record.job_id} ready: {st.url} (model {record.served_model_name})")


COMMANDS = [launch, status, jobs, cancel, logs, wait]
