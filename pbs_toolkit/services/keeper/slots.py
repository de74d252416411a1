"""The keeper's work on one replica slot in a tick (services/keeper/loop.py runs the ticks): the router's worker list
kept true to the slot's jobs (services/health.py decides who is routable and who leaves), the hand-over from a
predecessor to its READY successor, the drain and cancel of the predecessor, the replacement of an ended job under
the restart policy (services/keeper/restarts.py), and the sweep of workers that are none of the service's jobs."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.services import health
from pbs_toolkit.services.health import worker_url
from pbs_toolkit.services.keeper import restarts
from pbs_toolkit.services.keeper.process import keeper_log
from pbs_toolkit.services.manage import launch_replica
from pbs_toolkit.services.models.multi import add_workers, label, remove_workers, served_names, worker_urls
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.transports.http import held_requests

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.router.process import RouterAdmin
    from pbs_toolkit.services.session import ServiceSession

#: a drained predecessor is looked at no sooner than this after leaving the router (requests in flight)
DRAIN_MIN_S = 2.0


def drain_seconds() -> float:
    """``PBSTK_SERVICE_DRAIN_S``: the most a predecessor is drained before it is cancelled (default 60)."""
    return env_float("PBSTK_SERVICE_DRAIN_S", 60.0, lambda v: 0 <= v <= 86400)


def _sync_router(rec: ServiceRecord, slot: Slot, st: JobStatus | None, admin: RouterAdmin,
                 in_router: set[str]) -> None:
    """READY and not in the router (a multi-model job: some model's worker not in it): add; in the router:
    removed, every model's worker, when services/health.py says it must leave (its job ended, or several failed
    looks in a row), kept otherwise."""
    url = worker_url(st) if st is not None else None
    if st is None or url is None:
        return
    urls = worker_urls(st)
    if health.ready(st) and any(u not in in_router for u in urls):
        added = add_workers(rec, st, url, admin, in_router)  # a multi-model job's other models too
        keeper_log(f"added {st.record.job_id} ({label(added, _names(rec, slot, st))}) to the router")
    elif any(u in in_router for u in urls):
        why = health.leave_router(rec, st, time.time())
        if why is not None:
            gone = remove_workers(urls, admin, in_router)
            keeper_log(f"removed {st.record.job_id} ({label(gone, _names(rec, slot, st))}) from the router: {why}")
        elif st.record.job_id in rec.health:
            looks = rec.health[st.record.job_id]["looks"]
            keeper_log(f"kept {st.record.job_id} ({url}) in the router: {st.state.value} ({st.phase or st.reason}), "
                       f"failed look {looks} of {health.unhealthy_looks(rec)} over {health.unhealthy_seconds(rec):g} s")


def remove_foreign(jobs: list[str], statuses: dict[str, JobStatus], admin: RouterAdmin,
                   in_router: set[str], own: Collection[str] = ()) -> None:
    """Remove every worker that is none of the service's jobs. The router's admin API has no authentication
    (docs/services.md "Who can reach the router"): behind pbstk's front only the owner reaches it, but with
    ``router_isolation: none`` whoever reaches its port can add a worker of theirs, which would then receive
    prompts with the service's key (this sweep does not stop one re-added every 50 ms: the front does).
    ``own``: the worker URLs the slots recorded for their jobs (a job recorded final has no address in its
    status any more, and is still no stranger). Skipped in a tick where the scheduler did not answer for some
    job (its worker could be one of those)."""
    if any(job not in statuses or statuses[job].state is ServerState.UNKNOWN for job in jobs):
        return
    ours = {url for st in statuses.values() for url in worker_urls(st)} | set(own)
    for url in sorted(in_router - ours):
        admin.remove_worker(url)
        in_router.discard(url)
        keeper_log(f"removed {url} from the router: not a replica of this service (added by someone else)")


def reconcile(session: ServiceSession, rec: ServiceRecord, slot: Slot, statuses: dict[str, JobStatus],
              admin: RouterAdmin, in_router: set[str]) -> None:
    """One tick of one slot: its jobs join or leave the router, a READY successor takes over, a drained
    predecessor is cancelled, an ended job is replaced, and a successor is launched in time for the handover."""
    cur = statuses.get(slot.current) if slot.current else None
    suc = statuses.get(slot.successor) if slot.successor else None
    # the successor takes over one tick after it joined the router, not in the tick that added it: removing the
    # predecessor right after /add_worker left the router with no usable worker for an instant (two 503s seen
    # under load in tests/test_service.py's handover)
    joined = suc is not None and bool(worker_urls(suc)) and all(u in in_router for u in worker_urls(suc))
    _remember_urls(rec, slot, cur, suc)
    _sync_router(rec, slot, cur, admin, in_router)
    _sync_router(rec, slot, suc, admin, in_router)
    if suc is not None and health.ready(suc) and joined:
        _hand_over(rec, slot, cur, suc, admin, in_router)
        cur, suc = suc, None
    drain(session, slot, statuses)
    slot.state = cur.state.value if cur is not None else "LOST"
    if cur is None or cur.state.final:
        _leave_router(slot, cur, admin, in_router)
        _replace(session, rec, slot, cur, suc)
    elif (rec.keep_alive and slot.successor is None and not slot.launching and cur.uptime_s is not None
          and cur.walltime_s):
        begin = time.time() - cur.uptime_s + cur.walltime_s - rec.handover_s
        launch_replica(session, rec, slot, "successor", begin_at=begin if begin > time.time() + 1 else None)
        keeper_log(f"slot {slot.index}: successor {slot.successor} of {slot.current} eligible at "
             f"{time.strftime('%H:%M:%S', time.localtime(max(begin, time.time())))}")
    # the URLs of the slot's jobs only: a keep-alive slot, whose current job never ends, hands over every walltime
    slot.urls = {job: url for job, url in slot.urls.items() if job in slot.jobs()}
    slot.model_urls = {job: urls for job, urls in slot.model_urls.items() if job in slot.jobs()}


def _hand_over(rec: ServiceRecord, slot: Slot, cur: JobStatus | None, suc: JobStatus, admin: RouterAdmin,
               in_router: set[str]) -> None:
    """The successor is READY (and in the router, every model's worker): the predecessor leaves the router (every
    model's worker: a multi-model job's successor carries all of them) and starts draining."""
    if cur is not None:
        gone = remove_workers(worker_urls(cur) or slot.known_urls(cur.record.job_id), admin, in_router)
        if gone and rec.models:
            keeper_log(f"removed {cur.record.job_id} ({label(gone, _names(rec, slot, cur))}) from the router")
        if not cur.state.final:
            slot.draining, slot.drain_started = slot.current, time.time()
    keeper_log(f"slot {slot.index}: {suc.record.job_id} took over from {slot.current}")
    slot.current, slot.successor = slot.successor, None


def drain(session: ServiceSession, slot: Slot, statuses: dict[str, JobStatus]) -> None:
    """Cancel the drained predecessor once its server runs no request (or after the drain bound)."""
    if not slot.draining:
        return
    st = statuses.get(slot.draining)
    waited = time.time() - (slot.drain_started or 0)
    if st is not None and not st.state.final:
        if waited < min(DRAIN_MIN_S, drain_seconds()):
            return
        if waited < drain_seconds() and _running(session, st):
            return
        session.cancel(st.record)
        keeper_log(f"slot {slot.index}: drained and cancelled {slot.draining} after {waited:.0f} s")
    slot.draining, slot.drain_started = None, None


def _running(session: ServiceSession, st: JobStatus) -> bool:
    """Whether the server still runs requests (its ``/metrics``; a multi-model job: any of its models' servers,
    and a swapping model's requests held for its sleeping engine, which no metric shows: its guard's count);
    a server that does not answer runs none."""
    from pbs_toolkit.perf.scrape import scrape_at

    runner = session.runner(st.record.transport)
    ports = [st.port, *st.models.values()] if st.models else [st.port]
    key = st.record.api_key
    for port in ports:
        if not st.address or not port:
            continue
        try:
            if scrape_at(runner, st.address, int(port), api_key=key, timeout=3.0).running or (
                    st.models and held_requests(runner, st.address, int(port), key, timeout=3.0)):
                return True
        except PbstkError:
            continue
    return False


def _remember_urls(rec: ServiceRecord, slot: Slot, *seen: JobStatus | None) -> None:
    """Keep each job's worker URL (a multi-model job: every model's, with its served name) in its slot while its
    status has one (a status recorded final has none)."""
    for st in seen:
        if st is not None and (url := worker_url(st)) is not None:
            slot.urls[st.record.job_id] = url
            if rec.models:
                slot.model_urls[st.record.job_id] = served_names(rec, st)


def _names(rec: ServiceRecord, slot: Slot, st: JobStatus) -> dict[str, str]:
    """Worker URL -> served name for the keeper's log of a multi-model job (empty for one model: its lines stay
    as they were)."""
    return {**slot.model_urls.get(st.record.job_id, {}), **served_names(rec, st)} if rec.models else {}


def _leave_router(slot: Slot, cur: JobStatus | None, admin: RouterAdmin, in_router: set[str]) -> None:
    """The current job ended and its status has no address any more (recorded final by an earlier look, or not
    in the store): its recorded URL leaves the router as the service's own ended job, not as a stranger."""
    job = slot.current or ""
    if cur is not None and worker_url(cur) is not None:
        return  # _sync_router already removed it by its status
    gone = remove_workers(slot.known_urls(job), admin, in_router)
    if gone:
        keeper_log(f"removed {job} ({label(gone, slot.model_urls.get(job, {}))}) from the router: "
                   f"{cur.state.value if cur else 'not in the job store'}")


