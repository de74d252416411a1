"""``pbstk usage``: what jobs and services used (docs/campaigns.md "pbstk usage").

Per job: nodes, GPUs and wall time from the scheduler's own accounting (``Scheduler.accounting``: each backend
says which of its sources it read), node- and GPU-hours, and the
server's requests and tokens (live from ``/metrics`` while it serves, else what was recorded before its cancel:
campaigns/counters.py). A service's jobs are its replicas over its whole life (keep-alive successors included:
names ``NAME-rK`` and ``NAME-rK-gG``) and its router job. What the scheduler said about an ended job is kept
in the job's record, so it survives the scheduler forgetting the job; ``pbstk clean`` moves an ended job's
figures into the job store's ledger before it forgets the record (``JobStore.remove``), and ``usage`` reads
records and ledger together, each job once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from pbs_toolkit.campaigns import counters
from pbs_toolkit.campaigns.model_usage import per_model
from pbs_toolkit.errors import JobNotFound, PbstkError, UsageError
from pbs_toolkit.jobs.records import ACCOUNTING_KEY, find_in
from pbs_toolkit.schema import stamp

if TYPE_CHECKING:
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.schedulers.base import Accounting
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.transports import Runner

class UsageSource(Protocol):
    """What ``usage`` reads through (``Client`` is one): the job store, runners, jobs and services by name."""

    @property
    def store(self) -> JobStore: ...
    def runner(self, transport: str) -> Runner: ...
    def record(self, ref: str) -> JobRecord: ...
    def service(self, ref: str | None) -> ServiceRecord | None: ...
    def services(self, all: bool = False) -> list[ServiceRecord]: ...  # noqa: A002


#: the figures every row and total carries, in table order
FIGURES = ("nodes", "gpus", "walltime_s", "node_hours", "gpu_hours", "requests", "prompt_tokens",
           "output_tokens", "output_tokens_per_gpu_hour")


@dataclass
class UsageRow:
    """One job: a plain job, a service's replica (``service`` set, ``kind`` ``replica``) or its router job."""

    job_id: str
    name: str
    kind: str = "job"
    service: str | None = None
    scheduler: str = ""
    transport: str = ""
    #: the scheduler's accounting says the job has ended (its figures are final)
    ended: bool = False
    nodes: int | None = None
    gpus: int | None = None
    walltime_s: float | None = None
    #: where ``walltime_s`` came from, in the backend's words (``Accounting.source``; docs/campaigns.md lists
    #: them), or ``None`` (nobody could say)
    walltime_source: str | None = None
    requests: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    #: ``live`` (scraped now), ``recorded`` (scraped before the cancel) or ``None``
    counters_source: str | None = None

    @property
    def node_hours(self) -> float | None:
        return _hours(self.walltime_s, self.nodes)

    @property
    def gpu_hours(self) -> float | None:
        return _hours(self.walltime_s, self.gpus)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(transport=self.transport or "local", node_hours=_round(self.node_hours),
                    gpu_hours=_round(self.gpu_hours), walltime_s=_round(self.walltime_s, 1),
                    output_tokens_per_gpu_hour=per_gpu_hour(self.output_tokens, self.gpu_hours))
        return data


@dataclass
class Totals:
    """Sums over rows: ``None`` only when no row knew the figure."""

    label: str
    rows: list[UsageRow] = field(default_factory=list)
    #: a multi-model service's per-model part (campaigns/model_usage.py ``per_model``); ``None``: one model
    models: list[dict[str, Any]] | None = None

    def total(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.rows if getattr(r, name) is not None]
        return sum(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: self.total(name) for name in ("nodes", "gpus", "walltime_s", "requests",
                                                                     "prompt_tokens", "output_tokens")}
        gpu_hours = self.total("gpu_hours")
        data.update(node_hours=_round(self.total("node_hours")), gpu_hours=_round(gpu_hours),
                    walltime_s=_round(data["walltime_s"], 1), jobs=len(self.rows),
                    output_tokens_per_gpu_hour=per_gpu_hour(data["output_tokens"], gpu_hours))
        return data


@dataclass
class UsageReport:
    jobs: list[UsageRow]
    services: list[Totals]
    totals: Totals
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return stamp("usage", {
            "jobs": [r.to_dict() for r in self.jobs],
            "services": [{"service": s.label, **s.to_dict(), **({"models": s.models} if s.models is not None else {})}
                         for s in self.services],
            "totals": self.totals.to_dict(),
            "notes": list(self.notes),
        })


