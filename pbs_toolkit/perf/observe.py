"""Looking at one READY job's performance: ``metrics`` (two scrapes and the rates between them), a watch of
them, ``doctor`` (findings and the preset to use instead) and ``bench`` (load at several concurrencies).

``Client.metrics``/``watch_metrics``/``doctor``/``bench`` hand these a status and the job's runner; the results
are the dataclasses the Python API returns (re-exported by ``pbs_toolkit.client``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.jobs.status_types import ServerState

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.perf.benchjob import LevelResult
    from pbs_toolkit.perf.doctor import Finding
    from pbs_toolkit.perf.images import ImageLoad
    from pbs_toolkit.transports import Runner
    from pbs_toolkit.vllm.prom import MetricsSnapshot


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


def metrics(runner: Runner, st: JobStatus, interval: float = 1.0) -> Metrics:
    """Two ``/metrics`` scrapes ``interval`` s apart: rates over the interval, latencies since start, and the last
    ``Engine`` lines of the log."""
    from pbs_toolkit.perf.scrape import engine_history, scrape
    from pbs_toolkit.vllm.prom import rates, summarize

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


def watch_metrics(runner: Runner, st: JobStatus, every: float = 5.0, count: int = 0) -> Iterator[Metrics]:
    """A scrape every ``every`` s, each with the rates and latencies since the scrape before it; ``count`` looks
    (0: until the caller stops iterating). One scrape is taken first as the starting point."""
    from pbs_toolkit.perf.scrape import scrape
    from pbs_toolkit.vllm.prom import summarize

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


def diagnose(runner: Runner, st: JobStatus) -> Diagnosis:
    """Findings from the job's flags, log and metrics (scraped when READY), each with the command that relaunches
    the job with its fix where a launch can apply one, and the preset to use instead."""
    from pbs_toolkit.perf.doctor import diagnose as findings
    from pbs_toolkit.perf.recommend import recommend, with_relaunches
    from pbs_toolkit.perf.scrape import doctor_context, scrape

    ctx = doctor_context(runner, st, scrape(runner, st) if st.state is ServerState.READY else None)
    advice = recommend(st.record, ctx)
    return Diagnosis(st.record.job_id, st.state.value, with_relaunches(st.record, findings(ctx)), *(
        (advice.preset, advice.why, advice.launch) if advice else ()))


def bench(runner: Runner, st: JobStatus, concurrencies: Sequence[int], *, input_len: int, output_len: int,
          num_prompts: int | None, client: str, notice: Callable[[str], None],
          images: ImageLoad | None = None,
          server_time: bool | Sequence[tuple[Runner, JobStatus]] = True) -> BenchResult:
    """Drive load against a READY job's endpoint, each concurrency in turn (``notice``: which load generator
    runs and why; ``server_time``: as ``benchmark_ready_job``'s)."""
    from pbs_toolkit.perf.benchjob import benchmark_ready_job

    results = benchmark_ready_job(st, list(concurrencies), input_len=input_len, output_len=output_len,
                                  num_prompts=num_prompts, client=client, notice=notice, runner=runner,
                                  images=images, server_time=server_time)
    return BenchResult(st.record.job_id, st.record.preset, results)