def _replace(session: ServiceSession, rec: ServiceRecord, slot: Slot, cur: JobStatus | None,
             suc: JobStatus | None) -> None:
    """The current job has ended: a successor already starting (or queued past its begin time) takes its place;
    otherwise it failed, and the restart policy (services/keeper/restarts.py) says whether a replacement is launched
    now, after its backoff, or never again (with keep-alive, a successor still waiting for its handover time,
    state W, is cancelled when the replacement is launched)."""
    if slot.current is None and slot.successor is None and not slot.launching:
        launch_replica(session, rec, slot)  # never launched (a serve killed before it got there): launch it now
        keeper_log(f"slot {slot.index}: had no job; {slot.current} launched")
        return
    if suc is not None and not suc.state.final and not (rec.keep_alive and suc.scheduler_state == "W"):
        # starting, or queued past its begin time (waiting for resources): it keeps its place in the queue
        slot.current, slot.successor, slot.retry_at = slot.successor, None, None
        return
    if slot.launching:  # a replacement's submission not settled yet (services/intents.py): never a second one
        return
    ended = slot.current or ""
    first = slot.failed_job != ended
    step = restarts.judge(restarts.RestartPolicy.from_dict(rec.restart), slot, ended,
                          restarts.failure_cause(ended, cur))
    if first:
        keeper_log(f"slot {slot.index}: failed: {slot.last_failure}")
        if step == restarts.STOP:
            keeper_log(f"slot {slot.index}: {slot.gave_up}")
        elif step == restarts.WAIT and slot.retry_at is not None:
            keeper_log(f"slot {slot.index}: restart in {slot.retry_at - time.time():.0f} s (backoff)")
    if step != restarts.RESTART:
        return
    if suc is not None and not suc.state.final:  # still waiting for its handover time (W): too late now
        session.cancel(suc.record)
    slot.successor = None
    launch_replica(session, rec, slot)
    restarts.restarted(slot)
    keeper_log(f"slot {slot.index}: {ended} ended unexpectedly; replacement {slot.current} launched "
               + (f"(restart {slot.restarts})" if not slot.held_waits else
                  f"(another process held the GPU memory: no restart spent, wait {slot.held_waits})"))
