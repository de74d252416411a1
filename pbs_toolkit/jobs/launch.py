"""The one sequence with side effects: render -> write the run directory -> submit -> record.

Also ``cancel``. Everything here goes through a ``Runner``, so it works the same locally and over SSH.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pbs_toolkit import paths
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.jobs.nodes import request_stop
from pbs_toolkit.jobs.render import RenderedJob, render, run_dir_errors
from pbs_toolkit.jobs.spec import LaunchSpec, launch_options
from pbs_toolkit.jobs.store import (
    JOB_ID_MARKER,
    JOB_ID_RE,
    RECORD_MARKER,
    SUBMITTING_MARKER,
    Intent,
    JobRecord,
    JobStore,
    file_lock,
    log_run_dir,
    nothing_submitted,
)
from pbs_toolkit.schedulers import JobRef, Scheduler, backend_class, get_scheduler
from pbs_toolkit.settings.launch_settings import LaunchSettings, RenderRequest, settings_of
from pbs_toolkit.settings.profiles import walltime_seconds
from pbs_toolkit.signal_scope import handled_by
from pbs_toolkit.transports import Runner, open_runner
from pbs_toolkit.weights.preflight import preflight_weights

DEFAULT_KEY_ENV = "PBSTK_API_KEY"


@dataclass
class LaunchResult:
    record: JobRecord
    rendered: RenderedJob


def new_api_key() -> str:
    """A fresh API key: 32 random bytes, URL-safe, never starting with ``-``. vLLM gets the key from its ``--config``
    file as ``--api-key VALUE``, and a value starting with ``-`` is read as an option (``argument --api-key:
    expected at least one argument``, exit 2): 1 launch in 64 failed so."""
    while (key := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return key


def key_env_name(alias: str) -> str:
    """The environment variable registries name for this job's key: ``PBSTK_KEY_<ALIAS>``."""
    return "PBSTK_KEY_" + re.sub(r"[^A-Z0-9]+", "_", alias.upper()).strip("_")


_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def defer_interrupts() -> Iterator[list[int]]:
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block ends, so a job is never submitted without being
    recorded. Afterwards SIGINT becomes ``KeyboardInterrupt`` and SIGTERM/SIGHUP exit 128+signal; an exception
    from the block wins (its message names the job)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    received: list[int] = []
    with handled_by(lambda signum, _frame: received.append(signum), _DEFERRED):
        yield received
    if received:
        terminating = [sig for sig in received if sig != signal.SIGINT]
        if terminating:
            raise SystemExit(128 + terminating[0])
        raise KeyboardInterrupt


def launch(
    settings: LaunchSettings | RenderRequest,
    *,
    store: JobStore | None = None,
    runner: Runner | None = None,
    api_key: str | None = None,
    use_api_key: bool = True,
    dry_run: bool = False,
    accept_unknown_host: bool = False,
    begin_at: float | None = None,
    after: str | None = None,
    stage: bool = False,
) -> LaunchResult:
    """Render, write, submit and record one job (a ``RenderRequest`` is resolved first, once). With ``dry_run``
    only render: nothing is written, and without a ``runner`` nothing is connected to (paths on a remote host
    stay ``$HOME``-relative). ``begin_at`` and ``after``: when the scheduler may start it (``Scheduler.submit``;
    a service's keep-alive successors). ``stage``: stage missing weights first
    (``weights.preflight.preflight_weights``)."""
    store = store or JobStore()
    settings = settings_of(settings)
    if dry_run and runner is None:
        return _dry_run(settings, use_api_key, api_key)
    if not dry_run:  # no silent local server on a cluster's login node
        from pbs_toolkit.settings.login_host import refuse_unchosen_local

        refuse_unchosen_local(settings.explicit, settings.written)
    own_runner = runner is None
    if runner is None:
        runner = open_runner(settings.launchable().ssh_host, accept_unknown_host=accept_unknown_host)
    try:
        rendered = render(settings, runner)
        transport = "" if runner.name == "local" else runner.name.split(":", 1)[-1]
        key = (api_key or new_api_key()) if use_api_key else None
        record = job_record(settings.request, rendered, transport, key)
        if dry_run:
            return LaunchResult(record, rendered)
        preflight_weights(runner, rendered.model, rendered.profile, stage=stage, vllm_args=rendered.vllm_args,
                          note=stderr_note)  # an offline profile's nodes must find the weights: refused before queuing
        scheduler = get_scheduler(rendered.profile.scheduler)
        scheduler.id_source = functools.partial(store.next_id, scheduler.name)  # backends that number their jobs
        scheduler.find_job = store.find  # and those that read the store's record of ``after``
        with file_lock(store.path.parent / ".launch.lock", store.timeout, store.path):
            _refuse_active_name(store, runner, rendered.job_name, transport)
            intent = store.add_intent(record)  # the plan is on disk before anything is submitted
        _submit_and_record(store, runner, scheduler, rendered, record, intent, key,
                           begin_at=begin_at, after=after)
        return LaunchResult(record, rendered)
    finally:
        if own_runner:
            runner.close()


