"""Looking into a service as into a job: ``metrics``, ``logs``, ``doctor`` and ``bench`` given a service name.

* **metrics**: each serving replica's ``/metrics`` (the READY job of each slot), their sum, and the router's own
  Prometheus figures (vllm-router 0.1.17 serves them on its ``--prometheus-port``; names below). The sum adds
  gauges and counters (requests running/waiting, tokens, requests), merges the latency histograms bucket by bucket
  (so the aggregate's percentiles are those of every request, not an average of percentiles), averages the KV cache
  usage over the replicas' engines and takes the prefix-cache hit rate from the summed hits and queries.
* **logs**: the router's ``router.log`` (its run directory: this machine, the login node, or the router job's);
  a replica's job log with ``--replica K``.
* **doctor**: each replica's diagnosis (the job doctor) plus findings about the router and the keeper.
* **bench**: a READY status at the router's URL (the service's key, a replica's Python environment and run
  directory for ``vllm bench serve``), so the load goes through the router as clients' does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import PbstkError, ServerFailed, UsageError
from pbs_toolkit.services import health
from pbs_toolkit.services.models.per_model import model_servers, pick
from pbs_toolkit.services.router.metrics import (
    ROUTER_COUNTERS,
    RouterSnapshot,
    router_counters,
)
from pbs_toolkit.vllm.prom import MetricsSnapshot, combine, delta, rates, summarize

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.perf.doctor import Finding
    from pbs_toolkit.perf.observe import Diagnosis
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.services.session import ServiceSession
    from pbs_toolkit.services.status import ServiceStatus
    from pbs_toolkit.transports import Runner



def serving(st: ServiceStatus) -> list[tuple[int, JobStatus]]:
    """(replica index, status) of each slot's routable job (services/health.py): the replicas the router routes
    to; while the router's workers are not known, each slot's READY job."""
    by_id = {s.record.job_id: s for s in st.replicas}
    workers = st.route.workers if st.route is not None else None
    out = []
    for slot in st.record.slots:
        if workers is not None:
            js = health.serving_job(slot, by_id, workers)
        else:
            js = next((j for j in (by_id.get(k or "") for k in (slot.current, slot.successor)) if health.ready(j)),
                      None)
        if js is not None:
            out.append((slot.index, js))
    return out


def replica_job(rec: ServiceRecord, index: int) -> str:
    """The job id of replica ``index`` (``--replica K``): its current job, else its successor."""
    if not 0 <= index < len(rec.slots):
        raise UsageError(f"--replica {index}: service {rec.name} has replicas 0 to {len(rec.slots) - 1}")
    slot = rec.slots[index]
    job = slot.current or slot.successor or slot.draining
    if job is None:
        raise UsageError(f"replica {index} of service {rec.name} has no job yet")
    return job


def router_log(rec: ServiceRecord) -> str:
    """The path of the router's log on the router's host (the transport's machine)."""
    from pbs_toolkit.services.router.process import LOG_FILE

    run_dir = (rec.router_job or {}).get("run_dir") or (rec.router or {}).get("run_dir")
    if not run_dir:
        raise UsageError(f"service {rec.name} has no router log: its router never started")
    return f"{run_dir}/{LOG_FILE}"


def router_log_lines(session: ServiceSession, rec: ServiceRecord, lines: int, follow: bool, *, pieces: bool,
                     final_every: float, notice: Callable[[str], None], stream: str = "vllm",
                     node: int | None = None) -> Iterator[str]:
    """The router's log as ``Client.logs`` gives a job's (``pieces``: as ``log_text``): the last ``lines``, or
    followed until the service ends. ``stream``/``node`` are a replica's (``Client.service_log`` picks it)."""
    from pbs_toolkit.jobs.logs import decoded_pieces, follow_lines, tail_blocks
    from pbs_toolkit.services.record import load

    if node is not None or stream != "vllm":
        raise UsageError(f"--stream and --node are a replica's: add --replica K (service {rec.name})")
    if lines < 0:
        raise UsageError("lines must not be negative")
    runner, path = session.runner(rec.transport), router_log(rec)
    if follow:
        return follow_lines(runner, path, lines, final_every, notice,
                            lambda: (load(session.store, rec.name) or rec).ended is not None)
    try:
        blocks, _ = tail_blocks(runner, path, lines)
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist (the router of service {rec.name} never started?)") from None
    text = decoded_pieces(blocks)
    return text if pieces else iter("".join(text).splitlines() if lines else ())


def serving_status(session: ServiceSession, name: str | ServiceRecord | ServiceStatus) -> ServiceStatus:
    """A ``ServiceStatus`` as it is (just waited for), else the service's, which must have a running router and
    a serving replica (``ServerFailed``)."""
    from pbs_toolkit.services.record import find
    from pbs_toolkit.services.status import ServiceStatus, look

    if isinstance(name, ServiceStatus):
        return name
    st = look(session, find(session.store, name) if isinstance(name, str) else name)
    if not st.router_running or not serving(st):
        raise ServerFailed(f"service {st.record.name} is {st.summary}: nothing to measure yet (`pbstk wait "
                           f"{st.record.name}`, or --wait, waits for it)")
    return st


# -- metrics -----------------------------------------------------------------------------------------------


def scrape_router(runner: Runner, rec: ServiceRecord, timeout: float = 5.0) -> RouterSnapshot:
    """One scrape of the router's Prometheus port, as the router's host reaches it, its workers those it routes
    to now."""
    from pbs_toolkit.services.router.process import list_workers

    info = rec.router or {}
    snap = router_counters(runner, rec, timeout)
    # the router keeps a removed worker's series (a predecessor after a handover, the start-up seed of
    # power_of_two): only the workers it routes to now are its workers
    current = list_workers(runner, info["host"], int(info["port"])) if info.get("port") else None
    if current is not None:
        snap.workers = {url: w for url, w in snap.workers.items() if url in current}
    return snap


def router_summary(prev: RouterSnapshot | None, cur: RouterSnapshot, window: bool) -> dict[str, Any]:
    """The ``router`` part of a ``service_metrics`` object (``window``: latencies since ``prev`` only)."""
    interval = cur.timestamp - prev.timestamp if prev is not None else 0.0
    out: dict[str, Any] = {f"{k}_total": cur.counters.get(k, 0.0) for k in ROUTER_COUNTERS}
    out["requests_per_s"] = None
    if prev is not None and interval > 0:
        gained = cur.counters.get("requests", 0.0) - prev.counters.get("requests", 0.0)
        out["requests_per_s"] = max(gained, 0.0) / interval
    out["active_workers"] = cur.active_workers
    out["workers"] = [{"url": url, **w} for url, w in sorted(cur.workers.items())]
    hist = cur.duration
    if window and hist is not None and prev is not None and prev.duration is not None:
        hist = delta(prev.duration, hist)
    for q in (50, 90, 99):
        value = hist.quantile(q / 100) if hist is not None else None
        out[f"duration_p{q}_ms"] = None if value is None else round(value * 1000.0, 3)
    out["window"] = "interval" if window and prev is not None else "cumulative"
    return out


@dataclass(frozen=True)
class ServiceMetrics:
    """One look at a service: each serving replica's summary, their aggregate, the router's figures; a
    multi-model service's each model's too (``models``)."""

    name: str
    timestamp: float
    replicas: list[dict[str, Any]]
    aggregate: dict[str, Any]
    router: dict[str, Any] | None
    router_error: str | None = None
    models: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A ``service_metrics`` object (``metrics NAME --json``, docs/json.md)."""
        from pbs_toolkit.schema import stamp

        return stamp("service_metrics", {"name": self.name, "timestamp": self.timestamp,
                                         "replicas": self.replicas, "aggregate": self.aggregate,
                                         "router": self.router, "router_error": self.router_error,
                                         **({"models": self.models} if self.models is not None else {})})


@dataclass
class _Round:
    timestamp: float
    snaps: dict[str, MetricsSnapshot]
    errors: dict[str, str]
    router: RouterSnapshot | None
    router_error: str | None


class _Scraper:
    """The serving replicas of one look at the service, scraped together with the router. A multi-model
    service's servers are its models' (services/models/per_model.py), each scraped on its own, keyed by served name;
    a replica is then the sum of its models (``model``: that one model only)."""

    def __init__(self, session: ServiceSession, st: ServiceStatus, model: str | None = None) -> None:
        self.session, self.rec, self.targets = session, st.record, serving(st)
        if model is not None:
            pick(self.rec, model)  # an unknown model, or a one-model service: one line, exit 2
        self.models = model_servers(self.rec, self.targets, model) if self.rec.models else []
        if model is not None and not self.models:
            raise ServerFailed(f"model {model} of service {self.rec.name} is not serving now (`pbstk status "
                               f"{self.rec.name}` shows its state)")
        if self.rec.models:  # the replicas holding the models picked
            self.targets = [(i, js) for i, js in self.targets if any(m.replica == i for m in self.models)]

    def keys(self, job: str) -> list[str]:
        """The scrapes that make up replica ``job``: its models' served names, or the job itself."""
        return [m.served for m in self.models if m.status.record.job_id == job] if self.rec.models else [job]

    def take(self) -> _Round:
        from pbs_toolkit.perf.scrape import scrape, scrape_at

        snaps, errors = {}, {}
        for key, js, host, port in ([(m.served, m.status, m.host, m.port) for m in self.models] if self.rec.models
                                    else [(js.record.job_id, js, None, None) for _, js in self.targets]):
            runner = self.session.runner(js.record.transport)
            try:
                snaps[key] = (scrape(runner, js) if host is None or port is None
                              else scrape_at(runner, host, port, api_key=js.record.api_key))
            except PbstkError as exc:  # a replica that went away: named, the others still summed
                errors[key] = exc.message
        router, router_error = None, None
        try:
            router = scrape_router(self.session.runner(self.rec.transport), self.rec)
        except PbstkError as exc:
            router_error = exc.message
        return _Round(time.time(), snaps, errors, router, router_error)

    def look(self, prev: _Round, cur: _Round, window: bool) -> ServiceMetrics:
        """``window``: latencies over the interval (``--watch``); else since start, with rates from ``prev``."""
        replicas = []
        for index, js in self.targets:
            job, keys = js.record.job_id, self.keys(js.record.job_id)
            missing = [k for k in keys if k not in cur.snaps]
            if missing or not keys:
                replicas.append({"replica": index, "job_id": job,
                                 "error": "; ".join(cur.errors.get(k, "not scraped") for k in missing or [job])})
                continue
            before = combine([prev.snaps[k] for k in keys]) if all(k in prev.snaps for k in keys) else None
            replicas.append({"replica": index, "job_id": job,
                             **_summary(before, combine([cur.snaps[k] for k in keys]), window)})
        models = None
        if self.rec.models:
            models = [{"model": served, "replica": index, "job_id": js.record.job_id,
                       **({"error": cur.errors.get(served, "not scraped")} if served not in cur.snaps
                          else _summary(prev.snaps.get(served), cur.snaps[served], window))}
                      for index, js, served, _, _ in self.models]
        both = [key for key in cur.snaps if key in prev.snaps]
        aggregate = _summary(combine([prev.snaps[k] for k in both]), combine([cur.snaps[k] for k in both]), window)
        aggregate["replicas"] = len({js.record.job_id for _, js in self.targets
                                     if all(k in both for k in self.keys(js.record.job_id))})
        if models is not None:
            aggregate["models"] = len(both)
        router = router_summary(prev.router, cur.router, window) if cur.router is not None else None
        return ServiceMetrics(self.rec.name, cur.timestamp, replicas, aggregate, router, cur.router_error, models)


def _summary(prev: MetricsSnapshot | None, cur: MetricsSnapshot, window: bool) -> dict[str, Any]:
    """``Client.metrics``'s summary (one-shot: latencies since start, rates over the interval) or
    ``watch_metrics``'s (everything over the interval)."""
    summary = summarize(prev if window else None, cur)
    if not window:
        summary["rates"] = rates(prev, cur) if prev is not None and cur.timestamp > prev.timestamp else None
    return summary


def metrics(session: ServiceSession, st: ServiceStatus, interval: float = 1.0,
            model: str | None = None) -> ServiceMetrics:
    """Two scrapes of every serving replica (``model``: of that model only) and the router, ``interval`` s
    apart."""
    scraper = _Scraper(session, st, model)
    prev = scraper.take()
    time.sleep(interval)
    return scraper.look(prev, scraper.take(), window=False)


def watch_metrics(session: ServiceSession, st: ServiceStatus, every: float = 5.0,
                  count: int = 0, model: str | None = None) -> Iterator[ServiceMetrics]:
    """A look every ``every`` s over the interval since the one before; ``count`` looks (0: until stopped). The
    replicas are looked up again after a scrape failed (a handover replaced one)."""
    scraper = _Scraper(session, st, model)
    prev = scraper.take()
    looks = 0
    while not count or looks < count:
        time.sleep(every)
        cur = scraper.take()
        looks += 1
        yield scraper.look(prev, cur, window=True)
        if cur.errors:
            from pbs_toolkit.services.record import find
            from pbs_toolkit.services.status import look

            scraper = _Scraper(session, look(session, find(session.store, st.record.name)), model)
            cur = scraper.take()
        prev = cur


# -- doctor ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceDiagnosis:
    """``doctor NAME``: the router's and keeper's findings, then each replica's diagnosis."""

    name: str
    state: str
    router: dict[str, Any]
    findings: list[Finding]
    replicas: list[tuple[int, Diagnosis]]

    def to_dict(self) -> dict[str, Any]:
        """A ``service_diagnosis`` object (``doctor NAME --json``, docs/json.md)."""
        from pbs_toolkit.schema import stamp

        return stamp("service_diagnosis", {
            "name": self.name, "state": self.state, "router": self.router,
            "findings": [f.to_dict() for f in self.findings],
            "replicas": [{"replica": k, **d.to_dict()} for k, d in self.replicas]})


def doctor(session: ServiceSession, st: ServiceStatus, job_doctor: Callable[[JobStatus | str], Diagnosis],
           replica: int | None = None) -> ServiceDiagnosis:
    """Findings about the router (running, its workers against the serving replicas, their health) and the
    keeper, and ``job_doctor`` (``Client.doctor``) on each replica's job (``replica``: that one only), without
    the findings' relaunch commands."""
    rec = st.record
    by_id = {s.record.job_id: s for s in st.replicas}
    indexes = [replica] if replica is not None else [slot.index for slot in rec.slots]
    diagnoses = []
    for k in indexes:
        d = job_doctor(by_id.get(replica_job(rec, k)) or replica_job(rec, k))
        # a replica comes back through the keeper or `pbstk serve`, never a `pbstk launch` of its own
        diagnoses.append((k, replace(d, findings=[replace(f, relaunch=None) for f in d.findings])))
    router, findings = _router_findings(session, st)
    return ServiceDiagnosis(rec.name, st.state, router, findings, diagnoses)


def _router_findings(session: ServiceSession, st: ServiceStatus) -> tuple[dict[str, Any], list[Finding]]:
    from pbs_toolkit.perf.doctor import Finding
    rec = st.record
    router: dict[str, Any] = {"running": st.router_running, "url": rec.url, "keeper_running": st.keeper_running,
                              "workers": None}
    findings = []
    if rec.ended is not None:
        return router, [Finding("service-ended", "high", f"the service is {st.state}", f"ended at "
                                f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(rec.ended))}",
                                f"start a new one with `pbstk serve {rec.model} --name {rec.name} ...`")]
    if not st.router_running:
        findings.append(Finding("router-down", "high", "the router is not running", f"service state {st.summary}; "
                                f"router log: {router_log(rec) if rec.router or rec.router_job else '-'}",
                                f"`pbstk logs {rec.name}` shows why; `pbstk cancel {rec.name}` and serve again"))
    if not st.keeper_running:
        findings.append(Finding("keeper-down", "high", "the keeper is not running", "no keeper holds its lock",
                                f"`pbstk service resume {rec.name}` (replicas are not added or removed meanwhile)"))
    if st.router_running:
        try:
            snap = scrape_router(session.runner(rec.transport), rec)
        except PbstkError as exc:
            router["error"] = exc.message
        else:
            router["workers"] = [{"url": url, **w} for url, w in sorted(snap.workers.items())]
            expected = {u for _, js in serving(st) if (u := health.worker_url(js))}
            findings += worker_findings(rec.name, snap, expected)
    return router, findings


