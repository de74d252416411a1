"""vLLM V1 Prometheus metrics: parse ``/metrics`` text, compute rates and latency quantiles.

The text is parsed with ``prometheus_client.parser``; values are summed over label sets (several engines,
several served model names). Metric names follow docs/vllm.md "Prometheus metrics", with fallbacks for older servers:
``vllm:gpu_cache_usage_perc`` (before ``kv_cache_usage_perc``), ``vllm:time_per_output_token_seconds``
(before ``inter_token_latency_seconds``) and ``vllm:gpu_prefix_cache_*`` (before ``prefix_cache_*``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.errors import ServerFailed, UsageError

#: snapshot field -> sample names, preferred first
_GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_COUNTERS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "requests_success": ("vllm:request_success_total",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "preemptions": ("vllm:num_preemptions_total",),
}
_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
}
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Histogram:
    """A cumulative histogram: ``buckets`` are ``(upper bound, count <= bound)`` sorted, ending at +Inf."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        """See :func:`histogram_quantile`."""
        return histogram_quantile(self.buckets, q)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class MetricsSnapshot:
    """One scrape of ``/metrics``, summed over engines and model names.

    ``kv_cache_usage`` is a fraction 0..1 averaged over engines (each engine has its own cache);
    ``kv_cache_usage_max`` is the fullest engine. ``None`` means the server did not export the metric.
    """

    timestamp: float
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    kv_cache_usage_max: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    requests_success: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    tpot: Histogram | None = None
    engines: list[str] = field(default_factory=list)
    model_names: list[str] = field(default_factory=list)
    #: engine steps (``vllm:iteration_tokens_total``'s count): they move while the engine works on anything
    steps: float | None = None
    #: the server runs several API-server processes (``--api-server-count``): its ``/metrics`` comes from vLLM's
    #: multi-process directory (no ``python_``/``process_`` samples, which one process shows), and its gauges
    #: keep their last busy value once the engine is idle (vLLM 0.22.1 on an H200: "7 running" minutes after the
    #: load ended). Whoever looks twice: :func:`settle`
    several_processes: bool = False
    #: ``running``/``waiting`` were such stale values, set to 0 by :func:`settle`
    gauges_stale: bool = False

    def progress(self) -> tuple[float | None, ...]:
        """What moves while the engine works: steps, tokens and finished requests."""
        return (self.steps, self.prompt_tokens, self.generation_tokens, self.requests_success)


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


class _Samples:
    """The ``vllm:`` samples of one scrape, grouped by name (engines and model names remembered on the way)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)
        self.buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        self.engines: set[str] = set()
        self.models: set[str] = set()
        self.per_pid: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.default_collectors = False

    def settle(self) -> None:
        """Each engine value that every process reported once (a ``pid`` label): taken once, the largest."""
        for (name, labels), value in self.per_pid.items():
            self.add(name, dict(labels), value)

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        if "pid" in labels:  # a multi-process gauge in vLLM's "all" mode: each process's copy of one engine value
            key = (name, tuple(sorted((k, v) for k, v in labels.items() if k != "pid")))
            self.per_pid[key] = max(self.per_pid.get(key, value), value)
            return
        if "engine" in labels:
            self.engines.add(labels["engine"])
        if "model_name" in labels:
            self.models.add(labels["model_name"])
        if name.endswith("_bucket") and "le" in labels:
            self.buckets[name[: -len("_bucket")]][_le(labels["le"])] += value
        else:
            self.values[name].append(value)

    def total(self, names: tuple[str, ...]) -> float | None:
        """The sum over engines of the first of ``names`` exported (names changed across vLLM versions)."""
        for name in names:
            if name in self.values:
                return sum(self.values[name])
        return None

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        """The first of ``names`` exported as a histogram, its buckets summed over engines."""
        for name in names:
            if name in self.buckets:
                return Histogram(
                    buckets=sorted(self.buckets[name].items()),
                    sum=sum(self.values.get(name + "_sum", [0.0])),
                    count=sum(self.values.get(name + "_count", [0.0])),
                )
        return None


