"""vllm-router's own figures from its Prometheus port: requests, retries, its 503s, per-worker health and circuit
state, the latency histogram (``metrics NAME``, ``doctor NAME``, and the autoscaler, which reads the router's
failed requests and the requests it has open each tick)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.vllm.prom import Histogram

if TYPE_CHECKING:
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.transports import Runner

#: vllm-router's Prometheus samples pbstk reads (0.1.17; each ``worker``-labelled one per worker URL)
ROUTER_COUNTERS = {"requests": "vllm_router_requests_total", "retries": "vllm_router_retries_total",
                    "retries_exhausted": "vllm_router_retries_exhausted_total"}
_ROUTER_DURATION = "vllm_router_generate_duration_seconds"
#: the router's failed requests by ``error_type`` (``no_available_workers``: its ``503 No available workers``)
_ROUTER_ERRORS = "vllm_router_request_errors_total"
#: a worker's requests in flight: gauge of the load-aware policies; every request's end (one sample per outcome)
_FLIGHT = {"vllm_router_running_requests": "running", "vllm_router_cb_outcomes_total": "ended"}
_CIRCUIT = {0: "closed", 1: "open", 2: "half_open"}


@dataclass
class RouterSnapshot:
    """One scrape of the router's Prometheus port."""

    timestamp: float
    counters: dict[str, float] = field(default_factory=dict)
    active_workers: float | None = None
    #: worker URL -> {processed, healthy, circuit}
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    duration: Histogram | None = None
    #: worker URL -> {running (its ``running_requests`` gauge: only the load-aware policies export it), ended (its
    #: circuit breaker's ``cb_outcomes_total``: every request's end, success or failure), succeeded (its successes)}
    flight: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def refused(self) -> float:
        """Requests the router failed for want of a worker: its 503s and its exhausted retries, so far."""
        return self.counters.get("no_workers", 0.0) + self.counters.get("retries_exhausted", 0.0)

    @property
    def in_flight(self) -> float | None:
        """Requests the router has sent to a worker and not had answered yet: its ``running_requests`` gauge (the
        load-aware policies, e.g. ``power_of_two``, export it), else what it sent minus what came back (its
        per-worker ``processed_requests_total`` less its circuit breaker's ``cb_outcomes_total``, every request
        counted once in each; checked on 0.1.17 with round_robin). ``None`` when it lists no worker."""
        if not self.workers:
            return None
        return sum(self.open_to(url) or 0.0 for url in self.workers)

    def open_to(self, url: str) -> float | None:
        """The requests open to one worker (``in_flight``'s rule), ``None`` when the router does not list it."""
        worker, flight = self.workers.get(url), self.flight.get(url, {})
        if worker is None:
            return None
        if "running" in flight:
            return flight["running"]
        return max(0.0, worker.get("processed", 0.0) - flight.get("ended", 0.0))

    def succeeded(self, url: str) -> float:
        """The requests to one worker that have ended well so far (its circuit breaker's ``success`` outcomes)."""
        return self.flight.get(url, {}).get("succeeded", 0.0)


def parse_router_metrics(text: str, timestamp: float) -> RouterSnapshot:
    """The figures pbstk shows from vllm-router's ``/metrics`` text (``ServerFailed`` when it is not one)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = RouterSnapshot(timestamp)
    duration: dict[str, Any] = {"buckets": {}, "sum": 0.0, "count": 0.0}
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except ValueError as exc:
        raise ServerFailed(f"the router's /metrics is not in Prometheus text format: {exc}") from exc
    for s in samples:
        for key, name in ROUTER_COUNTERS.items():
            if s.name == name:
                snap.counters[key] = snap.counters.get(key, 0.0) + s.value
        if s.name == _ROUTER_ERRORS and s.labels.get("error_type") == "no_available_workers":  # its 503s
            snap.counters["no_workers"] = snap.counters.get("no_workers", 0.0) + s.value
        if s.name in _FLIGHT and s.labels.get("worker"):
            flight = snap.flight.setdefault(s.labels["worker"], {})
            keys = [_FLIGHT[s.name]] + (["succeeded"] if s.labels.get("outcome") == "success" else [])
            for key in keys:
                flight[key] = flight.get(key, 0.0) + s.value
        if s.name == "vllm_router_active_workers":
            snap.active_workers = s.value
        elif s.labels.get("worker"):
            _worker_sample(snap.workers.setdefault(s.labels["worker"], {}), s.name, s.value)
        elif s.name.startswith(_ROUTER_DURATION):
            _duration_sample(duration, s.name[len(_ROUTER_DURATION):], s.labels, s.value)
    if duration["buckets"]:
        snap.duration = Histogram(sorted(duration["buckets"].items()), duration["sum"], duration["count"])
    return snap


def _worker_sample(worker: dict[str, Any], name: str, value: float) -> None:
    if name == "vllm_router_processed_requests_total":
        worker["processed"] = value
    elif name == "vllm_router_worker_health":
        worker["healthy"] = value >= 1
    elif name == "vllm_router_cb_state":
        worker["circuit"] = _CIRCUIT.get(int(value), str(value))


def _duration_sample(hist: dict[str, Any], suffix: str, labels: dict[str, str], value: float) -> None:
    if suffix == "_bucket":
        le = labels.get("le", "+Inf")
        bound = float("inf") if le in ("+Inf", "Inf") else float(le)
        hist["buckets"][bound] = hist["buckets"].get(bound, 0.0) + value
    elif suffix in ("_sum", "_count"):
        hist[suffix[1:]] += value


def router_counters(runner: Runner, rec: ServiceRecord, timeout: float = 5.0) -> RouterSnapshot:
    """The router's Prometheus figures alone (one request; the autoscaler reads its ``refused`` each tick)."""
    from pbs_toolkit.transports import http as probe

    info = rec.router or {}
    if not info.get("prometheus_port"):
        raise ServerFailed(f"service {rec.name}: the router's Prometheus port is not recorded")
    text = probe.metrics_text(runner, info["host"], int(info["prometheus_port"]), timeout=timeout,
                              what=f"the router's metrics at {info['host']}:{info['prometheus_port']}")
    return parse_router_metrics(text, time.time())