def _hours(seconds: float | None, count: int | None) -> float | None:
    return None if seconds is None or count is None else seconds * count / 3600.0


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def per_gpu_hour(tokens: float | None, gpu_hours: float | None) -> float | None:
    """Output tokens per GPU-hour; ``None`` without tokens or GPU time (a CPU server has no GPU-hours)."""
    if tokens is None or not gpu_hours:
        return None
    return round(tokens / gpu_hours, 1)


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a date (``2026-11-25``), a date and time (``2026-11-25T10:00``, ``2026-11-25 10:00:00``,
    local time) or an age (``90m``, ``12h``, ``7d``, ``2w``) -> epoch seconds."""
    from pbs_toolkit.durations import parse, seconds_of

    value = text.strip()
    if seconds_of(value, bare=False) is not None:
        return (time.time() if now is None else now) - parse(value, "--since", zero=True, bare=False)
    try:
        return datetime.fromisoformat(value.replace(" ", "T", 1)).timestamp()
    except ValueError:
        raise UsageError(f"--since {text!r}: expected a date (2026-11-25), a date and time (2026-11-25T10:00) "
                         "or an age (12h, 7d)") from None


def service_jobs(records: Sequence[JobRecord], svc: ServiceRecord) -> list[JobRecord]:
    """The replica jobs ``svc`` launched over its life (keep-alive successors too), oldest first."""
    pattern = re.compile(rf"{re.escape(svc.name)}-r\d+(-g\d+)?")
    end = svc.ended if svc.ended is not None else float("inf")
    return sorted((r for r in records if r.transport == svc.transport and pattern.fullmatch(r.name)
                   and svc.created - 1 <= r.created <= end), key=lambda r: r.created)


def _launch_nodes(record: JobRecord) -> int:
    """Nodes the job asked for (``--nodes``), 1 when it did not say."""
    options = list(record.spec.options)
    for flag, value in zip(options, options[1:]):
        if flag == "--nodes" and value.isdigit():
            return int(value)
    return 1


def row_of(record: JobRecord, kind: str = "job", service: str | None = None) -> UsageRow:
    """The row of a recorded job before accounting and counters: what its launch asked for."""
    return UsageRow(job_id=record.job_id, name=record.name, kind=kind, service=service, scheduler=record.scheduler,
                    transport=record.transport, nodes=_launch_nodes(record),
                    gpus=record.spec.gpus)


def _apply(row: UsageRow, acct: Accounting | dict[str, Any] | None) -> None:
    if acct is None:
        return
    data = acct if isinstance(acct, dict) else asdict(acct)
    row.walltime_s, row.walltime_source, row.ended = data.get("walltime_s"), data.get("source"), bool(data.get("final"))
    row.nodes = data.get("nodes") or row.nodes
    row.gpus = data.get("gpus") if data.get("gpus") is not None else row.gpus


def collect(client: UsageSource, refs: Sequence[str], since: float | None = None,
            warn: Callable[[str], None] | None = None) -> UsageReport:
    """The usage of ``refs`` (job ids or names, service names; none: every job and service in the store, those
    created at or after ``since`` when it is given)."""
    records = with_ledger(client.store)
    services, jobs = [], []
    if refs:
        for ref in refs:
            svc = client.service(ref)
            if svc is not None:
                services.append(svc)
            else:
                jobs.append(_job(client, ref))  # JobNotFound: exit 7, nothing queried yet
    else:
        services = [s for s in client.services(all=True) if since is None or s.created >= since]
    rows: list[UsageRow] = []
    groups: list[Totals] = []
    owned: set[tuple[str, str]] = set()
    plan: list[tuple[UsageRow, JobRecord | None, dict[str, Any] | None]] = []
    for svc in services:
        group = Totals(svc.name)
        for record in service_jobs(records, svc):
            owned.add((record.transport, record.job_id))
            plan.append((row := row_of(record, "replica", svc.name), record, None))
            group.rows.append(row)
        router = svc.router_job
        if router and router.get("job_id"):
            row = UsageRow(job_id=router["job_id"], name=router.get("name") or f"{svc.name}-router", kind="router",
                           service=svc.name, scheduler=router.get("scheduler") or svc.scheduler,
                           transport=svc.transport, nodes=1, gpus=0)
            plan.append((row, None, router))
            group.rows.append(row)
        groups.append(group)
    if not refs:
        jobs = [r for r in records if (r.transport, r.job_id) not in owned
                and not _is_service_job(r, services) and (since is None or r.created >= since)]
        jobs.sort(key=lambda r: r.created)
    for record in jobs:
        plan.append((row_of(record), record, None))
    notes: list[str] = []
    _account(client, plan, notes)
    for row, known, _ in plan:
        if known is not None:
            _count(client, row, known)
        if row.service is None:
            rows.append(row)
    _models(client, services, groups, plan)
    everything = [r for g in groups for r in g.rows] + rows
    return UsageReport(jobs=everything, services=groups, totals=Totals("total", everything), notes=notes)


def _models(client: UsageSource, services: Sequence[ServiceRecord], groups: Sequence[Totals],
            plan: Sequence[tuple[UsageRow, JobRecord | None, dict[str, Any] | None]]) -> None:
    """Each multi-model service's per-model part of its jobs (campaigns/model_usage.py)."""
    for svc, group in zip(services, groups):
        if svc.models:
            jobs_of = [(row, known) for row, known, _ in plan if row.service == svc.name and known is not None]
            group.models = per_model(svc, jobs_of, client.runner)


