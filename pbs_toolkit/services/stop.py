"""Stopping a service (``pbstk cancel NAME``, or ``serve`` undoing a failed start) so that nothing is orphaned.

The service is marked ``STOPPING`` first (its ``ended`` set: the keeper stops on its next tick and launches nothing
more, and no new service can take the name), then a launch left half done is settled (services/intents.py, the
router job's ``settle``), every replica job and the router are stopped, the registry entries taken back, and only
then is the final word (CANCELLED or ENDED) recorded. An interrupted teardown leaves the service ``STOPPING``:
``status`` says so, and the next ``pbstk cancel NAME`` finishes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pbs_toolkit.errors import JobNotFound, PbstkError
from pbs_toolkit.services import intents
from pbs_toolkit.services import record as records
from pbs_toolkit.services.entry import service_job_record
from pbs_toolkit.services.keeper.process import poll_seconds, stop_keeper
from pbs_toolkit.services.record import ServiceRecord

if TYPE_CHECKING:
    from pbs_toolkit.services.session import ServiceSession


def teardown(session: ServiceSession, rec: ServiceRecord, final: str, *, keep_endpoint: bool = False,
             keeper_wait_s: float | None = None) -> list[tuple[str, str, bool]]:
    """Stop the service: mark it ``STOPPING`` (ended: the keeper stops on its next tick and launches nothing
    more), wait for the keeper, settle a launch it or ``serve`` left half done (services/intents.py), cancel every
    replica job (queued successors too), stop the router, take the service's registry entries back; only then
    record it ``final``. Returns (job id, name, stopped now) per job. When something could not be stopped the
    service stays ``STOPPING`` and ``PbstkError`` says what: the next ``pbstk cancel NAME`` finishes it."""
    marked = records.begin_stop(session.store, rec, final)
    if marked is None and rec.ended is None:  # not recorded at all (a store lost and not re-adopted): as it is
        rec.stop_as, rec.state = final, records.STOPPING
    stop_keeper(rec.name, keeper_wait_s if keeper_wait_s is not None else poll_seconds() + 5)
    # the keeper's last write may hold a new job or a launch intent; ``rec`` (serve's own copy) may hold a router
    # or a job that serve could no longer save once a cancel had begun: stop what either knows
    fresh = records.load(session.store, rec.name, created=rec.created) or marked or rec
    problems: list[str] = []
    for slot in fresh.slots:
        if not intents.settle(session, fresh, slot, wait_s=SETTLE_WAIT_S):
            problems.append(f"the submission of {slot.launching} has not finished (`pbstk jobs` names it)")
    for r in (fresh, rec):
        if r.router_job and not r.router_job.get("job_id"):
            from pbs_toolkit.services.router import job as router_job

            if not router_job.settle(session, r, wait_s=SETTLE_WAIT_S):
                problems.append(f"the submission of the router job {r.router_job['name']} has not finished")
    done = []
    for job in dict.fromkeys(j for r in (fresh, rec) for s in r.slots for j in s.jobs()):
        try:
            record = session.store.find(job)
        except JobNotFound:
            continue  # no record, nothing this pbstk can stop (`pbstk clean` keeps a live service's jobs)
        try:
            done.append((record.job_id, record.name, session.cancel(record)))
        except PbstkError as exc:
            done.append((job, f"not cancelled: {exc.message}", False))
            problems.append(f"{job}: {exc.message}")
    done += _stop_routers(session, [r for r in (fresh, rec) if r.router or r.router_job], problems)
    entry = service_job_record(fresh)
    if keep_endpoint:
        session.store.keep_registry_entries(entry)
    else:
        from pbs_toolkit.endpoints.retire import retire

        retire(session.store, entry, notice=session.on_removal)
    if problems:
        records.keep_stopping(session.store, fresh)
        raise PbstkError(f"service {rec.name} is not stopped yet: {'; '.join(problems)}; run "
                         f"`pbstk cancel {rec.name}` again to finish")
    records.finish_stop(session.store, fresh)
    rec.state, rec.ended = fresh.state, fresh.ended
    return done


#: how long a teardown waits for a replica submission still under way (its submit command) before giving up for now
SETTLE_WAIT_S = 30.0


def _stop_routers(session: ServiceSession, recs: list[ServiceRecord],
                  problems: list[str]) -> list[tuple[str, str, bool]]:
    """Stop the router (or cancel the router job) each record names, once each."""
    from pbs_toolkit.services.router.process import RouterInfo, stop_router

    done, seen = [], set()
    for r in recs:
        key = r.router_job.get("job_id") if r.router_job else r.router.get("pid")
        if key in seen or (r.router_job and not key):  # a router job never submitted (or not settled: said so)
            continue
        seen.add(key)
        if r.router_job:
            from pbs_toolkit.services.router import job as router_job

            rj = r.router_job
            try:
                done.append((rj["job_id"], rj["name"], router_job.cancel(session, r)))
            except PbstkError as exc:
                done.append((rj["job_id"], f"not cancelled: {exc.message}", False))
                problems.append(f"router job {rj['job_id']}: {exc.message}")
            continue
        try:
            stop_router(session.runner(r.transport), RouterInfo.from_dict(r.router))
        except PbstkError as exc:
            problems.append(f"the router: {exc.message}")
    return done
