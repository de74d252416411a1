"""``Client`` and ``serve``: the Python API, one object that owns what every call needs.

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
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import ServerFailed, UsageError

if TYPE_CHECKING:
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.jobs.render import RenderedJob, RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.perf.benchjob import LevelResult
    from pbs_toolkit.perf.doctor import Finding
    from pbs_toolkit.perf.tune import TuneReport
    from pbs_toolkit.transports import Runner
    from pbs_toolkit.vllm.prom import MetricsSnapshot

__all__ = ["BenchResult", "Client", "Diagnosis", "Endpoint", "Job", "Metrics", "serve"]

_log = logging.getLogger("pbs_toolkit")

#: a runner factory: the transport ("" = this machine, else an SSH host) -> an open runner
RunnerFactory = Callable[[str], "Runner"]


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


@dataclass(frozen=True)
class Endpoint:
    """What an OpenAI-compatible client needs. ``repr`` hides the key so a notebook cell never prints it."""

    base_url: str
    api_key: str | None = field(repr=False)
    model: str
    job_id: str = ""


@dataclass(frozen=True)
class Metrics:
    """One look at a READY server: the second of two ``/metrics`` scrapes, rates between them, the summary."""

    job_id: str
    snapshot: MetricsSnapshot
    rates: dict[str, float | None]
    summary: dict[str, Any]


@dataclass(frozen=True)
class Diagnosis:
    """``pbstk doctor``'s findings and the preset it recommends (``None`` when the GPU count is unknown)."""

    job_id: str
    state: str
    findings: list[Finding]
    recommended_preset: str | None = None
    why: str | None = None
    launch: str | None = None


@dataclass(frozen=True)
class BenchResult:
    """One benchmark of a READY job: one ``LevelResult`` per concurrency (``vllm bench serve`` field names).

    ``to_dict`` is what ``pbstk bench --json`` prints; ``from_dict`` reads it (and the saved
    ``benchmarks/gpu/results/h200-bench-*.json``) back."""

    job_id: str
    preset: str
    results: list[LevelResult]

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "preset": self.preset, "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        from pbs_toolkit.perf.benchjob import LevelResult

        return cls(str(data["job_id"]), str(data["preset"]), [LevelResult.from_dict(r) for r in data["results"]])


