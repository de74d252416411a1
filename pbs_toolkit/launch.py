"""The one sequence with side effects: render -> write the run directory -> submit -> record.

Also ``cancel``. Everything here goes through a ``Runner``, so it works the same locally and over SSH.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobstore import JobRecord, JobStore
from pbs_toolkit.render import RenderedJob, RenderRequest, render, run_dir_errors
from pbs_toolkit.schedulers import JobRef, get_scheduler
from pbs_toolkit.transports import Runner, open_runner

DEFAULT_KEY_ENV = "PBSTK_API_KEY"


@dataclass
class LaunchResult:
    record: JobRecord
    rendered: RenderedJob


def key_env_name(alias: str) -> str:
    """The environment variable registries name for this job's key: ``PBSTK_KEY_<ALIAS>``."""
    import re

    return "PBSTK_KEY_" + re.sub(r"[^A-Z0-9]+", "_", alias.upper()).strip("_")


@contextmanager
def _defer_interrupts() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, so a job is never submitted without being recorded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


def launch(
    req: RenderRequest,
    *,
    store: JobStore | None = None,
    runner: Runner | None = None,
    api_key: str | None = None,
    use_api_key: bool = True,
    dry_run: bool = False,
    accept_unknown_host: bool = False,
) -> LaunchResult:
    """Render, write, submit and record one job. With ``dry_run`` only render (nothing is written)."""
    store = store or JobStore()
    own_runner = runner is None
    if runner is None:
        from pbs_toolkit.render import resolve_profile

        profile, _, _ = resolve_profile(req)
        runner = open_runner(profile.ssh_host, accept_unknown_host=accept_unknown_host)
    try:
        rendered = render(req, runner)
        transport = "" if runner.name == "local" else runner.name.split(":", 1)[-1]
        existing = [r for r in store.all() if r.name == rendered.job_name and not r.final_state
                    and r.transport == transport]
        if existing and not dry_run:
            from pbs_toolkit.status import status

            # reuse this connection: a second one would mean a second MFA prompt on most sites
            live = [s for s in status(existing, store, runners={transport: runner}) if not s.state.final]
            if live:
                raise UsageError(
                    f"a job named {rendered.job_name!r} is already active ({live[0].record.job_id}, "
                    f"{live[0].state.value}); cancel it or pass another --name"
                )
        key = None
        if use_api_key:
            key = api_key or secrets.token_urlsafe(32)
        record = JobRecord(
            job_id="", scheduler=rendered.profile.scheduler, profile=rendered.profile.name, model=req.model,
            served_model_name=rendered.served_model_name, preset=rendered.preset.name, name=rendered.job_name,
            run_dir=rendered.run_dir, transport=transport, api_key=key,
            api_key_env=key_env_name(rendered.job_name) if key else None,
            extra={"vllm_args": rendered.vllm_args, "layout": rendered.preset.layout(),
                   "tensor_parallel": rendered.preset.tensor_parallel,
                   "data_parallel": rendered.preset.data_parallel,
                   "pipeline_parallel": rendered.preset.pipeline_parallel,
                   "gpus": rendered.preset.gpus, "eager": rendered.preset.eager,
                   "vllm_version": rendered.profile.vllm_version, "ssh_host": transport or None,
                   "vllm_cache_root": rendered.profile.vllm_cache_root, "params_b": rendered.params_b,
                   "venv": rendered.profile.venv},
        )
        if dry_run:
            return LaunchResult(record, rendered)
        scheduler = get_scheduler(rendered.profile.scheduler)
        try:
            _write_run_dir(runner, rendered, key)
            with _defer_interrupts():
                record.job_id = scheduler.submit(runner, f"{rendered.run_dir}/job.pbs", rendered.run_dir,
                                                 rendered.job_name)
                store.add(record)
        except BaseException:
            if not record.job_id:  # nothing was submitted: leave nothing behind (rejected, interrupted, ...)
                runner.run(["rm", "-rf", "--", rendered.run_dir])
            raise
        return LaunchResult(record, rendered)
    finally:
        if own_runner:
            runner.close()


@run_dir_errors  # a bad runs root is one clear line, before anything is submitted
def _write_run_dir(runner: Runner, rendered: RenderedJob, key: str | None) -> None:
    runner.makedirs(rendered.run_dir, 0o755)
    runner.write_bytes(f"{rendered.run_dir}/job.pbs", rendered.job_script.encode(), 0o755)
    runner.write_bytes(f"{rendered.run_dir}/start_vllm.sh", rendered.start_script.encode(), 0o755)
    runner.write_bytes(f"{rendered.run_dir}/render.json",
                       json.dumps(rendered.summary(), indent=2).encode() + b"\n", 0o644)
    if key:
        runner.write_bytes(f"{rendered.run_dir}/api_key", key.encode(), 0o600)


def cancel(record: JobRecord, *, runner: Runner | None = None) -> bool:
    """Stop the job. ``True`` if it was stopped now, ``False`` if it had already ended."""
    own = runner is None
    runner = runner or open_runner(record.transport or None)
    try:
        return get_scheduler(record.scheduler).cancel(runner, JobRef(record.job_id, record.run_dir))
    finally:
        if own:
            runner.close()
