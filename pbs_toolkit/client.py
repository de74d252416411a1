"""``Client``: the Python API, one object that owns what every call needs (``scoped.launched``: one job for a block).

The CLI and the library functions take a job store and runners by hand; a notebook should not. A ``Client``
holds the job store and one runner per transport (``""`` for this machine, else the SSH host), opened on first
use and reused by every later call, so one SSH connection (one MFA prompt) serves a whole session. Results are
dataclasses. Every method is a thin composition of the functions the CLI commands already use.

    with Client() as c:
        job = c.launch("Qwen/Qwen3-VL-2B-Instruct", preset="single", profile="local-gpu")
        c.wait(job, timeout=600)
        ep = c.endpoint(job)   # base_url, api_key, model
        c.cancel(job)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import ServerFailed, UsageError
from pbs_toolkit.perf.api import PerfMethods
from pbs_toolkit.perf.observe import BenchResult, Diagnosis, Metrics
from pbs_toolkit.results import Cancellation, Endpoint, Job
from pbs_toolkit.services.api import ServiceMethods, held_replicas

if TYPE_CHECKING:
    from pbs_toolkit.campaigns.usage import UsageReport
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.clean import CleanReport
    from pbs_toolkit.jobs.launch import LaunchResult
    from pbs_toolkit.jobs.render import RenderedJob, RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import Intent, JobRecord, JobStore
    from pbs_toolkit.settings.launch_settings import LaunchSettings
    from pbs_toolkit.settings.layout import NodePlan
    from pbs_toolkit.settings.presets import Preset
    from pbs_toolkit.transports import Runner
    from pbs_toolkit.transports.tunnel import Tunnel
    from pbs_toolkit.weights.stage import StageReport

__all__ = ["BenchResult", "Cancellation", "Client", "Diagnosis", "Endpoint", "Job", "Metrics", "launched", "serve"]

_log = logging.getLogger("pbs_toolkit")

#: a runner factory: the transport ("" = this machine, else an SSH host) -> an open runner
RunnerFactory = Callable[[str], "Runner"]
#: called with each status change while waiting, and the seconds waited so far
Progress = Callable[["JobStatus", float], None]
#: ``launch``'s parameters that are not ``RenderRequest`` options
_NOT_REQUEST_FIELDS = frozenset({"self", "model", "preset", "profile", "api_key", "use_api_key"})


def _print_removal(removal: Removal) -> None:
    """The default ``on_removal``: one line on stderr. The registry code is imported when a removal happens, not
    by every ``Client()``: ``pbstk logs`` never touches a registry and must start fast."""
    from pbs_toolkit.endpoints.retire import print_removal

    print_removal(removal)


class Client(ServiceMethods, PerfMethods):
    """The job store plus one runner per transport, and every operation on jobs (services: services/api.py,
    performance: perf/api.py, methods this class inherits).

    ``store``: a ``JobStore`` (default: the user's). ``profile``: the default site profile for ``launch``.
    ``runner_factory``: how a transport's runner is opened (default ``open_runner``); called at most once per
    transport while the client is open. ``on_removal``: hears each registry entry taken out (or left, or not
    removable) when a job ends or is cancelled (default: one line on stderr). Use it as a context manager, or
    call ``close()``.
    """

    def __init__(self, store: JobStore | None = None, profile: str | None = None, *,
                 accept_new_host_key: bool = False, runner_factory: RunnerFactory | None = None,
                 on_removal: Callable[[Removal], None] | None = None) -> None:
        from pbs_toolkit.jobs.store import JobStore

        self.store = store or JobStore()
        self.profile = profile
        self.accept_new_host_key = accept_new_host_key
        self._factory = runner_factory or self._open_runner
        self.on_removal = on_removal or _print_removal
        self._runners: dict[str, Runner] = {}
        #: tunnels this client opened (``tunnel``, ``update_endpoint(via_tunnel=True)``); closed by ``close()``
        self.tunnels: list[Tunnel] = []

    # -- lifecycle ------------------------------------------------------------------------------------------

    def _open_runner(self, transport: str) -> Runner:
        from pbs_toolkit.transports import open_runner

        return open_runner(transport or None, accept_unknown_host=self.accept_new_host_key)

    def runner(self, transport: str = "") -> Runner:
        """The one runner for ``transport`` ("" = this machine), opened on first use."""
        if transport not in self._runners:
            self._runners[transport] = self._factory(transport)
        return self._runners[transport]

    def close(self) -> None:
        """Close every tunnel, then every runner (SSH connections); the client opens new ones if used again."""
        tunnels, self.tunnels = self.tunnels, []
        for tunnel in tunnels:
            tunnel.close()
        runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            runner.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs -----------------------------------------------------------------------------------------------

    def record(self, job: Job | JobRecord | str | None) -> JobRecord:
        """The store's record for a Job, a JobRecord, an id, an id prefix or a name (``None``: the newest)."""
        from pbs_toolkit.jobs.store import JobRecord

        if isinstance(job, Job):
            job = job.job_id
        if isinstance(job, JobRecord):
            job = job.job_id
        if job is not None and "/" in job:  # a run directory (``render -o DIR``, submitted by hand)
            from pbs_toolkit.jobs.handmade import record_for_run_dir

            found = record_for_run_dir(self.store, job, self.runner(""))
            if found is not None:
                return found
        return self.store.find(job)

    def adopt(self, job_id: str, run_dir: str, ssh_host: str | None = None) -> JobRecord:
        """Record job ``job_id``, submitted by hand from ``run_dir`` (``render -o DIR``), read on this machine or
        through ``ssh_host`` (``pbstk adopt``)."""
        from pbs_toolkit.jobs.handmade import adopt

        return adopt(self.store, job_id, run_dir, self.runner(ssh_host or ""), ssh_host or "")

    def request(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None,
                **options: Any) -> RenderRequest:
        """The ``RenderRequest`` for ``model`` (``options``: any RenderRequest field, e.g. ``name``, ``port``).

        A ``RenderRequest`` passes through as it is (the CLI builds one from its flags); ``preset``, ``profile``
        and ``options`` must then be left out."""
        from pbs_toolkit.jobs.render import RenderRequest

        if isinstance(model, RenderRequest):
            if preset is not None or profile is not None or options:
                raise UsageError("pass either a RenderRequest or a model with options, not both")
            return model
        try:
            return RenderRequest(model=model, preset=preset, profile=profile or self.profile, **options)
        except TypeError as exc:  # an unknown option: one clear error rather than a TypeError deep inside
            raise UsageError(f"launch: {exc}") from None

    def render(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None, *,
               connect: bool = True, **options: Any) -> RenderedJob:
        """Render without writing or submitting anything (``pbstk render``). ``connect=False``: do not open the
        profile's SSH connection (paths and the model are then resolved as on this machine)."""
        from pbs_toolkit.jobs.render import render
        from pbs_toolkit.settings.launch_settings import resolve_launch_settings

        settings = resolve_launch_settings(self.request(model, preset, profile, **options))
        return render(settings, self._request_runner(settings) if connect else None)

    def plan_layout(self, model: str, preset: str | None = None, profile: str | None = None,
                    **options: Any) -> tuple[Preset, NodePlan, float | None]:
        """(concrete preset, node plan, model size in billions) a render would use; offline, no account needed
        (``pbstk presets show NAME --model M``)."""
        from pbs_toolkit.jobs.plan import plan_layout

        return plan_layout(self.request(model, preset, profile, **options))

    def _request_runner(self, settings: LaunchSettings) -> Runner:
        """The runner of the transport ``settings``' profile submits through; a profile that cannot launch
        (account missing, placeholder unfilled) is refused first, before any SSH login."""
        return self.runner(settings.launchable().ssh_host or "")

    def launch(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None, *,
               name: str | None = None, served_model_name: str | None = None, port: int | str | None = None,
               queue: str | None = None, account: str | None = None, walltime: str | None = None,
               nodes: int | None = None, gpus_per_node: int | None = None, venv: str | None = None,
               runs_root: str | None = None, vllm_version: str | None = None, hf_home: str | None = None,
               vllm_cache_root: str | None = None, scheduler: str | None = None, ssh_host: str | None = None,
               eager: bool | None = None, vllm_args: list[str] | None = None, env: dict[str, str] | None = None,
               run_dir: str | None = None, idle_cancel: str | None = None, lease_s: int | None = None,
               text_only: bool | None = None, api_key: str | None = None, use_api_key: bool = True) -> Job:
        """Render, submit and record a server job for ``model``; returns at once (``wait`` waits). The keywords
        before ``api_key`` are ``RenderRequest``'s fields (``None``: from the profile, preset or user config);
        a misspelt one is a ``TypeError``. ``lease_s``: the job ends itself once ``RUN_DIR/lease`` has not been
        rewritten for that long (what ``pbstk run`` does; campaigns/lease.py ``Renewal``); default none."""
        options = {k: v for k, v in locals().items() if v is not None and k not in _NOT_REQUEST_FIELDS}
        result = self.launch_request(self.request(model, preset, profile, **options), api_key=api_key,
                                     use_api_key=use_api_key)
        return Job.from_record(result.record, result.rendered.notes)

    def launch_request(self, req: RenderRequest | LaunchSettings, *, api_key: str | None = None,
                       use_api_key: bool = True, dry_run: bool = False, begin_at: float | None = None,
                       after: str | None = None, stage: bool = False) -> LaunchResult:
        """``launch`` with everything it rendered (scripts, preset, notes); ``dry_run`` writes and submits
        nothing, and connects nowhere (a remote ``~`` stays for the remote shell: ``"$HOME"/...``).
        ``begin_at`` (epoch seconds) / ``after`` (a job id that must start first): when the job may start.
        ``stage``: stage a Hub model an offline profile's nodes lack first (weights/preflight.py)."""
        from pbs_toolkit.jobs.launch import launch
        from pbs_toolkit.settings.launch_settings import settings_of

        settings = settings_of(req)
        runner = None if dry_run else self._request_runner(settings)
        return launch(settings, store=self.store, runner=runner, api_key=api_key, use_api_key=use_api_key,
                      dry_run=dry_run, begin_at=begin_at, after=after, stage=stage)

    def stage(self, req: RenderRequest, *, revision: str = "main", verify_only: bool = False) -> StageReport:
        """Download and verify Hub model ``req.model`` into its profile's ``hf_home`` on the login node."""
        from pbs_toolkit.weights.stage import stage_request

        return stage_request(req, self.runner, revision=revision, verify_only=verify_only)

    def wait(self, job: Job | JobRecord | str | None, timeout: float = 3600.0,
             on_progress: Callable[[JobStatus, float], None] | None = None) -> JobStatus:
        """Block until the job's server is READY (``ServerFailed`` with the cause, ``WaitTimeout``)."""
        from pbs_toolkit.endpoints.retire import retire_ended
        from pbs_toolkit.jobs.readiness import wait_until_ready

        record = self.record(job)
        try:
            return wait_until_ready(record, timeout=timeout, store=self.store, runner=self.runner(record.transport),
                                    on_progress=on_progress)
        except ServerFailed:
            ended = [r for r in self.store.all() if (r.job_id, r.transport) == (record.job_id, record.transport)]
            retire_ended(self.store, [r for r in ended if r.final_state], self.on_removal)
            raise

    def status(self, *jobs: Job | JobRecord | str, all: bool = False) -> list[JobStatus]:  # noqa: A002
        """Status of ``jobs`` (default: every job not ended; ``all``: every job). One scheduler query each."""
        return self._status_of([self.record(j) for j in jobs] if jobs else self._records(all))

    def _status_of(self, records: list[JobRecord]) -> list[JobStatus]:
        """``status`` of ``records`` (jobs/status.py ``status_of``: an unreachable login node's jobs UNKNOWN);
        the jobs seen ended take their registry entries with them."""
        from pbs_toolkit.endpoints.retire import retire_ended
        from pbs_toolkit.jobs.status import status_of

        return status_of(records, self.store, self.runner, self._runners,
                         lambda ended: retire_ended(self.store, ended, self.on_removal))

    def jobs(self, all: bool = False) -> list[Job]:  # noqa: A002
        """Jobs pbstk launched, newest first (default: those not recorded as ended). No scheduler query."""
        return [Job.from_record(r) for r in self._records(all)]

    def records(self, all: bool = False) -> list[JobRecord]:  # noqa: A002
        """``jobs`` as the store's records (creation time, recorded end, run-time bookkeeping)."""
        return self._records(all)

    def unrecorded_launches(self) -> list[Intent]:
        """Launches whose job id is not recorded yet (being submitted, or interrupted): a submitted job must
        never go unmentioned, so ``pbstk jobs`` names each."""
        return self.store.intents()

    def clean(self, older_than: float = 7 * 86400.0, *, dry_run: bool = False) -> CleanReport:
        """Remove the run directories and records of jobs that ended at least ``older_than`` seconds ago
        (``pbstk clean``; see ``jobs.clean`` for what makes a directory safe to delete). Jobs not recorded as
        ended get one status query first; one whose scheduler or login node does not answer is left alone. What
        ``usage`` reports of the removed jobs stays (their final accounting is read first, kept in the ledger)."""
        from pbs_toolkit.campaigns.usage import keep_final_accounting
        from pbs_toolkit.jobs.clean import clean

        return clean(self.store, self.runner, self._status_of, older_than, dry_run,
                     keep_usage=lambda records: keep_final_accounting(self, records),
                     held=lambda: held_replicas(self.store))

    def _records(self, show_all: bool) -> list[JobRecord]:
        return [r for r in self.store.all() if show_all or not r.final_state]

    def cancel(self, job: Job | JobRecord | str, *, keep_endpoint: bool = False) -> bool:
        """Stop the job; ``True`` if stopped now, ``False`` if it had already ended. A job over several nodes also
        gets ``RUN_DIR/stop``, which every node's start script obeys. The registry entries it wrote are removed
        (``on_removal`` hears each; a registry that cannot be written never fails the cancel), or with
        ``keep_endpoint`` kept for good."""
        from pbs_toolkit.campaigns.counters import record_counters
        from pbs_toolkit.jobs.launch import cancel

        record = self.record(job)
        record_counters(self.store, self.runner(record.transport), record)  # `pbstk usage` after it has gone
        stopped = cancel(record, runner=self.runner(record.transport))
        if keep_endpoint:
            self.store.keep_registry_entries(record)
        else:
            self.retire_endpoints(record)
        return stopped

    def usage(self, *refs: str, since: float | None = None) -> UsageReport:
        """``pbstk usage``: node- and GPU-hours, requests and tokens per job and service (campaigns/usage.py)."""
        from pbs_toolkit.campaigns.usage import collect

        return collect(self, refs, since)

    def logs(self, job: Job | JobRecord | str | None = None, lines: int = 50, follow: bool = False, *,
             stream: str = "vllm", final_every: float = 5.0,
             notice: Callable[[str], None] | None = None, node: int | None = None,
             model: int | None = None) -> Iterator[str]:
        """The job's log lines (without newlines): the last ``lines``; with ``follow``, then new ones until the
        job ends (its status is asked at most every ``final_every`` s). Closing the iterator stops following.
        ``notice`` hears what happens to the file while following (rotated, truncated, ...). ``node``: that
        node's vLLM log on a job over several nodes (0, the head's, is the default ``vllm`` stream). ``model``:
        the vLLM log of the model at that place of a multi-model job (0: the job's own)."""
        from pbs_toolkit.jobs.logs import follow_job_log, last_lines

        record, path = self._log_path(job, lines, stream, node, model)
        if follow:
            return follow_job_log(lambda: self.runner(record.transport), path, lines, final_every,
                                  notice or _info, lambda: self._is_final(record))
        return last_lines(self.runner(record.transport), path, lines, f"job {record.job_id}")

    def log_text(self, job: Job | JobRecord | str | None = None, lines: int = 50, *,
                 stream: str = "vllm", node: int | None = None, model: int | None = None) -> Iterator[str]:
        """The last ``lines`` lines exactly as the file holds them (line ends kept, in pieces: ``lines=10**6``
        never holds a second full copy of the text); ``node``, ``model``: as for ``logs``."""
        from pbs_toolkit.jobs.logs import check_log_request
        from pbs_toolkit.jobs.nodes import job_log_text

        check_log_request(lines, stream, node, model)
        record = self.record(job)
        return job_log_text(record, lambda: self.runner(record.transport), lines, stream, node, model)

    def _log_path(self, job: Job | JobRecord | str | None, lines: int, stream: str,
                  node: int | None = None, model: int | None = None) -> tuple[JobRecord, str]:
        from pbs_toolkit.jobs.logs import check_log_request
        from pbs_toolkit.jobs.nodes import job_log_path

        check_log_request(lines, stream, node, model)
        record = self.record(job)
        return record, job_log_path(lambda: self.runner(record.transport), record.run_dir, record.scheduler,
                                    record.job_id, stream, node, model)

    def _is_final(self, record: JobRecord) -> bool:
        from pbs_toolkit.jobs.status import status

        return status([record], self.store, runners=self._runners)[0].state.final

    # -- endpoints ------------------------------------------------------------------------------------------

    def ready_status(self, job: Job | JobRecord | str | None, *, wait: bool = False, timeout: float = 3600.0,
                     on_progress: Progress | None = None, hint: str = "`Client.wait` waits for it") -> JobStatus:
        """The job's status, which must be READY: its server answered ``/v1/models`` as this job's own.

        ``wait``: wait up to ``timeout`` s for it instead (``wait``); else a job not READY is ``ServerFailed``,
        its message ending in ``hint`` (how to wait, in the caller's words)."""
        from pbs_toolkit.jobs.readiness import require_ready

        if wait:
            return self.wait(job, timeout, on_progress)
        return require_ready(self.status(self.record(job))[0], hint)

    def endpoint(self, job: Job | JobRecord | str | None = None, local_url: str | None = None, *,
                 timeout: float = 0.0, on_progress: Progress | None = None,
                 hint: str = "`Client.wait` waits for it") -> Endpoint:
        """base URL, API key and served model of a READY, identity-verified job (else ``ServerFailed``), and
        the variables ``env`` exports. ``local_url``: a tunnel's base URL instead of the node's; ``timeout``
        > 0 waits that long for readiness first."""
        from pbs_toolkit.endpoints import endpoint_url, env_values

        st = self.ready_status(job, wait=timeout > 0, timeout=timeout, on_progress=on_progress, hint=hint)
        return Endpoint(base_url=endpoint_url(st, local_url), api_key=st.record.api_key,
                        model=st.record.served_model_name, job_id=st.record.job_id, env=env_values(st, local_url))

    def env(self, job: Job | JobRecord | str | None = None, local_url: str | None = None, *,
            timeout: float = 0.0, on_progress: Progress | None = None,
            hint: str = "`Client.wait` waits for it") -> list[str]:
        """``export`` lines (OPENAI_BASE_URL, OPENAI_API_KEY, the registry's key variable) for a READY job;
        ``timeout`` > 0 waits that long for it first."""
        from pbs_toolkit.endpoints import env_exports

        st = self.ready_status(job, wait=timeout > 0, timeout=timeout, on_progress=on_progress, hint=hint)
        return env_exports(st, local_url)

    def tunnel(self, job: Job | JobRecord | JobStatus | str | None = None, local_port: int = 0, *,
               timeout: float = 3600.0, on_progress: Progress | None = None) -> tuple[JobStatus, Tunnel]:
        """Wait until the job is ready (a ``JobStatus`` is taken as ready), then forward ``local_port`` on this
        machine (0: any free one) to its server through the job's runner (the same SSH connection)."""
        from pbs_toolkit.jobs.status import JobStatus
        from pbs_toolkit.transports.tunnel import start_tunnel

        st = job if isinstance(job, JobStatus) else self.wait(job, timeout, on_progress)
        assert st.address and st.port
        tunnel = start_tunnel(self.runner(st.record.transport), st.address, st.port, local_port=local_port)
        self.tunnels.append(tunnel)
        return st, tunnel

    def update_endpoint(self, job: Job | JobRecord | str | None = None, registry: str | None = None, *,
                        fmt: str = "auto", alias: str | None = None, timeout: float = 3600.0,
                        follow_symlink: bool = False, force_format: bool = False, via_tunnel: bool = False,
                        local_port: int = 0, on_progress: Progress | None = None,
                        keep_after_end: bool = False) -> EndpointUpdate:
        """Wait until the job is ready, then write its endpoint into ``registry`` (checked before waiting, not
        an hour later). ``via_tunnel``: register a tunnel's local URL instead (the tunnel is the last of
        ``tunnels`` and stays open until ``close()``; the entry goes when it closes). The entry is recorded with
        the job and removed when it ends or is cancelled, unless ``keep_after_end``."""
        from pbs_toolkit.endpoints.register import register

        return register(self.store, lambda: self.record(job), lambda r: self.wait(r, timeout, on_progress), registry,
                        fmt=fmt, alias=alias, follow_symlink=follow_symlink, force_format=force_format,
                        keep_after_end=keep_after_end, notice=self.on_removal,
                        tunnel=(lambda st: self.tunnel(st, local_port)[1]) if via_tunnel else None)

    def remove_endpoint(self, alias: str, registry: str | None = None, *, fmt: str = "auto",
                        follow_symlink: bool = False, force_format: bool = False) -> bool:
        """Remove ``alias`` from ``registry`` (default: pbstk's own); ``True`` if it was there."""
        from pbs_toolkit.endpoints.register import remove_alias

        return remove_alias(self.store, alias, registry, fmt=fmt, follow_symlink=follow_symlink,
                            force_format=force_format)

    def remove_endpoints(self, ref: str, registry: str | None = None, *, fmt: str = "auto",
                         follow_symlink: bool = False, force_format: bool = False) -> list[Removal]:
        """``update-endpoint --remove REF``: the entry ``REF`` in ``registry`` (default: pbstk's own) if there is
        one, else every entry job ``REF`` wrote that still holds its URL (endpoints/register.py ``remove_ref``)."""
        from pbs_toolkit.endpoints.register import remove_ref

        return remove_ref(self.store, ref, registry, fmt=fmt, follow_symlink=follow_symlink, force_format=force_format)

    def retire_endpoints(self, job: Job | JobRecord | str, *, include_kept: bool = False) -> list[Removal]:
        """Remove the registry entries the job wrote that still hold its URL (``on_removal`` hears each)."""
        from pbs_toolkit.endpoints.retire import retire

        return retire(self.store, self.record(job), include_kept=include_kept, notice=self.on_removal)


def _info(message: str) -> None:
    """The default ``notice``/``progress``: a log line (the CLI passes its own)."""
    _log.info("%s", message)


@contextmanager
def launched(model: str, preset: str | None = None, profile: str | None = None, *, timeout: float = 3600.0,
             client: Client | None = None, **options: Any) -> Iterator[Endpoint]:
    """Launch ``model``, wait until it is ready, yield its ``Endpoint``; cancel the job on the way out, whatever
    ends the block (an exception, Ctrl-C, a failed or timed-out wait). ``client``: reuse one (else a fresh one,
    closed at the end); ``options``: ``Client.launch``'s keywords (a misspelt one is a ``TypeError``).
    ``pbs_toolkit.launched`` (scoped.py says why it is not called ``serve``)."""
    own = client is None
    c = client or Client()
    job: Job | None = None
    try:
        job = c.launch(model, preset, profile, **options)
        c.wait(job, timeout)
        yield c.endpoint(job)
    finally:
        try:
            if job is not None:
                c.cancel(job)
        finally:
            if own:
                c.close()


def serve(*args: Any, **kwargs: Any) -> Any:
    """Deprecated: :func:`launched` (``Client.serve`` is a different thing: a replica service)."""
    import warnings

    warnings.warn("pbs_toolkit.serve is now pbs_toolkit.launched (Client.serve and `pbstk serve` start a "
                  "service of replicas); the old name goes in the next release", DeprecationWarning, stacklevel=2)
    return launched(*args, **kwargs)