def parse_metrics(text: str, timestamp: float) -> MetricsSnapshot:
    """Parse a ``/metrics`` body taken at ``timestamp`` (seconds since the epoch, or any monotonic clock).

    Raises ``ServerFailed`` when the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples = _Samples()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:"):
                    samples.add(sample.name, sample.labels, sample.value)
                elif sample.name.startswith(("python_", "process_")):
                    samples.default_collectors = True
    except ValueError as exc:
        raise ServerFailed(f"/metrics is not in Prometheus text format: {exc}") from exc

    samples.settle()
    snapshot = MetricsSnapshot(timestamp=timestamp, engines=sorted(samples.engines),
                               model_names=sorted(samples.models),
                               several_processes=bool(samples.values) and not samples.default_collectors)
    snapshot.steps = samples.total(("vllm:iteration_tokens_total_count",))
    for attr, names in _GAUGES.items():
        setattr(snapshot, attr, samples.total(names))
    for attr, names in _COUNTERS.items():
        setattr(snapshot, attr, samples.total(names))
    for attr, names in _HISTOGRAMS.items():
        setattr(snapshot, attr, samples.histogram(names))
    for name in _KV_USAGE:
        if samples.values.get(name):
            snapshot.kv_cache_usage = sum(samples.values[name]) / len(samples.values[name])
            snapshot.kv_cache_usage_max = max(samples.values[name])
            break
    return snapshot


#: seconds without progress (steps, tokens, finished requests) after which a server of several API-server processes
#: is taken to run nothing, whatever its gauges still say: a working engine steps many times a second
STALE_AFTER_S = 1.0


def settle(snap: MetricsSnapshot, last_progress: tuple[tuple[float | None, ...], float] | None,
           ) -> tuple[tuple[float | None, ...], float]:
    """``snap`` with the stale gauges of a server of several API-server processes set to 0 (``gauges_stale``):
    its progress has not moved since ``last_progress`` (what it was, and the earliest time it was seen so) at
    least ``STALE_AFTER_S`` before ``snap``. Returns the progress to remember for the next look."""
    now = snap.progress()
    if last_progress is None or last_progress[0] != now or None in now[1:]:
        return now, snap.timestamp
    if (snap.several_processes and (snap.running or snap.waiting)
            and snap.timestamp - last_progress[1] >= STALE_AFTER_S):
        snap.running, snap.waiting, snap.gauges_stale = 0.0, 0.0, True
    return last_progress


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q``-quantile (0..1) of cumulative ``buckets``, interpolated linearly as Prometheus does.

    ``None`` when the histogram holds no observations. A quantile that falls in the +Inf bucket returns the
    largest finite bound, as Prometheus does.
    """
    if not 0.0 <= q <= 1.0:
        raise UsageError(f"quantile must be between 0 and 1, got {q}")
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > previous_count:
            if math.isinf(bound):
                return previous_bound
            if bound <= 0:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count
            )
        previous_bound, previous_count = bound, count
    return previous_bound


def delta(prev: Histogram, cur: Histogram) -> Histogram:
    """Observations made between two scrapes. A server restart (counts going down) yields ``cur``."""
    before = dict(prev.buckets)
    if cur.count < prev.count or any(count < before.get(bound, 0.0) for bound, count in cur.buckets):
        return cur
    return Histogram(
        buckets=[(bound, count - before.get(bound, 0.0)) for bound, count in cur.buckets],
        sum=cur.sum - prev.sum,
        count=cur.count - prev.count,
    )


def _increase(prev: float | None, cur: float | None) -> float | None:
    if cur is None:
        return None
    if prev is None or cur < prev:  # counter reset: the server restarted and counts from zero
        return cur
    return cur - prev


