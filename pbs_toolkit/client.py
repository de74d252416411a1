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
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import PbstkError, ServerFailed, UsageError
from pbs_toolkit.scoped import serve  # noqa: F401  (the deprecated name, kept for one release)

if TYPE_CHECKING:
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.clean import CleanReport
    from pbs_toolkit.jobs.launch import LaunchResult
    from pbs_toolkit.jobs.render import RenderedJob, RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import Intent, JobRecord, JobStore
    from pbs_toolkit.perf.benchjob import LevelResult
    from pbs_toolkit.perf.doctor import Finding
    from pbs_toolkit.perf.tune import TuneReport
    from pbs_toolkit.services.manage import ServiceStatus
    from pbs_toolkit.services.observe import ServiceDiagnosis, ServiceMetrics
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.settings.layout import NodePlan
    from pbs_toolkit.settings.presets import Preset
    from pbs_toolkit.transports import Runner
    from pbs_toolkit.transports.tunnel import Tunnel
    from pbs_toolkit.vllm.prom import MetricsSnapshot

__all__ = ["BenchResult", "Cancellation", "Client", "Diagnosis", "Endpoint", "Job", "Metrics"]

_log = logging.getLogger("pbs_toolkit")

#: a runner factory: the transport ("" = this machine, else an SSH host) -> an open runner
RunnerFactory = Callable[[str], "Runner"]
#: called with each status change while waiting, and the seconds waited so far
Progress = Callable[["JobStatus", float], None]
#: ``launch``'s parameters that are not ``RenderRequest`` options
_NOT_REQUEST_FIELDS = frozenset({"self", "model", "preset", "profile", "api_key", "use_api_key"})


@dataclass(frozen=True)
class Job:
    """A launched job, as the job store knows it (no secret in it: ``Client.endpoint`` gives the key)."""

    job_id: str
    name: str
    model: str
    served_model_name: str
    run_dir: str
    preset: str
    profile: str
    scheduler: str
    #: "" for this machine, else the SSH host it was submitted through
    transport: str = ""
    notes: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, record: JobRecord, notes: Sequence[str] = ()) -> Job:
        return cls(job_id=record.job_id, name=record.name, model=record.model,
                   served_model_name=record.served_model_name, run_dir=record.run_dir, preset=record.preset,
                   profile=record.profile, scheduler=record.scheduler, transport=record.transport,
                   notes=tuple(notes))

    def to_dict(self) -> dict[str, Any]:
        """A ``job`` object (docs/json.md): the record fields ``jobs --json`` prints, same names, plus ``notes``."""
        from dataclasses import asdict

        from pbs_toolkit.schema import stamp

        data = asdict(self)
        data["transport"] = self.transport or "local"
        data["notes"] = list(self.notes)
        return stamp("job", data)


@dataclass(frozen=True)
class Endpoint:
    """What an OpenAI-compatible client needs. ``repr`` hides the key so a notebook cell never prints it."""

    base_url: str
    api_key: str | None = field(repr=False)
    model: str
    job_id: str = ""
    #: the variables ``pbstk env`` exports (the key among them), by name
    env: dict[str, str] = field(default_factory=dict, repr=False)

    def to_dict(self, secrets: bool = False) -> dict[str, Any]:
        """An ``endpoint`` object (docs/json.md). The key and ``env`` only with ``secrets`` (``pbstk env --json``,
        whose whole point is to hand them out); otherwise ``has_api_key`` says whether there is one."""
        from pbs_toolkit.schema import stamp

        data: dict[str, Any] = {"job_id": self.job_id, "base_url": self.base_url, "model": self.model,
                                "has_api_key": self.api_key is not None}
        if secrets:
            data.update(api_key=self.api_key, env=dict(self.env))
        return stamp("endpoint", data)

    def exports(self) -> list[str]:
        """``env`` as shell ``export`` lines, each value quoted (``pbstk env``)."""
        import shlex

        return [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]


@dataclass(frozen=True)
class Metrics:
    """One look at a READY server: the second of two ``/metrics`` scrapes, rates between them, the summary."""

    job_id: str
    snapshot: MetricsSnapshot
    rates: dict[str, float | None]
    summary: dict[str, Any]
    #: the last ``Engine NNN: ...`` lines of the log, newest last (one-shot ``metrics`` only)
    engine_log: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A ``metrics`` object: the summary ``metrics --json`` and ``--export`` print, one per look."""
        from pbs_toolkit.schema import stamp

        return stamp("metrics", {"job_id": self.job_id, **self.summary})


@dataclass(frozen=True)
class Diagnosis:
    """``pbstk doctor``'s findings and the preset it recommends (``None``: no GPUs, the model's size unknown, or
    the recommended layout is the one running)."""

    job_id: str
    state: str
    findings: list[Finding]
    recommended_preset: str | None = None
    why: str | None = None
    launch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A ``diagnosis`` object (``doctor --json``)."""
        from pbs_toolkit.schema import stamp

        return stamp("diagnosis", {"job_id": self.job_id, "state": self.state,
                                   "findings": [f.to_dict() for f in self.findings],
                                   "recommended_preset": self.recommended_preset, "why": self.why,
                                   "launch": self.launch})


