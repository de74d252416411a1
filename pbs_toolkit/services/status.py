"""What ``status NAME`` shows of a service (its state, each replica's status, router and keeper), and waiting
for it to be READY: one status query over the service's jobs, the router asked for its workers and a request
with the key (services/ready.py says what counts as ready)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import JobNotFound, PbstkError, ServerFailed, WaitTimeout
from pbs_toolkit.schema import stamp
from pbs_toolkit.services import record as records
from pbs_toolkit.services import restarts
from pbs_toolkit.services.health import ready
from pbs_toolkit.services.keeper_process import keeper_alive, last_tick, poll_seconds
from pbs_toolkit.services.multi import model_rows
from pbs_toolkit.services.ready import RouteCheck, check_route, looks_routable, routable_count, still_starting
from pbs_toolkit.services.record import ServiceRecord
from pbs_toolkit.services.scaler import status_fields
from pbs_toolkit.services.state import ServiceState, service_state

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.session import ServiceSession

#: a running keeper whose last successful tick is older than 3 polls plus this is reported as making no progress
STUCK_GRACE_S = 120.0
#: seconds between two cheap looks at the router while ``wait`` waits (no scheduler query)
ROUTE_POLL_S = 0.25


@dataclass
class ServiceStatus:
    record: ServiceRecord
    state: ServiceState
    ready: int
    replicas: list[JobStatus]
    keeper_running: bool
    router_running: bool
    #: ``router: job``: the router job's scheduler state (``running``, ``queued``, ...; ``gone`` when unknown)
    router_job_state: str | None = None
    #: what the router said (its workers, a request with the key through it); ``None``: not asked (not running)
    route: RouteCheck | None = None
    #: the keeper's heartbeat (services/keeper.py ``last_tick``): ``ok_at``, ``error``, ``error_at``, ``failures``
    keeper_tick: dict[str, Any] = field(default_factory=dict)
    #: a service whose models swap: each running job's ``swap.json`` (its swapper's view), by job id
    swaps: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: an ended multi-model service: each job's final state as the job store recorded it, by job id
    finals: dict[str, str] = field(default_factory=dict)

    @property
    def keeper_stuck(self) -> str | None:
        """Why the keeper, though running, is not making progress (its last ticks failed), or ``None``."""
        tick = self.keeper_tick
        if not self.keeper_running or not tick:
            return None
        age = time.time() - tick["ok_at"] if tick.get("ok_at") else None
        since = f"last successful tick {age:.0f} s ago" if age is not None else "no successful tick yet"
        if tick.get("error"):
            return f"{since}, {tick.get('failures') or 1} failed since: {tick['error']}"
        if age is not None and age > 3 * poll_seconds() + STUCK_GRACE_S:  # a tick that hangs (a hung query, a tunnel)
            return f"{since}, none since"
        return None

    @property
    def url(self) -> str | None:
        return self.record.url

    @property
    def summary(self) -> str:
        """``READY 3/4 replicas``; a multi-model service: ``READY 3/3 models``"""
        if self.record.models:
            rows = self.models
            return f"{self.state} {sum(m['state'] == 'READY' for m in rows)}/{len(rows)} models"
        return f"{self.state} {self.ready}/{self.record.replicas} replicas"

    @property
    def models(self) -> list[dict[str, Any]]:
        """A multi-model service's rows, one per model (services/multi.py ``model_rows``); none for one model.
        A row is READY only when its server is among the router's workers that requests reach, the facts the
        service's line counts."""
        if not self.record.models:
            return []
        routed = self.route.routed if self.route is not None else []
        return model_rows(self.record, {s.record.job_id: s for s in self.replicas}, self.swaps, routed, self.finals)

    def to_dict(self) -> dict[str, Any]:
        """A ``service`` object (docs/json.md): no key in it."""
        rec = self.record
        return stamp("service", {
            "name": rec.name, "model": rec.model, "served_model_name": rec.served_model_name,
            "profile": rec.profile, "transport": rec.transport or "local", "state": self.state,
            "ready": self.ready, "replicas": rec.replicas, "url": rec.url, "keep_alive": rec.keep_alive,
            "handover_s": rec.handover_s, "policy": rec.policy, "created": rec.created, "ended": rec.ended,
            "keeper_running": self.keeper_running, "router_running": self.router_running,
            "keeper": {"last_tick": self.keeper_tick.get("ok_at"), "error": self.keeper_tick.get("error"),
                       "error_at": self.keeper_tick.get("error_at"), "failures": self.keeper_tick.get("failures", 0)},
            "router": {k: v for k, v in rec.router.items() if k not in ("token", "admin_token")},
            "router_job": {**rec.router_job, "state": self.router_job_state} if rec.router_job else None,
            "router_workers": self.route.workers if self.route is not None else None,
            "route_status": self.route.status if self.route is not None else None,
            "slots": [asdict(s) for s in rec.slots], **status_fields(rec), "lease_s": rec.lease_s or None,
            "restart_policy": restarts.RestartPolicy.from_dict(rec.restart).to_dict(),
            "restart_stopped": restarts.reason(rec), "jobs": [s.to_dict() for s in self.replicas],
            **({"models": self.models} if rec.models else {}),
        })