def stderr_note(line: str) -> None:
    """A ``pbstk: note:`` line on stderr (what the weights preflight says while it stages, say)."""
    sys.stderr.write(f"pbstk: note: {line}\n")


def _dry_run(settings: LaunchSettings, use_api_key: bool, api_key: str | None) -> LaunchResult:
    """``launch --dry-run`` without a runner: render as the job would run, connecting nowhere."""
    rendered = render(settings, None)
    transport = rendered.profile.ssh_host or ""
    key = (api_key or new_api_key()) if use_api_key else None
    return LaunchResult(job_record(settings.request, rendered, transport, key), rendered)


def job_record(req: RenderRequest, rendered: RenderedJob, transport: str, key: str | None) -> JobRecord:
    """The job store's record of ``rendered`` (its job id is filled in once the scheduler gives one)."""
    return JobRecord(
        job_id="", scheduler=rendered.profile.scheduler, profile=rendered.profile.name, model=req.model,
        served_model_name=rendered.served_model_name, preset=rendered.preset.name, name=rendered.job_name,
        run_dir=rendered.run_dir, transport=transport, api_key=key,
        api_key_env=key_env_name(rendered.job_name) if key else None,
        spec=LaunchSpec(vllm_args=rendered.vllm_args, layout=rendered.preset.layout(),
                        tensor_parallel=rendered.preset.tensor_parallel,
                        data_parallel=rendered.preset.data_parallel,
                        pipeline_parallel=rendered.preset.pipeline_parallel,
                        gpus=rendered.preset.gpus, eager=rendered.preset.eager,
                        vllm_version=rendered.profile.vllm_version, ssh_host=transport or None,
                        vllm_cache_root=rendered.profile.vllm_cache_root, params_b=rendered.params_b,
                        venv=rendered.profile.venv, options=launch_options(req, rendered.profile.account)),
    )


def _refuse_active_name(store: JobStore, runner: Runner, name: str, transport: str) -> None:
    """Names are unique among active jobs; called under the launch lock, so parallel launches cannot all pass."""
    intents = store.intents()
    if transport:
        resolve_remote_intents(store, runner, [i for i in intents if i.transport == transport])
        intents = store.intents()
    if any(i.name == name and i.transport == transport for i in intents):
        raise UsageError(f"a job named {name!r} is already active (being submitted right now); "
                         f"wait for it or pass another --name")
    existing = [r for r in store.all() if r.name == name and not r.final_state and r.transport == transport]
    if not existing:
        return
    from pbs_toolkit.jobs.status import status

    # reuse this connection: a second one would mean a second MFA prompt on most sites
    live = [s for s in status(existing, store, runners={transport: runner}) if not s.state.final]
    if live:
        raise UsageError(
            f"a job named {name!r} is already active ({live[0].record.job_id}, "
            f"{live[0].state.value}); cancel it or pass another --name"
        )


def resolve_remote_intents(store: JobStore, runner: Runner, intents: list[Intent]) -> None:
    """Interrupted launches through this SSH host: adopt the ones whose run directory holds a job id."""
    for intent in intents:
        job_id = marker_job_id(runner, intent.run_dir)
        script = backend_class(intent.record.scheduler).script_name
        exists = runner.size(f"{intent.run_dir}/{script}") is not None
        gone = not job_id and nothing_submitted(intent, exists, runner.size(f"{intent.run_dir}/{SUBMITTING_MARKER}")
                                                is not None, runner.size(f"{intent.run_dir}/submit_rc") is not None)
        store.resolve_intent(intent, job_id, gone)


def _submit_and_record(store: JobStore, runner: Runner, scheduler: Scheduler, rendered: RenderedJob,
                       record: JobRecord, intent: int, key: str | None, *, begin_at: float | None = None,
                       after: str | None = None) -> None:
    """Write the run directory, submit, record the id (``submit_recorded``)."""
    submit_recorded(store, runner, scheduler, record, intent,
                    write=functools.partial(_write_run_dir, runner, rendered, key, record),
                    walltime_s=walltime_seconds(rendered.profile.walltime), begin_at=begin_at, after=after,
                    gpus=rendered.profile.gpus)