@dataclass(frozen=True)
class Cancellation:
    """What ``cancel`` did to one job: stopped now (``cancelled``), or it had already ended."""

    job_id: str
    name: str
    cancelled: bool

    @property
    def outcome(self) -> str:
        return "cancelled" if self.cancelled else "already ended"

    def to_dict(self) -> dict[str, Any]:
        """A ``cancellation`` object (``cancel --json`` prints a list of them)."""
        from pbs_toolkit.schema import stamp

        return stamp("cancellation", {"job_id": self.job_id, "name": self.name, "cancelled": self.cancelled,
                                      "outcome": self.outcome})


@dataclass(frozen=True)
class BenchResult:
    """One benchmark of a READY job: one ``LevelResult`` per concurrency (``vllm bench serve`` field names).

    ``to_dict`` is what ``pbstk bench --json`` prints; ``from_dict`` reads it (and the saved
    ``benchmarks/gpu/results/h200-bench-*.json``) back."""

    job_id: str
    preset: str
    results: list[LevelResult]

    def to_dict(self) -> dict[str, Any]:
        from pbs_toolkit.schema import stamp

        return stamp("bench_result", {"job_id": self.job_id, "preset": self.preset,
                                      "results": [r.to_dict() for r in self.results]})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        from pbs_toolkit.perf.benchjob import LevelResult

        return cls(str(data["job_id"]), str(data["preset"]), [LevelResult.from_dict(r) for r in data["results"]])