def look(session: ServiceSession, rec: ServiceRecord, known: Mapping[str, JobStatus] | None = None) -> ServiceStatus:
    """One status query over the service's jobs, the router and the keeper: what ``status NAME`` shows.
    ``known``: statuses already taken in a larger batch (``Client.service_statuses``): no query of its own."""
    from pbs_toolkit.services.router import RouterInfo, router_alive

    jobs = [j for s in rec.slots for j in s.jobs()]
    if known is not None:
        statuses = [known[j] for j in jobs if j in known] if rec.ended is None else []
    else:
        statuses = session.status(_recorded(session, jobs)) if jobs and rec.ended is None else []
    router, job_state = False, None
    if rec.router_job and rec.ended is None:
        router, job_state = _router_job_alive(session, rec)
    elif rec.router and rec.ended is None:
        try:
            router = router_alive(session.runner(rec.transport), RouterInfo.from_dict(rec.router))
        except PbstkError:
            router = False
    route = None
    if router:  # READY means routable: the router lists the replica and a request with the key gets through
        try:
            route = check_route(session, rec)
        except PbstkError:
            route = RouteCheck(None, None)
    workers = route.routed if route is not None else []
    by_id = {st.record.job_id: st for st in statuses}
    ready = routable_count(rec.slots, by_id, workers) if rec.ended is None else 0
    if ready >= rec.replicas:
        rec.ever_ready = True
    state = service_state(rec, ready, still_starting(rec.slots, by_id, workers))
    if rec.ended is None and not router and rec.router:
        state = ServiceState.DOWN  # and 0/N: nothing is reachable through the URL
    running = keeper_alive(rec.name) if rec.ended is None else False
    out = ServiceStatus(rec, state, ready, statuses, running, router, job_state, route,
                        keeper_tick=last_tick(rec.name) if running else {}, swaps=_swaps(session, rec, statuses),
                        finals=_finals(session, rec))
    if rec.models and rec.ended is None and out.state != ServiceState.DOWN:
        out.state = _models_state(rec, out.models)  # the line counts what the rows show: one set of facts
    return out


def _models_state(rec: ServiceRecord, rows: Sequence[dict[str, Any]]) -> ServiceState:
    """A multi-model service's state from its model rows (``READY 2/3 models``): READY only with every model's
    server routable, STARTING while one not yet is on its way, DEGRADED or DOWN as for replicas."""
    from pbs_toolkit.jobs.status_types import ServerState

    up = sum(r["state"] == "READY" for r in rows)
    starting = any(r["state"] != "READY" and not ServerState(r["state"]).final for r in rows)
    return service_state(rec, up, starting, wanted=len(rows))


def _finals(session: ServiceSession, rec: ServiceRecord) -> dict[str, str]:
    """An ended multi-model service's jobs' final states as the job store recorded them (no scheduler query)."""
    if rec.ended is None or not rec.models:
        return {}
    jobs = {j for s in rec.slots for j in s.jobs()}
    return {r.job_id: r.final_state for r in session.store.all() if r.job_id in jobs and r.final_state}


def _swaps(session: ServiceSession, rec: ServiceRecord, statuses: Sequence[JobStatus]) -> dict[str, dict[str, Any]]:
    """Each running job's ``swap.json`` (written by its swapper, docs/multi-model.md "Swapping"), by job id; none
    for a service whose models do not swap. A file not there (yet) or unreadable is left out."""
    if not any(m.get("swap") for m in rec.models):
        return {}
    out = {}
    for st in statuses:
        if not ready(st):
            continue
        try:
            data = json.loads(session.runner(rec.transport).read_bytes(f"{st.record.run_dir}/swap.json"))
        except (OSError, ValueError, PbstkError):
            continue
        if isinstance(data, dict) and isinstance(data.get("models"), dict):
            out[st.record.job_id] = data
    return out