def submit_recorded(store: JobStore, runner: Runner, scheduler: Scheduler, record: JobRecord, intent: int, *,
                    write: Callable[[], None], walltime_s: int | None, begin_at: float | None = None,
                    after: str | None = None, recorded: Callable[[JobRecord], None] | None = None,
                    gpus: int = 0) -> str:
    """The one crash-safe submission, after ``store.add_intent(record)``: ``write`` the run directory, submit
    ``RUN_DIR/<script>`` under the wrapper that leaves ``RUN_DIR/job_id`` (signals held meanwhile), then record
    the id (``recorded``, default ``store.record_submitted``: it must retire the intent in the same transaction).
    If anything fails after the scheduler took the job, say which job it is and how to stop it (the run directory
    keeps the id: the next read of the store adopts the intent); if nothing was submitted, leave nothing behind."""
    run_dir = record.run_dir
    try:
        write()
        with defer_interrupts():
            # the backend's submit leaves the id in RUN_DIR/job_id itself (Scheduler.submit, schedulers/marker.py)
            record.job_id = scheduler.submit(runner, f"{run_dir}/{scheduler.script_name}", run_dir, record.name,
                                             walltime_s=walltime_s, begin_at=begin_at, after=after, gpus=gpus)
            if recorded is None:
                store.record_submitted(intent, record)
            else:
                recorded(record)
        return record.job_id
    except BaseException as exc:
        job_id = record.job_id or marker_job_id(runner, run_dir)
        if job_id:
            if isinstance(exc, PbstkError):
                raise type(exc)(f"{exc.message}; job {job_id} WAS submitted: {_how_to_stop(record, job_id)}",
                                details=exc.details) from None
            if record.job_id and isinstance(exc, (KeyboardInterrupt, SystemExit)):
                # a note for the CLI's boundary to print, not a line now: a caller that stops the job itself
                # (`pbstk run`) says so instead, and the user reads one account of what happened
                exc.add_note(f"pbstk: {job_id} was submitted and recorded before the signal; "
                             f"stop it with `pbstk cancel {job_id}`")
            else:
                how = _how_to_stop(record, job_id)
                sys.stderr.write(f"pbstk: job {job_id} WAS submitted but not recorded: {how}\n")
            raise
        # nothing was submitted (rejected, interrupted, ...): leave nothing behind
        try:
            runner.run(["rm", "-rf", "--", run_dir])
            store.drop_intent(intent)
        except PbstkError:
            pass  # the intent resolves itself: no run directory means nothing was submitted
        raise


def marker_job_id(runner: Runner, run_dir: str) -> str | None:
    """The id the submission wrapper left, when pbstk did not get to read the scheduler's answer itself."""
    try:
        text = runner.read_bytes(f"{run_dir}/{JOB_ID_MARKER}").decode("utf-8", "replace").strip()
    except (OSError, PbstkError):
        return None
    return text if JOB_ID_RE.match(text) else None


def _how_to_stop(record: JobRecord, job_id: str) -> str:
    cancel = get_scheduler(record.scheduler).stop_hint(job_id, record.run_dir)
    where = f" on {record.transport}" if record.transport else ""
    return (f"`pbstk jobs` adopts it from {record.run_dir}/{JOB_ID_MARKER} once the store works again, "
            f"then `pbstk cancel {job_id}` stops it; or now: `{cancel}`{where}")


@run_dir_errors  # a bad runs root is one clear line, before anything is submitted
def _write_run_dir(runner: Runner, rendered: RenderedJob, key: str | None, record: JobRecord) -> None:
    runner.makedirs(rendered.run_dir, 0o755)
    if not record.transport:  # what a lost job store is rebuilt from (JobStore._readopt_from_run_dirs)
        log_run_dir(paths.user_state_dir(), rendered.run_dir)
    public = {k: v for k, v in record.public().items() if k not in ("job_id", "final_state")}
    runner.write_bytes(f"{rendered.run_dir}/{RECORD_MARKER}", json.dumps(public, indent=2).encode() + b"\n", 0o644)
    runner.write_bytes(f"{rendered.run_dir}/{rendered.script_name}", rendered.job_script.encode(), 0o755)
    runner.write_bytes(f"{rendered.run_dir}/start_vllm.sh", rendered.start_script.encode(), 0o755)
    runner.write_bytes(f"{rendered.run_dir}/render.json",
                       json.dumps(rendered.summary(), indent=2).encode() + b"\n", 0o644)
    if key:
        runner.write_bytes(f"{rendered.run_dir}/api_key", key.encode(), 0o600)


def cancel(record: JobRecord, *, runner: Runner | None = None) -> bool:
    """Stop the job. ``True`` if it was stopped now, ``False`` if it had already ended.

    A job already recorded final is not touched when its backend says that is unsafe (``cancel_when_final``)."""
    if record.final_state and not backend_class(record.scheduler).cancel_when_final:
        return False
    own = runner is None
    runner = runner or open_runner(record.transport or None)
    try:
        stopped = get_scheduler(record.scheduler).cancel(runner, JobRef(record.job_id, record.run_dir))
        request_stop(runner, record.run_dir)  # nodes started over ssh are not the scheduler's to stop
        return stopped
    finally:
        if own:
            runner.close()