def worker_findings(name: str, snap: RouterSnapshot, expected: set[str]) -> list[Finding]:
    from pbs_toolkit.perf.doctor import Finding

    out = []
    missing = sorted(expected - set(snap.workers))
    if missing:
        out.append(Finding("replica-not-routed", "medium", "a READY replica is not among the router's workers",
                           f"not routed to: {', '.join(missing)}",
                           f"the keeper adds it on its next look (PBSTK_SERVICE_POLL_S); if it stays out, "
                           f"see {name}'s keeper.log"))
    for url, w in sorted(snap.workers.items()):
        if w.get("healthy") is False or w.get("circuit") in ("open", "half_open"):
            out.append(Finding("worker-unhealthy", "high", f"the router does not route to {url}",
                               f"health check {'failing' if w.get('healthy') is False else 'ok'}, circuit "
                               f"{w.get('circuit', '?')}", "see that replica's log (`pbstk logs NAME --replica K`)"))
    return out


# -- bench -------------------------------------------------------------------------------------------------


def bench_status(st: ServiceStatus) -> JobStatus:
    """A READY status at the router's address: the service's key and name, and a serving replica's run directory
    (its 0600 key file) and Python environment, where ``vllm bench serve`` runs and saves its result."""
    from pbs_toolkit.services.entry import service_job_status

    rec = st.record
    base = service_job_status(rec)
    replica = serving(st)[0][1].record
    record = replace(base.record, run_dir=replica.run_dir, spec=replica.spec, model=replica.model)
    return replace(base, record=record)