class Client:
    """The job store plus one runner per transport, and every operation on jobs.

    ``store``: a ``JobStore`` (default: the user's). ``profile``: the default site profile for ``launch``.
    ``runner_factory``: how a transport's runner is opened (default ``open_runner``); called at most once per
    transport while the client is open. ``on_removal``: hears each registry entry taken out (or left, or not
    removable) when a job ends or is cancelled (default: one line on stderr). Use it as a context manager, or
    call ``close()``.
    """

    def __init__(self, store: JobStore | None = None, profile: str | None = None, *,
                 accept_new_host_key: bool = False, runner_factory: RunnerFactory | None = None,
                 on_removal: Callable[[Removal], None] | None = None) -> None:
        from pbs_toolkit.endpoints.retire import print_removal
        from pbs_toolkit.jobs.store import JobStore

        self.store = store or JobStore()
        self.profile = profile
        self.accept_new_host_key = accept_new_host_key
        self._factory = runner_factory or self._open_runner
        self.on_removal = on_removal or print_removal
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

        req = self.request(model, preset, profile, **options)
        return render(req, self._request_runner(req) if connect else None)

    def plan_layout(self, model: str, preset: str | None = None, profile: str | None = None,
                    **options: Any) -> tuple[Preset, NodePlan, float | None]:
        """(concrete preset, node plan, model size in billions) a render would use; offline, no account needed
        (``pbstk presets show NAME --model M``)."""
        from pbs_toolkit.jobs.render import plan_layout

        return plan_layout(self.request(model, preset, profile, **options))

    def _request_runner(self, req: RenderRequest) -> Runner:
        """The runner of the transport ``req``'s profile submits through; a profile that cannot launch (account
        missing, placeholder unfilled) is refused first, before any SSH login."""
        from pbs_toolkit.jobs.render import checked_profile

        return self.runner(checked_profile(req).ssh_host or "")

    def launch(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None, *,
               name: str | None = None, served_model_name: str | None = None, port: int | str | None = None,
               queue: str | None = None, account: str | None = None, walltime: str | None = None,
               nodes: int | None = None, gpus_per_node: int | None = None, venv: str | None = None,
               runs_root: str | None = None, vllm_version: str | None = None, hf_home: str | None = None,
               vllm_cache_root: str | None = None, scheduler: str | None = None, ssh_host: str | None = None,
               eager: bool | None = None, vllm_args: list[str] | None = None, env: dict[str, str] | None = None,
               run_dir: str | None = None, idle_cancel: str | None = None, api_key: str | None = None,
               use_api_key: bool = True) -> Job:
        """Render, submit and record a server job for ``model``; returns at once (``wait`` waits). The keywords
        before ``api_key`` are ``RenderRequest``'s fields (``None``: from the profile, preset or user config);
        a misspelt one is a ``TypeError``."""
        options = {k: v for k, v in locals().items() if v is not None and k not in _NOT_REQUEST_FIELDS}
        result = self.launch_request(self.request(model, preset, profile, **options), api_key=api_key,
                                     use_api_key=use_api_key)
        return Job.from_record(result.record, result.rendered.notes)

    def launch_request(self, req: RenderRequest, *, api_key: str | None = None, use_api_key: bool = True,
                       dry_run: bool = False, begin_at: float | None = None,
                       after: str | None = None) -> LaunchResult:
        """``launch`` with everything it rendered (scripts, preset, notes); ``dry_run`` writes and submits
        nothing, and connects nowhere (a remote ``~`` stays for the remote shell: ``"$HOME"/...``).
        ``begin_at`` (epoch seconds) / ``after`` (a job id that must start first): when the job may start."""
        from pbs_toolkit.jobs.launch import launch

        runner = None if dry_run else self._request_runner(req)
        return launch(req, store=self.store, runner=runner, api_key=api_key, use_api_key=use_api_key,
                      dry_run=dry_run, begin_at=begin_at, after=after)

    def wait(self, job: Job | JobRecord | str | None, timeout: float = 3600.0,
             on_progress: Callable[[JobStatus, float], None] | None = None) -> JobStatus:
        """Block until the job's server is READY (``ServerFailed`` with the cause, ``WaitTimeout``)."""
        from pbs_toolkit.jobs.readiness import wait_until_ready

        record = self.record(job)
        try:
            return wait_until_ready(record, timeout=timeout, store=self.store, runner=self.runner(record.transport),
                                    on_progress=on_progress)
        except ServerFailed:
            ended = [r for r in self.store.all() if (r.job_id, r.transport) == (record.job_id, record.transport)]
            self._retire_ended([r for r in ended if r.final_state])
            raise

    def status(self, *jobs: Job | JobRecord | str, all: bool = False) -> list[JobStatus]:  # noqa: A002
        """Status of ``jobs`` (default: every job not ended; ``all``: every job). One scheduler query each."""
        return self._status_of([self.record(j) for j in jobs] if jobs else self._records(all))

    def _status_of(self, records: list[JobRecord]) -> list[JobStatus]:
        """``status`` of ``records``; a login node that cannot be reached leaves its jobs UNKNOWN with one warning
        line, unless nothing else would be shown (then its ``TransportError``, exit 4, as before)."""
        from pbs_toolkit.errors import TransportError
        from pbs_toolkit.jobs.status import status, unreachable_status, unreachable_warning

        unreachable: dict[str, TransportError] = {}
        for transport in sorted({r.transport for r in records if not r.final_state}):  # ended jobs need none
            try:
                self.runner(transport)
            except TransportError as exc:
                unreachable[transport] = exc
        asked = [r for r in records if r.final_state or r.transport not in unreachable]
        if unreachable and not asked:
            raise next(iter(unreachable.values()))
        answered = iter(status(asked, self.store, runners=self._runners))
        results = [next(answered) if r.final_state or r.transport not in unreachable else
                   unreachable_status(r, unreachable[r.transport]) for r in records]
        for transport, error in unreachable.items():
            count = sum(1 for r in records if r.transport == transport and not r.final_state)
            sys.stderr.write(f"pbstk: warning: {unreachable_warning(transport, error, count)}\n")
        # a job seen ended takes its registry entries with it (a log-only failure may still restart: not yet)
        self._retire_ended([s.record for s in results if s.state.final and s.confirmed])
        return results

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
        ended get one status query first; one whose scheduler or login node does not answer is left alone."""
        from pbs_toolkit import paths
        from pbs_toolkit.jobs.clean import CleanItem, CleanReport, clean_one, ended_at, held_by_services, select
        from pbs_toolkit.jobs.store import forget_run_dirs

        report = CleanReport(older_than, dry_run)
        pending = [r for r in self.store.all() if not r.final_state]
        for transport in sorted({r.transport for r in pending}):
            group = [r for r in pending if r.transport == transport]
            try:
                self._status_of(group)
            except PbstkError as exc:  # a refusing scheduler, an unreachable login node: its jobs stay
                report.warnings.append(f"could not ask about {len(group)} job(s) via {transport or 'this machine'}"
                                       f" ({exc.message}); they are left alone")
        now = time.time()
        old, report.active, report.recent = select(self.store.all(), older_than, now)
        old, report.items = held_by_services(self.store, old, now)
        removed_here: set[str] = set()
        roots: dict[tuple[str, str], Any] = {}
        for record in old:
            try:
                item = clean_one(self.runner(record.transport), record, dry_run, now, roots)
            except PbstkError as exc:  # the login node did not answer: nothing there is touched
                item = CleanItem(record.job_id, record.name, record.transport, record.final_state or "",
                                 record.run_dir, round(now - ended_at(record), 1), "skipped", exc.message)
            if item.action == "removed":
                self.store.remove(record)
                if not record.transport:
                    removed_here.add(record.run_dir)
            report.items.append(item)
        if removed_here:
            forget_run_dirs(paths.user_state_dir(), removed_here)
        return report

    def _records(self, show_all: bool) -> list[JobRecord]:
        return [r for r in self.store.all() if show_all or not r.final_state]

    def cancel(self, job: Job | JobRecord | str, *, keep_endpoint: bool = False) -> bool:
        """Stop the job; ``True`` if stopped now, ``False`` if it had already ended. A job over several nodes also
        gets ``RUN_DIR/stop``, which every node's start script obeys. The registry entries it wrote are removed
        (``on_removal`` hears each; a registry that cannot be written never fails the cancel), or with
        ``keep_endpoint`` kept for good."""
        from pbs_toolkit.jobs.launch import cancel

        record = self.record(job)
        stopped = cancel(record, runner=self.runner(record.transport))
        if keep_endpoint:
            self.store.keep_registry_entries(record)
        else:
            self.retire_endpoints(record)
        return stopped

    def logs(self, job: Job | JobRecord | str | None = None, lines: int = 50, follow: bool = False, *,
             stream: str = "vllm", final_every: float = 5.0,
             notice: Callable[[str], None] | None = None, node: int | None = None) -> Iterator[str]:
        """The job's log lines (without newlines): the last ``lines``; with ``follow``, then new ones until the
        job ends (its status is asked at most every ``final_every`` s). Closing the iterator stops following.
        ``notice`` hears what happens to the file while following (rotated, truncated, ...). ``node``: that
        node's vLLM log on a job over several nodes (0, the head's, is the default ``vllm`` stream)."""
        record, path = self._log_path(job, lines, stream, node)
        if follow:
            return self._follow(record.transport, path, lines, final_every, notice or (lambda m: _log.info("%s", m)),
                                lambda: self._is_final(record))
        return self._log_lines(record.transport, path, lines, f"job {record.job_id}")

    def _log_lines(self, transport: str, path: str, lines: int, owner: str) -> Iterator[str]:
        pieces = self._tail_pieces(transport, path, lines, owner)  # refuses a log that does not exist yet
        return iter("".join(pieces).splitlines() if lines else ())

    def log_text(self, job: Job | JobRecord | str | None = None, lines: int = 50, *,
                 stream: str = "vllm", node: int | None = None) -> Iterator[str]:
        """The last ``lines`` lines exactly as the file holds them (line ends kept, in pieces: ``lines=10**6``
        never holds a second full copy of the text)."""
        record, path = self._log_path(job, lines, stream, node)
        return self._tail_pieces(record.transport, path, lines, f"job {record.job_id}")

    def _log_path(self, job: Job | JobRecord | str | None, lines: int, stream: str,
                  node: int | None = None) -> tuple[JobRecord, str]:
        from pbs_toolkit.jobs.logs import stream_path
        from pbs_toolkit.jobs.nodes import node_log_path

        if lines < 0:
            raise UsageError("lines must not be negative")
        if node is not None and stream != "vllm":
            raise UsageError(f"--node picks one node's vLLM log; the {stream} stream is the job's, not a node's")
        record = self.record(job)
        if node is not None:
            return record, node_log_path(self.runner(record.transport), record.run_dir, record.job_id, node)
        return record, stream_path(record.run_dir, record.scheduler, stream)

    def _tail_pieces(self, transport: str, path: str, lines: int, owner: str) -> Iterator[str]:
        """The last ``lines`` of ``path`` on ``transport``'s machine; ``owner``: whose log, for the error."""
        from pbs_toolkit.jobs.logs import decoded_pieces, tail_blocks

        try:
            blocks, _ = tail_blocks(self.runner(transport), path, lines)
        except FileNotFoundError:
            raise UsageError(f"{path} does not exist yet ({owner} not started?)") from None
        return decoded_pieces(blocks)

    def _follow(self, transport: str, path: str, lines: int, final_every: float, notice: Callable[[str], None],
                is_final: Callable[[], bool]) -> Iterator[str]:
        """``logs.follow_lines`` until ``is_final``, a dropped connection named as such (the path it followed)."""
        from pbs_toolkit.errors import TransportError
        from pbs_toolkit.jobs.logs import follow_lines

        try:
            yield from follow_lines(self.runner(transport), path, lines, final_every, notice, is_final)
        except TransportError as exc:
            raise TransportError(f"lost the connection while following {path}: {exc}") from exc

    def _is_final(self, record: JobRecord) -> bool:
        from pbs_toolkit.jobs.status import status

        return status([record], self.store, runners=self._runners)[0].state.final

    # -- endpoints ------------------------------------------------------------------------------------------

    def ready_status(self, job: Job | JobRecord | str | None, *, wait: bool = False, timeout: float = 3600.0,
                     on_progress: Progress | None = None, hint: str = "`Client.wait` waits for it") -> JobStatus:
        """The job's status, which must be READY: its server answered ``/v1/models`` as this job's own.

        ``wait``: wait up to ``timeout`` s for it instead (``wait``); else a job not READY is ``ServerFailed``,
        its message ending in ``hint`` (how to wait, in the caller's words)."""
        if wait:
            return self.wait(job, timeout, on_progress)
        st = self.status(self.record(job))[0]
        if st.state.value != "READY":  # waiting helps only a job that has not ended
            advice = "it has ended: `pbstk launch` a new one" if st.state.final else hint
            raise ServerFailed(f"job {st.record.job_id} is {st.state.value}, not READY"
                               f"{': ' + st.reason if st.reason else ''} ({advice})")
        return st

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
        from pbs_toolkit.endpoints import check_registry, update_endpoint
        from pbs_toolkit.endpoints.retire import refuse_kept_tunnel, remember

        refuse_kept_tunnel(via_tunnel, keep_after_end)
        record = self.record(job)
        fmt = check_registry(record, registry, fmt, alias, follow_symlink=follow_symlink, force_format=force_format)
        st = self.wait(record, timeout, on_progress)
        tunnel = self.tunnel(st, local_port)[1] if via_tunnel else None
        result = update_endpoint(st, registry=registry, fmt=fmt, alias=alias, local_url=tunnel.url if tunnel else None,
                                 follow_symlink=follow_symlink, force_format=force_format)
        remember(self.store, record, result, keep=keep_after_end, tunnel=tunnel, notice=self.on_removal)
        return result

    def remove_endpoint(self, alias: str, registry: str | None = None, *, fmt: str = "auto",
                        follow_symlink: bool = False, force_format: bool = False) -> bool:
        """Remove ``alias`` from ``registry`` (default: pbstk's own); ``True`` if it was there."""
        from pbs_toolkit.endpoints.registry import check_target, remove_endpoint

        target, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
        removed = remove_endpoint(registry, alias, kind, follow_symlink=follow_symlink, force_format=force_format)
        self.store.forget_alias(str(target), alias)
        return removed

    def remove_endpoints(self, ref: str, registry: str | None = None, *, fmt: str = "auto",
                         follow_symlink: bool = False, force_format: bool = False) -> list[Removal]:
        """``update-endpoint --remove REF``: the entry ``REF`` in ``registry`` (default: pbstk's own) if there is
        one, else every entry job ``REF`` wrote (only into ``registry`` when it is given) that still holds its
        URL, kept ones too. Nothing to remove is one ``absent`` outcome, not an error."""
        from pbs_toolkit.endpoints.registry import check_target, read_endpoints, remove_endpoint
        from pbs_toolkit.endpoints.retire import ABSENT, REMOVED, Removal, retire
        from pbs_toolkit.errors import JobNotFound

        target, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
        current = read_endpoints(target, kind).get(ref)
        if current is not None:
            remove_endpoint(registry, ref, kind, follow_symlink=follow_symlink, force_format=force_format)
            self.store.forget_alias(str(target), ref)
            return [Removal(str(target), ref, REMOVED, current.url)]
        try:
            record = self.store.find(ref)
        except JobNotFound:
            return [Removal(str(target), ref, ABSENT)]
        entries = [e for e in self.store.registry_entries(record) if registry is None or e.registry == str(target)]
        return retire(self.store, record, include_kept=True, entries=entries) or [Removal(str(target), ref, ABSENT)]

    def retire_endpoints(self, job: Job | JobRecord | str, *, include_kept: bool = False) -> list[Removal]:
        """Remove the registry entries the job wrote that still hold its URL (``on_removal`` hears each)."""
        from pbs_toolkit.endpoints.retire import retire

        return retire(self.store, self.record(job), include_kept=include_kept, notice=self.on_removal)

    def _retire_ended(self, records: Sequence[JobRecord]) -> None:
        """Retire the entries of ``records`` (jobs seen ended): one store read, nothing when none wrote any."""
        from pbs_toolkit.endpoints.retire import retire

        if not records:
            return
        wrote: dict[tuple[str, str], list[Any]] = {}
        for entry in self.store.registry_entries():
            wrote.setdefault((entry.transport, entry.job_id), []).append(entry)
        for record in records:
            entries = wrote.get((record.transport, record.job_id))
            if entries:
                retire(self.store, record, entries=entries, notice=self.on_removal)

    # -- services (several replicas behind one router: services/, docs/services.md) ----------------------------

    def serve(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None, *,
              replicas: int = 1, name: str | None = None, keep_alive: bool = False, handover_s: float = 600.0,
              policy: str | None = None, nodes_per_replica: int | None = None, api_key: str | None = None,
              scale: Any = None, **options: Any) -> ServiceRecord:
        """Start a service: ``replicas`` jobs of ``model`` behind one vllm-router, one URL and one key, kept by
        a detached keeper; returns at once (``wait_service`` waits). ``scale``: a services/autoscale.py
        ``ScaleSpec`` (autoscaling instead of a fixed count). ``options``: as for ``launch``."""
        from pbs_toolkit.services.manage import ServeOptions, start

        req = self.request(model, preset, profile, **options)
        return start(self, req, ServeOptions(replicas=replicas, name=name, keep_alive=keep_alive,
                                             handover_s=handover_s, policy=policy, scale=scale,
                                             nodes_per_replica=nodes_per_replica, api_key=api_key))

    def services(self, all: bool = False) -> list[ServiceRecord]:  # noqa: A002
        """Services pbstk started, newest first (default: those not ended). No scheduler query."""
        from pbs_toolkit.services.record import all_services

        return all_services(self.store, include_ended=all)

    def service(self, ref: str | None) -> ServiceRecord | None:
        """The service ``ref`` names, when no job has that exact id or name (a job of that name wins)."""
        from pbs_toolkit.services.record import load

        if not ref:
            return None
        found = load(self.store, ref)
        if found is None or any(r.job_id == ref or r.name == ref for r in self.store.all()):
            return None
        return found

    def service_status(self, name: str | ServiceRecord) -> ServiceStatus:
        """The service's state (``READY 3/4 replicas``), each replica's status, whether keeper and router run."""
        from pbs_toolkit.services.manage import look
        from pbs_toolkit.services.record import find

        return look(self, find(self.store, name) if isinstance(name, str) else name)

    def service_statuses(self, services: Sequence[ServiceRecord], jobs: Sequence[JobRecord] = ()
                         ) -> tuple[list[ServiceStatus], list[JobStatus]]:
        """``service_status`` of each service and ``status`` of ``jobs`` from one scheduler query per transport:
        every active service's replica jobs join the jobs' batch (``status`` promises one query per call)."""
        from pbs_toolkit.errors import JobNotFound
        from pbs_toolkit.services.manage import look

        wanted = {r.job_id for r in jobs}
        extra: list[JobRecord] = []
        for rec in services:
            for job in [j for s in rec.slots for j in s.jobs()] if rec.ended is None else []:
                try:
                    record = self.record(job)
                except JobNotFound:
                    continue  # the job store lost it: the service shows it as missing, as look() does
                if record.job_id not in wanted:
                    wanted.add(record.job_id)
                    extra.append(record)
        statuses = self._status_of([*jobs, *extra]) if jobs or extra else []
        by_id = {st.record.job_id: st for st in statuses}
        return [look(self, rec, by_id) for rec in services], statuses[:len(jobs)]

    def wait_service(self, name: str | ServiceRecord, timeout: float = 3600.0,
                     on_progress: Callable[[ServiceStatus, float], None] | None = None) -> ServiceStatus:
        """Block until every replica is READY and routable: in the router, which serves a request with the key
        (``WaitTimeout``; ``ServerFailed`` when the service ended or every replica failed). services/ready.py."""
        from pbs_toolkit.services.ready import wait
        from pbs_toolkit.services.record import find

        return wait(self, find(self.store, name) if isinstance(name, str) else name, timeout, on_progress)

    def cancel_service(self, name: str | ServiceRecord, *, keep_endpoint: bool = False) -> list[Cancellation]:
        """Stop the keeper, every replica job (queued successors too) and the router; take the service's
        registry entries back unless ``keep_endpoint``. An ended service: nothing to stop (empty list)."""
        from pbs_toolkit.services.record import find
        from pbs_toolkit.services.stop import teardown

        rec = find(self.store, name) if isinstance(name, str) else name
        if not rec.active:  # a STOPPING one (an interrupted cancel) is finished now
            return []
        return [Cancellation(job_id, job_name, stopped)
                for job_id, job_name, stopped in teardown(self, rec, "CANCELLED", keep_endpoint=keep_endpoint)]

    def resume_service(self, name: str) -> int:
        """Start the service's keeper again (after a reboot, a kill); its pid. A running keeper is kept."""
        from pbs_toolkit.services.manage import keeper_alive, spawn_keeper
        from pbs_toolkit.services.record import find

        rec = find(self.store, name)
        if rec.ended is not None:
            hint = f"`pbstk cancel {name}` finishes stopping it" if rec.active else "start a new one with `pbstk serve`"
            raise UsageError(f"service {name} has ended ({rec.state}); {hint}")
        if keeper_alive(name):
            return 0
        return spawn_keeper(name)

    def service_endpoint(self, name: str | ServiceRecord, local_url: str | None = None) -> Endpoint:
        """The router's base URL (``local_url``: a tunnel's instead) and the service's key (``pbstk env NAME``)."""
        from pbs_toolkit.endpoints import endpoint_url, env_values
        from pbs_toolkit.services.manage import service_job_status
        from pbs_toolkit.services.record import find

        rec = find(self.store, name) if isinstance(name, str) else name
        if rec.ended is not None or not rec.router:
            raise ServerFailed(f"service {rec.name} is {rec.state}: no router to point at")
        st = service_job_status(rec)
        return Endpoint(base_url=endpoint_url(st, local_url), api_key=rec.api_key, model=rec.served_model_name,
                        job_id=rec.entry_id, env=env_values(st, local_url))

    def update_service_endpoint(self, name: str | ServiceRecord, registry: str | None = None, *,
                                fmt: str = "auto", alias: str | None = None, follow_symlink: bool = False,
                                force_format: bool = False, keep_after_end: bool = False, via_tunnel: bool = False,
                                local_port: int = 0) -> EndpointUpdate:
        """Register the router's URL under the service's name (the registry never changes across handovers);
        recorded as ``service:NAME`` and taken back by ``cancel_service``. ``via_tunnel``: as for a job."""
        from pbs_toolkit.endpoints import check_registry, update_endpoint
        from pbs_toolkit.endpoints.retire import refuse_kept_tunnel, remember
        from pbs_toolkit.services.manage import service_job_status
        from pbs_toolkit.services.record import find

        refuse_kept_tunnel(via_tunnel, keep_after_end)
        rec = find(self.store, name) if isinstance(name, str) else name
        if rec.ended is not None or not rec.router:
            raise ServerFailed(f"service {rec.name} is {rec.state}: no router to register")
        st = service_job_status(rec)
        fmt = check_registry(st.record, registry, fmt, alias, follow_symlink=follow_symlink,
                             force_format=force_format)
        tunnel = self.tunnel(st, local_port)[1] if via_tunnel else None
        result = update_endpoint(st, registry=registry, fmt=fmt, alias=alias, local_url=tunnel.url if tunnel else None,
                                 follow_symlink=follow_symlink, force_format=force_format)
        remember(self.store, st.record, result, keep=keep_after_end, tunnel=tunnel, notice=self.on_removal)
        return result

    # -- a service where a job would do: metrics, logs, doctor, bench (services/observe.py) --------------------

    def service_metrics(self, name: str | ServiceRecord | ServiceStatus, interval: float = 1.0) -> ServiceMetrics:
        """``metrics`` of every serving replica, their sum, and the router's own figures (``pbstk metrics NAME``)."""
        from pbs_toolkit.services.observe import metrics, serving_status

        return metrics(self, serving_status(self, name), interval)

    def watch_service_metrics(self, name: str | ServiceRecord | ServiceStatus, every: float = 5.0,
                              count: int = 0) -> Iterator[ServiceMetrics]:
        """``watch_metrics`` for a service: a look every ``every`` s, over the interval since the one before."""
        from pbs_toolkit.services.observe import serving_status, watch_metrics

        return watch_metrics(self, serving_status(self, name), every, count)

    def service_doctor(self, name: str | ServiceRecord, replica: int | None = None) -> ServiceDiagnosis:
        """Router and keeper findings, then ``doctor`` of each replica's job (``replica``: that one only)."""
        from pbs_toolkit.services.observe import doctor

        return doctor(self, self.service_status(name), replica)

    def service_bench(self, name: str | ServiceRecord | ServiceStatus, concurrencies: Sequence[int] = (1, 8, 64),
                      **options: Any) -> BenchResult:
        """``bench`` through the router's URL with the service's key (``options``: as for ``bench``)."""
        from pbs_toolkit.services.observe import bench_status, serving_status

        return self.bench(bench_status(serving_status(self, name)), concurrencies, **options)

    def service_log(self, name: str | ServiceRecord, lines: int = 50, follow: bool = False, *,
                    replica: int | None = None, pieces: bool = False, final_every: float = 5.0,
                    notice: Callable[[str], None] | None = None, **job_options: Any) -> Iterator[str]:
        """The router's log, or replica K's job log (``job_options``: stream, node), as ``logs``/``log_text``."""
        from pbs_toolkit.services.observe import log_lines
        from pbs_toolkit.services.record import find

        rec = find(self.store, name) if isinstance(name, str) else name
        return log_lines(self, rec, lines, follow, replica=replica, pieces=pieces, final_every=final_every,
                         notice=notice or (lambda m: _log.info("%s", m)), **job_options)

    # -- performance ----------------------------------------------------------------------------------------

    def metrics(self, job: Job | JobRecord | JobStatus | str | None = None, interval: float = 1.0) -> Metrics:
        """Two ``/metrics`` scrapes ``interval`` s apart: rates over the interval, latencies since start, and
        the last ``Engine`` lines of the log. A ``JobStatus`` is taken as READY (after ``wait``)."""
        from pbs_toolkit.perf.scrape import engine_history, scrape
        from pbs_toolkit.vllm.prom import rates, summarize

        st = self._ready(job)
        runner = self.runner(st.record.transport)
        prev = scrape(runner, st)
        time.sleep(interval)
        cur = scrape(runner, st)
        summary = summarize(None, cur)
        summary["rates"] = rates(prev, cur)
        summary["job_id"] = st.record.job_id
        engine_log = [e.to_dict() for e in engine_history(runner, st)[-10:]]
        summary["engine_log"] = engine_log
        return Metrics(job_id=st.record.job_id, snapshot=cur, rates=summary["rates"], summary=summary,
                       engine_log=engine_log)

    def watch_metrics(self, job: Job | JobRecord | JobStatus | str | None = None, every: float = 5.0,
                      count: int = 0) -> Iterator[Metrics]:
        """A scrape every ``every`` s, each with the rates and latencies since the scrape before it; ``count``
        looks (0: until the caller stops iterating). One scrape is taken first as the starting point."""
        from pbs_toolkit.perf.scrape import scrape
        from pbs_toolkit.vllm.prom import summarize

        st = self._ready(job)
        runner = self.runner(st.record.transport)
        prev = scrape(runner, st)
        looks = 0
        while not count or looks < count:
            time.sleep(every)
            cur = scrape(runner, st)
            looks += 1
            summary = summarize(prev, cur)
            summary["job_id"] = st.record.job_id
            yield Metrics(job_id=st.record.job_id, snapshot=cur, rates=summary.get("rates") or {}, summary=summary)
            prev = cur

    def _ready(self, job: Job | JobRecord | JobStatus | str | None) -> JobStatus:
        """``job``'s READY status; a ``JobStatus`` is taken as it is (the caller has just waited for it)."""
        from pbs_toolkit.jobs.status import JobStatus

        return job if isinstance(job, JobStatus) else self.ready_status(job)

    def doctor(self, job: Job | JobRecord | JobStatus | str | None = None) -> Diagnosis:
        """Findings from the job's flags, log and metrics, and the preset to use instead (a ``JobStatus``: as
        it is, no status query of its own)."""
        from pbs_toolkit.jobs.status import JobStatus
        from pbs_toolkit.perf.doctor import diagnose
        from pbs_toolkit.perf.recommend import recommend
        from pbs_toolkit.perf.scrape import doctor_context, scrape

        st = job if isinstance(job, JobStatus) else self.status(self.record(job))[0]
        runner = self.runner(st.record.transport)
        ctx = doctor_context(runner, st, scrape(runner, st) if st.state.value == "READY" else None)
        advice = recommend(st.record, ctx)
        return Diagnosis(st.record.job_id, st.state.value, diagnose(ctx), *(
            (advice.preset, advice.why, advice.launch) if advice else ()))

    def bench(self, job: Job | JobRecord | JobStatus | str | None = None, concurrencies: Sequence[int] = (1, 8, 64),
              *, input_len: int = 128, output_len: int = 256, num_prompts: int | None = None,
              client: str = "auto", notice: Callable[[str], None] | None = None) -> BenchResult:
        """Drive load against a READY job's endpoint, each concurrency in turn (``notice``: hears which load
        generator runs and why). A ``JobStatus`` is taken as READY (after ``wait``)."""
        from pbs_toolkit.perf.benchjob import benchmark_ready_job

        st = self._ready(job)
        results = benchmark_ready_job(st, list(concurrencies), input_len=input_len, output_len=output_len,
                                      num_prompts=num_prompts, client=client,
                                      notice=notice or (lambda m: _log.info("%s", m)),
                                      runner=self.runner(st.record.transport))
        return BenchResult(st.record.job_id, st.record.preset, results)

    def tune(self, model: str | RenderRequest, presets: Sequence[str], *, profile: str | None = None,
             concurrencies: Sequence[int] = (1, 8, 64), input_len: int = 128, output_len: int = 256,
             num_prompts: int | None = None, rounds: int = 4, client: str = "auto", timeout: float = 3600.0,
             baseline: str | None = None, progress: Callable[[str], None] | None = None,
             save: bool = False, output: str | None = None, append: bool = False,
             **options: Any) -> TuneReport:
        """Launch, wait, benchmark and cancel each preset in turn; the report (``tune.run_tune``), whose
        ``to_dict`` is the JSON ``pbstk tune`` saves.

        ``save``: save the document under pbstk's data dir; ``output``: save it there instead, after each preset
        too, so an interrupted tune keeps what it measured; ``append``: merge into the runs already in
        ``output``. ``progress`` hears each step, and ``saved PATH`` at the end."""
        from pbs_toolkit.perf.tune import load_result, merge, run_tune, save_result

        req = self.request(model, None, profile, **options)
        progress = progress or (lambda m: _log.info("%s", m))
        earlier = load_result(output) if append and output and os.path.exists(output) else None

        def checkpoint(partial: TuneReport) -> None:
            save_result(merge(earlier, partial, baseline) if earlier else partial, output)

        doc = run_tune(req, list(presets), concurrencies=list(concurrencies), input_len=input_len,
                       output_len=output_len, num_prompts=num_prompts, rounds=rounds, client=client,
                       timeout=timeout, baseline=baseline, progress=progress,
                       checkpoint=checkpoint if output else None, store=self.store,
                       runner=self._request_runner(req))
        if earlier is not None:
            doc = merge(earlier, doc, baseline)
        if save or output:
            progress(f"saved {save_result(doc, output)}")
        return doc

    @staticmethod
    def set_default_preset(model: str, preset: str) -> str:
        """Make ``preset`` the default for ``model`` in the user's config (``tune``'s winner, say); the file."""
        from pbs_toolkit.settings.config import save_default_preset

        return str(save_default_preset(model, preset))

    @staticmethod
    def tune_report(reports: Sequence[str], baseline: str | None = None, output: str | None = None,
                    progress: Callable[[str], None] | None = None) -> TuneReport:
        """Saved tune results merged into one document (same method), compared against ``baseline``; saved
        to ``output`` when given (``progress`` hears ``saved PATH``)."""
        from pbs_toolkit.perf.tune import merged_report

        return merged_report(reports, baseline, output, progress or (lambda m: _log.info("%s", m)))
