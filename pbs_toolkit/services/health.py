"""A replica's health as the service sees it, decided in one place: routable, kept with patience, or out.

* **Routable**: the keeper added the replica's server to the router (only ever a READY one) and its job has not
  ended. The router's worker list *is* the keeper's verdict: a replica in it whose last look failed still serves
  (the router routes to it, and waits for its own 3 failed checks before it stops), so the keeper, the scaler,
  ``status NAME``, ``serve --wait`` and ``metrics NAME`` all count it, instead of each comparing state strings.
* **Patience**: a routable replica leaves the router at once only on a final state (the scheduler says its job
  ended, its vLLM exited, the node is gone: FAILED, CANCELLED, FINISHED, LOST). A look that merely fails
  (STARTING because ``/health`` did not answer in time, UNKNOWN because the scheduler did not) keeps it in the
  router until ``PBSTK_SERVICE_UNHEALTHY_LOOKS`` consecutive looks (default 3; profile key
  ``replica_unhealthy_looks``) spanning at least ``PBSTK_SERVICE_UNHEALTHY_S`` seconds (default 15; profile key
  ``replica_unhealthy_after``, ``15s``) have failed: vllm-router's own rule (3 failed checks, one
  every 5 s as pbstk starts it). A READY look starts the count again. Measured on GPUs: one 3 s probe timeout
  under a c=512 burst used to take the only replica out of the router 9 times in 2 minutes (4,691 of 12,000
  requests got 503).
* **Busy** (jobs/rundir.py ``busy``): a replica whose probe timed out while its ``/metrics`` shows requests is
  READY, only slow; scale-down takes such a replica last. vLLM serves ``/metrics`` on the same event loop as
  ``/health``, so under overload it often times out too: the router's own view then decides
  (``busy_at_router``): requests open to the replica at the router, and some of them answered well since the
  keeper's last look (a hung engine answers none, a dead one fails them: their failed looks count).

The count of failed looks is kept in the service's record (``health``: job id -> ``since``, ``looks``), so a
restarted keeper goes on counting.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard

from pbs_toolkit.envvars import env_float
from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.server.phases import Phase

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.record import ServiceRecord, Slot
    from pbs_toolkit.services.router.metrics import RouterSnapshot

#: consecutive failed looks before a routable replica leaves the router (``PBSTK_SERVICE_UNHEALTHY_LOOKS``) ...
DEFAULT_UNHEALTHY_LOOKS = 3
#: ... spanning at least this many seconds (``PBSTK_SERVICE_UNHEALTHY_S``): vllm-router's 3 checks x 5 s
DEFAULT_UNHEALTHY_S = 15.0


def unhealthy_looks(rec: ServiceRecord | None = None) -> int:
    """Failed looks in a row before a routable replica leaves the router: ``PBSTK_SERVICE_UNHEALTHY_LOOKS``, else
    the profile's ``replica_unhealthy_looks`` as ``serve`` recorded it, else 3."""
    recorded = int((rec.health_rule if rec is not None else {}).get("looks") or DEFAULT_UNHEALTHY_LOOKS)
    return int(env_float("PBSTK_SERVICE_UNHEALTHY_LOOKS", recorded, lambda v: 1 <= v <= 1000 and v == int(v)))


def unhealthy_seconds(rec: ServiceRecord | None = None) -> float:
    """The least time those failed looks must span: ``PBSTK_SERVICE_UNHEALTHY_S``, else the profile's
    ``replica_unhealthy_after``, else 15 s."""
    recorded = float((rec.health_rule if rec is not None else {}).get("seconds") or DEFAULT_UNHEALTHY_S)
    return env_float("PBSTK_SERVICE_UNHEALTHY_S", recorded, lambda v: 0 <= v <= 86400)


def worker_url(st: JobStatus) -> str | None:
    """``http://host:port`` of a job's server, as the router lists it (the router adds ``/v1/...`` itself)."""
    from pbs_toolkit.endpoints import endpoint_url

    if not st.address or not st.port:
        return None
    return endpoint_url(st)[: -len("/v1")]


def ready(st: JobStatus | None) -> TypeGuard[JobStatus]:
    """The job's last look says READY (busy included): the keeper may add it to the router."""
    return st is not None and st.state is ServerState.READY


def routable(st: JobStatus | None, in_router: Collection[str]) -> bool:
    """In the router and not ended: the router sends it requests (see the module's docstring)."""
    if st is None or st.state.final:
        return False
    url = worker_url(st)
    return url is not None and url in in_router