def rates(prev: MetricsSnapshot, cur: MetricsSnapshot) -> dict[str, float | None]:
    """Per-second rates over the interval between two snapshots (``None`` where a counter is missing)."""
    interval = cur.timestamp - prev.timestamp
    if interval <= 0:
        raise UsageError(f"snapshots are not in time order (interval {interval:.3f} s)")

    def rate(attr: str) -> float | None:
        increase = _increase(getattr(prev, attr), getattr(cur, attr))
        return None if increase is None else increase / interval

    return {
        "interval_s": interval,
        "prompt_tokens_per_s": rate("prompt_tokens"),
        "generation_tokens_per_s": rate("generation_tokens"),
        "requests_per_s": rate("requests_success"),
        "preemptions_per_s": rate("preemptions"),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def summarize(prev: MetricsSnapshot | None, cur: MetricsSnapshot) -> dict[str, Any]:
    """A JSON-ready summary of ``cur``; with ``prev``, hit rate, rates and latencies cover only the interval.

    Latency keys are ``ttft_p50_ms``, ``ttft_p90_ms``, ``ttft_p99_ms`` and the same for ``itl``, ``e2e`` and
    ``tpot`` (``None`` when no request finished in the window).
    """
    queries = cur.prefix_cache_queries
    hits = cur.prefix_cache_hits
    if prev is not None:
        queries = _increase(prev.prefix_cache_queries, cur.prefix_cache_queries)
        hits = _increase(prev.prefix_cache_hits, cur.prefix_cache_hits)
    hit_rate = 100.0 * hits / queries if queries and hits is not None else None
    result: dict[str, Any] = {
        "timestamp": cur.timestamp,
        "window": "interval" if prev is not None else "cumulative",
        "running": cur.running,
        "waiting": cur.waiting,
        "several_api_servers": cur.several_processes,
        "gauges_stale": cur.gauges_stale,
        "kv_cache_usage_pct": _round(None if cur.kv_cache_usage is None else 100.0 * cur.kv_cache_usage),
        "prefix_cache_hit_rate_pct": _round(hit_rate),
        "preemptions": cur.preemptions,
        "rates": rates(prev, cur) if prev is not None else None,
        "engines": len(cur.engines),
        "totals": {"requests_success": cur.requests_success, "prompt_tokens": cur.prompt_tokens,
                   "generation_tokens": cur.generation_tokens},
    }
    for name in _HISTOGRAMS:
        hist: Histogram | None = getattr(cur, name)
        before: Histogram | None = getattr(prev, name) if prev is not None else None
        if hist is not None and before is not None:
            hist = delta(before, hist)
        for q in QUANTILES:
            result[f"{name}_p{round(q * 100)}_ms"] = _ms(hist.quantile(q)) if hist is not None else None
    return result


def _merge(hists: list[Histogram]) -> Histogram | None:
    """Histograms of several servers as one: bucket counts, sums and counts added (bounds as exported)."""
    if not hists:
        return None
    buckets: dict[float, float] = defaultdict(float)
    for hist in hists:
        for bound, count in hist.buckets:
            buckets[bound] += count
    return Histogram(sorted(buckets.items()), sum(h.sum for h in hists), sum(h.count for h in hists))


def combine(snapshots: list[MetricsSnapshot]) -> MetricsSnapshot:
    """Several servers' snapshots (a service's replicas) as one: gauges and counters added, histograms merged,
    KV cache usage averaged over every engine (``_max``: the fullest); ``None`` where no server exported it.
    ``timestamp`` is the latest; ``engines`` are ``<i>:<engine>`` by snapshot position."""
    out = MetricsSnapshot(timestamp=max((s.timestamp for s in snapshots), default=0.0))
    for attr in (*_GAUGES, *_COUNTERS):
        values = [v for s in snapshots if (v := getattr(s, attr)) is not None]
        setattr(out, attr, sum(values) if values else None)
    for attr in _HISTOGRAMS:
        setattr(out, attr, _merge([h for s in snapshots if (h := getattr(s, attr)) is not None]))
    usage = [(s.kv_cache_usage, max(len(s.engines), 1)) for s in snapshots if s.kv_cache_usage is not None]
    if usage:
        out.kv_cache_usage = sum(u * n for u, n in usage) / sum(n for _, n in usage)
        out.kv_cache_usage_max = max(s.kv_cache_usage_max for s in snapshots if s.kv_cache_usage_max is not None)
    steps = [s.steps for s in snapshots if s.steps is not None]
    out.steps = sum(steps) if steps else None
    out.several_processes = any(s.several_processes for s in snapshots)
    out.gauges_stale = any(s.gauges_stale for s in snapshots)
    out.engines = [f"{i}:{e}" for i, s in enumerate(snapshots) for e in s.engines]
    out.model_names = sorted({m for s in snapshots for m in s.model_names})
    return out