def with_ledger(store: JobStore) -> list[JobRecord]:
    """Every job's record, then the ledger's compact records of jobs ``pbstk clean`` forgot (each job once)."""
    records = store.all()
    known = {(r.transport, r.job_id) for r in records}
    return records + [r for r in store.ledger() if (r.transport, r.job_id) not in known]


def _job(client: UsageSource, ref: str) -> JobRecord:
    """A job by id, id prefix or name, as ``client.record`` finds it; one that ``clean`` forgot, in the ledger."""
    try:
        return client.record(ref)
    except JobNotFound:
        forgotten = client.store.ledger()  # newest first, as the store's records
        if not forgotten:
            raise
        return find_in(forgotten, ref)


def keep_final_accounting(client: UsageSource, records: Sequence[JobRecord]) -> None:
    """Ask the schedulers once for the accounting of ``records`` (ended jobs ``clean`` is about to forget) and
    keep each final answer in its record, so that the ledger holds the wall time the run directory will no
    longer tell. A scheduler that does not answer leaves its jobs without one, as ``usage`` would."""
    _account(client, [(row_of(r), r, None) for r in records], [])


def _is_service_job(record: JobRecord, services: Sequence[ServiceRecord]) -> bool:
    return any(re.fullmatch(rf"{re.escape(s.name)}-r\d+(-g\d+)?", record.name) for s in services)


def _account(client: UsageSource, plan: list[tuple[UsageRow, JobRecord | None, dict[str, Any] | None]],
             notes: list[str]) -> None:
    """Fill walltime, nodes and GPUs: kept accounting of ended jobs first, then one accounting call per
    transport and scheduler for the rest (an ended job's answer is kept for next time)."""
    from pbs_toolkit.schedulers import JobRef, get_scheduler

    asked: dict[tuple[str, str], list[tuple[UsageRow, JobRecord | None, JobRef]]] = {}
    for row, record, job in plan:
        kept = record.extra.get(ACCOUNTING_KEY) if record is not None else None
        if isinstance(kept, dict):
            _apply(row, kept)
            continue
        run_dir = record.run_dir if record is not None else str((job or {}).get("run_dir") or "")
        asked.setdefault((row.transport, row.scheduler), []).append((row, record, JobRef(row.job_id, run_dir)))
    for (transport, scheduler), items in asked.items():
        try:
            found = get_scheduler(scheduler).accounting(client.runner(transport), [ref for *_, ref in items])
        except PbstkError as exc:
            notes.append(f"{scheduler} via {transport or 'this machine'}: no accounting ({exc.message})")
            continue
        for row, record, ref in items:
            acct = found.get(ref.job_id)
            _apply(row, acct)
            if acct is not None and record is not None and acct.final:
                client.store.update_extra(record, **{ACCOUNTING_KEY: asdict(acct)})


def _count(client: UsageSource, row: UsageRow, record: JobRecord) -> None:
    """Requests and tokens: live while the server answers, else what was recorded before its cancel."""
    ended = record.final_state or row.ended
    values = counters.scrape(client.runner(record.transport), record) if not ended else None
    source = "live"
    if values is None:
        values, source = counters.recorded(record), "recorded"
    if values is None:
        return
    row.requests, row.prompt_tokens, row.output_tokens = (values.get(k) for k in counters.FIELDS)
    row.counters_source = source