def serving_job(slot: Slot, statuses: Mapping[str, JobStatus], in_router: Collection[str]) -> JobStatus | None:
    """The slot's routable job: the current one, else its successor, else ``None``."""
    for job in (slot.current, slot.successor):
        st = statuses.get(job or "")
        if routable(st, in_router):
            return st
    return None


def routable_count(slots: Sequence[Slot], statuses: Mapping[str, JobStatus], in_router: Collection[str]) -> int:
    """Slots with a routable job: what ``READY n/N`` counts."""
    return sum(1 for slot in slots if serving_job(slot, statuses, in_router) is not None)


def still_starting(slots: Sequence[Slot], statuses: Mapping[str, JobStatus], in_router: Collection[str]) -> bool:
    """Whether some slot is not routable yet but has a job on its way (queued or starting, not ended)."""
    for slot in slots:
        if serving_job(slot, statuses, in_router) is not None:
            continue
        if any(st is not None and not st.state.final for st in (statuses.get(j or "") for j in (slot.current,
                                                                                             slot.successor))):
            return True
    return False


def slow(st: JobStatus | None, in_router: Collection[str]) -> bool:
    """Routable, but busy (its probe answered late) or its last look failed: scale-down takes it last."""
    return routable(st, in_router) and st is not None and (st.busy is not None or not ready(st))


#: worker URL -> the requests to it the router had seen succeed, at the keeper's previous look (this keeper process)
_SUCCEEDED_BEFORE: dict[str, float] = {}


def needs_router_view(statuses: Mapping[str, JobStatus], in_router: Collection[str]) -> bool:
    """Whether a routable replica's last look failed (not READY, not ended): the router's view may tell it busy."""
    return any(routable(st, in_router) and not ready(st) for st in statuses.values())


def busy_at_router(statuses: Mapping[str, JobStatus], in_router: Collection[str], snap: RouterSnapshot,
                   unvouched: dict[str, str] | None = None) -> list[str]:
    """A routable replica whose look failed while the router has requests open to it and saw some of them succeed
    since the previous look (failures, a dead worker's refusals, do not count) is busy, not unhealthy: its status
    becomes READY with ``busy`` saying why (what ``leave_router`` then keeps). Returns the job ids so marked;
    ``unvouched`` gets, for each other routable replica whose look failed, why the router's view did not vouch."""
    marked = []
    for gone in [u for u in _SUCCEEDED_BEFORE if u not in in_router]:  # workers the router no longer has
        del _SUCCEEDED_BEFORE[gone]
    for st in statuses.values():
        url = worker_url(st)
        if url is None or url not in in_router:
            continue
        done, before = snap.succeeded(url), _SUCCEEDED_BEFORE.get(url)
        _SUCCEEDED_BEFORE[url] = done
        if st.state not in (ServerState.STARTING, ServerState.UNKNOWN):
            continue
        open_ = snap.open_to(url)
        if open_ and before is not None and done > before:
            st.state, st.phase, st.unreachable = ServerState.READY, Phase.READY.value, None
            st.busy = f"probe slow; {open_:g} open at the router, {done - before:g} answered since the last look"
            marked.append(st.record.job_id)
        elif unvouched is not None:
            unvouched[st.record.job_id] = (
                "no request open to it at the router" if not open_ else
                "the router's first count of its answers: nothing to compare yet" if before is None else
                f"{open_:g} open at the router, none answered since the last look")
    return marked


def leave_router(rec: ServiceRecord, st: JobStatus, now: float) -> str | None:
    """A routable replica's look, counted: why it must leave the router now, or ``None`` while it stays. A READY
    look clears the count; a final state is reason at once; any other look (STARTING, UNKNOWN) counts one failed
    look, and the replica leaves once ``unhealthy_looks()`` of them span ``unhealthy_seconds()``."""
    job = st.record.job_id
    if ready(st):
        rec.health.pop(job, None)
        return None
    if st.state.final:
        rec.health.pop(job, None)
        return f"{st.state.value}{': ' + st.reason if st.reason else ''}"
    seen = rec.health.get(job) or {"since": now, "looks": 0}
    seen = {"since": float(seen["since"]), "looks": int(seen["looks"]) + 1}
    rec.health[job] = seen
    looks, span, need_looks, need_s = seen["looks"], now - seen["since"], unhealthy_looks(rec), unhealthy_seconds(rec)
    if looks >= need_looks and span >= need_s:
        rec.health.pop(job, None)
        return f"{st.state.value} on {looks} looks in a row over {span:.0f} s"
    return None


def forget(rec: ServiceRecord, jobs: Collection[str]) -> None:
    """Drop the counts of jobs no slot holds any more."""
    for job in [j for j in rec.health if j not in jobs]:
        rec.health.pop(job, None)