class Client:
    """The job store plus one runner per transport, and every operation on jobs.

    ``store``: a ``JobStore`` (default: the user's). ``profile``: the default site profile for ``launch``.
    ``runner_factory``: how a transport's runner is opened (default ``open_runner``); called at most once per
    transport while the client is open. Use it as a context manager, or call ``close()``.
    """

    def __init__(self, store: JobStore | None = None, profile: str | None = None, *,
                 accept_new_host_key: bool = False, runner_factory: RunnerFactory | None = None) -> None:
        from pbs_toolkit.jobs.store import JobStore

        self.store = store or JobStore()
        self.profile = profile
        self.accept_new_host_key = accept_new_host_key
        self._factory = runner_factory or self._open_runner
        self._runners: dict[str, Runner] = {}

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
        """Close every runner (SSH connections); the client opens new ones if used again."""
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
        return self.store.find(job)

    def request(self, model: str, preset: str | None = None, profile: str | None = None,
                **options: Any) -> RenderRequest:
        """The ``RenderRequest`` for ``model`` (``options``: any RenderRequest field, e.g. ``name``, ``port``)."""
        from pbs_toolkit.jobs.render import RenderRequest

        try:
            return RenderRequest(model=model, preset=preset, profile=profile or self.profile, **options)
        except TypeError as exc:  # an unknown option: one clear error rather than a TypeError deep inside
            raise UsageError(f"launch: {exc}") from None

    def render(self, model: str, preset: str | None = None, profile: str | None = None,
               **options: Any) -> RenderedJob:
        """Render without writing or submitting anything (``pbstk render``)."""
        from pbs_toolkit.jobs.render import render, resolve_profile

        req = self.request(model, preset, profile, **options)
        return render(req, self.runner(resolve_profile(req)[0].ssh_host or ""))

    def launch(self, model: str, preset: str | None = None, profile: str | None = None, *,
               api_key: str | None = None, use_api_key: bool = True, **options: Any) -> Job:
        """Render, submit and record a server job for ``model``; returns at once (``wait`` waits)."""
        from pbs_toolkit.jobs.launch import launch
        from pbs_toolkit.jobs.render import resolve_profile

        req = self.request(model, preset, profile, **options)
        transport = resolve_profile(req)[0].ssh_host or ""
        result = launch(req, store=self.store, runner=self.runner(transport), api_key=api_key,
                        use_api_key=use_api_key)
        return Job.from_record(result.record, result.rendered.notes)

    def wait(self, job: Job | JobRecord | str | None, timeout: float = 3600.0,
             on_progress: Callable[[JobStatus, float], None] | None = None) -> JobStatus:
        """Block until the job's server is READY (``ServerFailed`` with the cause, ``WaitTimeout``)."""
        from pbs_toolkit.jobs.readiness import wait_until_ready

        record = self.record(job)
        return wait_until_ready(record, timeout=timeout, store=self.store, runner=self.runner(record.transport),
                                on_progress=on_progress)

    def status(self, *jobs: Job | JobRecord | str, all: bool = False) -> list[JobStatus]:  # noqa: A002
        """Status of ``jobs`` (default: every job not ended; ``all``: every job). One scheduler query each."""
        from pbs_toolkit.jobs.status import status

        records = [self.record(j) for j in jobs] if jobs else self._records(all)
        for transport in {r.transport for r in records}:
            self.runner(transport)
        return status(records, self.store, runners=self._runners)

    def jobs(self, all: bool = False) -> list[Job]:  # noqa: A002
        """Jobs pbstk launched, newest first (default: those not recorded as ended). No scheduler query."""
        return [Job.from_record(r) for r in self._records(all)]

    def _records(self, show_all: bool) -> list[JobRecord]:
        return [r for r in self.store.all() if show_all or not r.final_state]

    def cancel(self, job: Job | JobRecord | str) -> bool:
        """Stop the job; ``True`` if stopped now, ``False`` if it had already ended."""
        from pbs_toolkit.jobs.launch import cancel

        record = self.record(job)
        return cancel(record, runner=self.runner(record.transport))

    def logs(self, job: Job | JobRecord | str | None = None, lines: int = 50, follow: bool = False, *,
             stream: str = "vllm", final_every: float = 5.0) -> Iterator[str]:
        """The job's log lines (without newlines): the last ``lines``; with ``follow``, then new ones until the
        job ends (its status is asked at most every ``final_every`` s). Closing the iterator stops following."""
        from pbs_toolkit.jobs.logs import stream_path

        if lines < 0:
            raise UsageError("lines must not be negative")
        record = self.record(job)
        path = stream_path(record.run_dir, record.scheduler, stream)
        if follow:
            return self._follow(record, path, lines, final_every)
        return self._tail(record, path, lines)

    def _tail(self, record: JobRecord, path: str, lines: int) -> Iterator[str]:
        from pbs_toolkit.jobs.logs import decoded_pieces, tail_blocks

        try:
            blocks, _ = tail_blocks(self.runner(record.transport), path, lines)
        except FileNotFoundError:
            raise UsageError(f"{path} does not exist yet (job {record.job_id} not started?)") from None
        if lines == 0:
            return iter(())
        return iter("".join(decoded_pieces(blocks)).splitlines())

    def _follow(self, record: JobRecord, path: str, lines: int, final_every: float) -> Iterator[str]:
        """``logs.follow``'s loop as a generator: the same follower, its lines handed out as they arrive."""
        from pbs_toolkit.jobs.logs import _Follower

        runner = self.runner(record.transport)
        pending: list[str] = []
        follower = _Follower(runner, path, pending.append, lambda m: _log.info("%s", m))
        closed, final, last_check = False, False, 0.0
        try:
            while True:
                progressed = follower.step(lines)
                yield from _drain(pending)
                if progressed:
                    continue
                if final:
                    break
                if time.monotonic() - last_check >= final_every:
                    last_check = time.monotonic()
                    final = self._is_final(record)
                    if final:
                        continue
                time.sleep(0.2)
            follower.close()  # the incomplete last line, if any
            closed = True
            yield from _drain(pending)
        finally:
            if not closed:
                follower.close()

    def _is_final(self, record: JobRecord) -> bool:
        from pbs_toolkit.jobs.status import status

        return status([record], self.store, runners=self._runners)[0].state.final

    # -- endpoints ------------------------------------------------------------------------------------------

    def ready_status(self, job: Job | JobRecord | str | None) -> JobStatus:
        """The job's status, which must be READY: its server answered ``/v1/models`` as this job's own."""
        st = self.status(self.record(job))[0]
        if st.state.value != "READY":
            raise ServerFailed(f"job {st.record.job_id} is {st.state.value}, not READY"
                               f"{': ' + st.reason if st.reason else ''} (`Client.wait` waits for it)")
        return st

    def endpoint(self, job: Job | JobRecord | str | None = None) -> Endpoint:
        """base URL, API key and served model of a READY, identity-verified job (else ``ServerFailed``)."""
        from pbs_toolkit.endpoints import endpoint_url

        st = self.ready_status(job)
        return Endpoint(base_url=endpoint_url(st), api_key=st.record.api_key, model=st.record.served_model_name,
                        job_id=st.record.job_id)

    def update_endpoint(self, job: Job | JobRecord | str | None = None, registry: str | None = None, *,
                        fmt: str = "auto", alias: str | None = None, timeout: float = 3600.0,
                        follow_symlink: bool = False, force_format: bool = False) -> EndpointUpdate:
        """Wait until the job is ready, then write its endpoint into ``registry`` (checked before waiting)."""
        from pbs_toolkit.endpoints import check_registry, update_endpoint

        record = self.record(job)
        fmt = check_registry(record, registry, fmt, alias, follow_symlink=follow_symlink, force_format=force_format)
        st = self.wait(record, timeout)
        return update_endpoint(st, registry=registry, fmt=fmt, alias=alias, follow_symlink=follow_symlink,
                               force_format=force_format)

    def remove_endpoint(self, alias: str, registry: str | None = None, *, fmt: str = "auto",
                        follow_symlink: bool = False, force_format: bool = False) -> bool:
        """Remove ``alias`` from ``registry`` (default: pbstk's own); ``True`` if it was there."""
        from pbs_toolkit.endpoints.registry import remove_endpoint

        return remove_endpoint(registry, alias, fmt, follow_symlink=follow_symlink, force_format=force_format)

    # -- performance ----------------------------------------------------------------------------------------

    def metrics(self, job: Job | JobRecord | str | None = None, interval: float = 1.0) -> Metrics:
        """Two ``/metrics`` scrapes ``interval`` s apart: rates over the interval, latencies since start."""
        from pbs_toolkit.perf.scrape import scrape
        from pbs_toolkit.vllm.prom import rates, summarize

        st = self.ready_status(job)
        runner = self.runner(st.record.transport)
        prev = scrape(runner, st)
        time.sleep(interval)
        cur = scrape(runner, st)
        summary = summarize(None, cur)
        summary["rates"] = rates(prev, cur)
        summary["job_id"] = st.record.job_id
        return Metrics(job_id=st.record.job_id, snapshot=cur, rates=summary["rates"], summary=summary)

    def doctor(self, job: Job | JobRecord | str | None = None) -> Diagnosis:
        """Findings from the job's flags, log and metrics, and the preset to use instead."""
        from pbs_toolkit.perf.doctor import diagnose
        from pbs_toolkit.perf.scrape import doctor_context, scrape
        from pbs_toolkit.settings.presets import auto_layout, preset_for_layout

        st = self.status(self.record(job))[0]
        runner = self.runner(st.record.transport)
        ctx = doctor_context(runner, st, scrape(runner, st) if st.state.value == "READY" else None)
        findings = diagnose(ctx)
        if not ctx.gpus:
            return Diagnosis(st.record.job_id, st.state.value, findings)
        tp, dp, why = auto_layout(ctx.model_params_b, ctx.gpus)
        preset = preset_for_layout(tp, dp)
        rec = st.record
        line = (f"pbstk launch {rec.model} --preset {preset} --profile {rec.profile}"
                + (f" --name {rec.name}" if rec.name else ""))
        return Diagnosis(rec.job_id, st.state.value, findings, preset, why, line)

    def bench(self, job: Job | JobRecord | str | None = None, concurrencies: Sequence[int] = (1, 8, 64), *,
              input_len: int = 128, output_len: int = 256, num_prompts: int | None = None,
              client: str = "auto") -> BenchResult:
        """Drive load against a READY job's endpoint, each concurrency in turn."""
        from pbs_toolkit.perf.benchjob import benchmark_ready_job

        st = self.ready_status(job)
        results = benchmark_ready_job(st, list(concurrencies), input_len=input_len, output_len=output_len,
                                      num_prompts=num_prompts, client=client,
                                      notice=lambda m: _log.info("%s", m), runner=self.runner(st.record.transport))
        return BenchResult(st.record.job_id, st.record.preset, results)

    def tune(self, model: str, presets: Sequence[str], *, profile: str | None = None,
             concurrencies: Sequence[int] = (1, 8, 64), input_len: int = 128, output_len: int = 256,
             num_prompts: int | None = None, rounds: int = 4, client: str = "auto", timeout: float = 3600.0,
             baseline: str | None = None, progress: Callable[[str], None] | None = None,
             **options: Any) -> TuneReport:
        """Launch, wait, benchmark and cancel each preset in turn; the report (``tune.run_tune``), whose
        ``to_dict`` is the JSON ``pbstk tune`` saves."""
        from pbs_toolkit.jobs.render import resolve_profile
        from pbs_toolkit.perf.tune import run_tune

        req = self.request(model, None, profile, **options)
        return run_tune(req, list(presets), concurrencies=list(concurrencies), input_len=input_len,
                        output_len=output_len, num_prompts=num_prompts, rounds=rounds, client=client,
                        timeout=timeout, baseline=baseline, progress=progress or (lambda m: _log.info("%s", m)),
                        store=self.store, runner=self.runner(resolve_profile(req)[0].ssh_host or ""))


def _drain(pending: list[str]) -> Iterator[str]:
    """Hand out and forget what the follower emitted (the list is its ``emit`` target)."""
    lines = pending[:]
    pending.clear()
    return iter(lines)


@contextmanager
def serve(model: str, preset: str | None = None, profile: str | None = None, *, timeout: float = 3600.0,
          client: Client | None = None, **options: Any) -> Iterator[Endpoint]:
    """Launch ``model``, wait until it is ready, yield its ``Endpoint``; cancel the job on the way out, whatever
    ends the block (an exception, Ctrl-C, a failed or timed-out wait). ``client``: reuse one (else a fresh one,
    closed at the end); ``options``: as for ``Client.launch``."""
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