def _recorded(session: ServiceSession, jobs: list[str]) -> list[Any]:
    """The records of ``jobs`` the store knows (one cleaned away or lost is shown as missing, not an error)."""
    by_id = {r.job_id: r for r in session.store.all()}
    return [by_id[j] for j in jobs if j in by_id]


def _router_job_alive(session: ServiceSession, rec: ServiceRecord) -> tuple[bool, str | None]:
    """(router running, the router job's state): the job runs and its router answers."""
    from pbs_toolkit.schedulers import SchedState
    from pbs_toolkit.services import router_job
    from pbs_toolkit.services.router import RouterInfo

    if not rec.router_job.get("job_id"):
        return False, "submitting"  # its submission was interrupted: `pbstk cancel NAME` settles it
    try:
        seen = router_job.query(session, rec)
    except PbstkError:
        return False, None  # the scheduler did not answer: unknown, shown as not running
    if seen is None:
        return False, "gone"
    if seen.state != SchedState.RUNNING or not rec.router:
        return False, seen.state.value
    return router_job.router_answers(session, RouterInfo.from_dict(rec.router)), seen.state.value


def _with_models(rec: ServiceRecord, stopped: str) -> str:
    """``stopped`` (restarts.reason) naming the models of a multi-model service's stopped jobs too."""
    if not rec.models:
        return stopped
    gone = {s.index for s in restarts.stopped_slots(rec)}
    names = [m["served_model_name"] for m in rec.models if m["job"] - 1 in gone]
    return f"{stopped} (model(s) {', '.join(names)})" if names else stopped


def look_all(session: ServiceSession, services: Sequence[ServiceRecord], jobs: Sequence[JobRecord] = ()
             ) -> tuple[list[ServiceStatus], list[JobStatus]]:
    """``look`` at each service and ``status`` of ``jobs`` from one scheduler query per transport: every active
    service's replica jobs join the jobs' batch (``status`` promises one query per call)."""
    wanted = {r.job_id for r in jobs}
    extra: list[JobRecord] = []
    for rec in services:
        for job in [j for s in rec.slots for j in s.jobs()] if rec.ended is None else []:
            try:
                record = session.store.find(job)
            except JobNotFound:
                continue  # the job store lost it: the service shows it as missing, as look() does
            if record.job_id not in wanted:
                wanted.add(record.job_id)
                extra.append(record)
    statuses = session.status([*jobs, *extra]) if jobs or extra else []
    by_id = {st.record.job_id: st for st in statuses}
    return [look(session, rec, by_id) for rec in services], statuses[:len(jobs)]


def wait(session: ServiceSession, rec: ServiceRecord, timeout: float,
         on_progress: Callable[[ServiceStatus, float], None] | None = None) -> ServiceStatus:
    """Block until the service is READY N/N, routable (``WaitTimeout``; ``ServerFailed`` when the service
    ended or every replica failed). The scheduler is asked on the usual ramp; the router every ``ROUTE_POLL_S``
    in between, and a router with enough workers answering the key is confirmed by one full look at once."""
    from pbs_toolkit.jobs.readiness import scheduler_intervals

    start = time.monotonic()
    intervals = iter(scheduler_intervals())
    step = 1.0
    while True:
        rec = records.load(session.store, rec.name, rec.created) or rec  # the keeper's replacements too
        st = look(session, rec)
        if on_progress is not None:
            on_progress(st, time.monotonic() - start)
        if st.state == ServiceState.READY:
            return st
        stopped = restarts.reason(st.record)
        if st.record.ended is not None or (st.replicas and all(j.state.final for j in st.replicas) and (
                not st.keeper_running or not restarts.may_heal(st.record))):
            raise ServerFailed(f"service {st.record.name} is {st.state}: no replica can become ready"
                               + (f": {stopped}" if stopped else f" (`pbstk status {st.record.name}` shows each)"))
        if stopped:  # a planned job failed for good: READY n/N can never come, so waiting on is waiting in vain
            raise ServerFailed(f"service {st.record.name} is {st.summary} and cannot become READY: "
                               f"{_with_models(st.record, stopped)}")
        if time.monotonic() - start > timeout:
            causes = "; ".join(restarts.slot_text(s) for s in st.record.slots if s.last_failure)
            raise WaitTimeout(f"service {st.record.name} is {st.summary} after {timeout:g} s"
                              + (f" ({causes})" if causes else ""))
        step = next(intervals, step)
        until = min(time.monotonic() + step, start + timeout + 0.01)
        while time.monotonic() < until:
            time.sleep(ROUTE_POLL_S)
            if st.router_running and looks_routable(session, rec):
                break
