"""What the keeper does each tick for an autoscaling service (``--min-replicas/--max-replicas``) and for one
with ``--idle-cancel``: observe the replicas' ``/metrics``, ask the policy (services/keeper/autoscale.py), apply its
decision.

* **up**: a new replica slot (its index never reused, so job names stay unique) is launched through the same
  path as every replica (services/manage.py ``launch_replica``: the intent saved first, the service's key);
* **down**: one slot is marked ``retiring`` (a queued or starting one first, else the newest of those that answer
  their probes, a busy or slow one last): the keeper takes its job out of the router, lets a routable one finish
  what it runs (the same drain as a keep-alive predecessor, at most
  ``PBSTK_SERVICE_DRAIN_S``), cancels it and drops the slot;
* **idle** (``--idle-cancel`` on a service): no request running, waiting or finished on any replica for the
  duration ends the whole service (replicas, router, registry entries), recorded ENDED with the reason ``idle``.

The decision and its reason are kept in the record (``scale``): ``status`` shows the target, the replicas and
the last change with its reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pbs_toolkit.durations import short
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.services import health
from pbs_toolkit.services.health import worker_url
from pbs_toolkit.services.keeper import autoscale
from pbs_toolkit.services.keeper.process import keeper_log
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.settings.vllm_overrides import int_flag

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.router.metrics import RouterSnapshot
    from pbs_toolkit.services.session import ServiceSession
    from pbs_toolkit.vllm.prom import MetricsSnapshot


def status_fields(rec: ServiceRecord) -> dict[str, Any]:
    """The ``service`` object's fields of this module (docs/json.md)."""
    return {"autoscale": rec.scale or None, "idle_cancel_s": rec.idle_cancel_s or None,
            "end_reason": rec.end_reason or None}


def active(rec: ServiceRecord) -> list[Slot]:
    """The slots that count toward the target (not being removed)."""
    return [s for s in rec.slots if not s.retiring]


#: seconds one replica's ``/metrics`` may take in a tick's scrape (all replicas are scraped at once)
SCRAPE_TIMEOUT_S = 3.0


def snapshots(session: ServiceSession, rec: ServiceRecord, statuses: Mapping[str, JobStatus],
              in_router: set[str], silent: Collection[str] = ()) -> dict[str, MetricsSnapshot]:
    """One ``/metrics`` scrape of every routable replica, all at once (job id -> snapshot; the tick waits at most
    ``SCRAPE_TIMEOUT_S`` for the slowest); a replica that does not answer is left out, and so is one in
    ``silent``: this tick's status look already found its ``/health`` and ``/metrics`` unanswered (a second try
    would only cost the tick another timeout). A multi-model service's replica is every model of its job, summed
    (services/models/per_model.py): busy when any model is, left out when any model does not answer."""
    from pbs_toolkit.perf.scrape import scrape
    from pbs_toolkit.services.models.per_model import job_snapshot

    look = job_snapshot if rec.models else scrape
    serving = [st for slot in active(rec) if (st := health.serving_job(slot, statuses, in_router)) is not None
               and st.record.job_id not in silent]

    def one(st: JobStatus) -> MetricsSnapshot | None:
        try:
            return look(session.runner(st.record.transport), st, timeout=SCRAPE_TIMEOUT_S)
        except PbstkError:
            return None

    if len(serving) <= 1:
        answers = [one(st) for st in serving]
    else:
        with ThreadPoolExecutor(max_workers=min(16, len(serving)), thread_name_prefix="pbstk-scrape") as pool:
            answers = list(pool.map(one, serving))
    return {st.record.job_id: snap for st, snap in zip(serving, answers, strict=True) if snap is not None}


def silent_looks(statuses: Mapping[str, JobStatus], in_router: set[str]) -> set[str]:
    """Routable replicas whose status look this tick timed out on ``/health`` and found no answer (or no request)
    on ``/metrics`` either (STARTING while in the router; jobs/rundir.py ``busy``)."""
    return {job for job, st in statuses.items()
            if health.routable(st, in_router) and st.state is ServerState.STARTING}


def capacity(statuses: Mapping[str, JobStatus]) -> int | None:
    """One replica's ``--max-num-seqs`` from its rendered vLLM arguments, when it has one."""
    for st in statuses.values():
        value = int_flag(list(st.record.spec.vllm_args), "--max-num-seqs")
        if value is not None and value > 0:
            return value
    return None


#: the wait for the router's figures when they decide whether a replica whose look failed is busy. Patient: the
#: look comes under the very load it judges (a c=1024 stand-in load on 2 busy cores held the router's answer up to
#: 1.6 s), and a look the router cannot vouch for counts toward taking the replica out
ROUTER_VIEW_TIMEOUT_S = 10.0


def router_look(session: ServiceSession, rec: ServiceRecord, timeout: float = 3.0) -> RouterSnapshot | None:
    """One request to the router's Prometheus port (``None``: it did not answer, or has no such port)."""
    return router_view(session, rec, timeout)[0]


def router_view(session: ServiceSession, rec: ServiceRecord,
                timeout: float = ROUTER_VIEW_TIMEOUT_S) -> tuple[RouterSnapshot | None, str | None]:
    """``router_look``, with why it found nothing (the transport's or the router's words)."""
    from pbs_toolkit.services.router.metrics import router_counters

    try:
        return router_counters(session.runner(rec.transport), rec, timeout=timeout), None
    except PbstkError as exc:
        return None, exc.message


def overload_watch(session: ServiceSession, rec: ServiceRecord, statuses: Mapping[str, JobStatus],
                   in_router: set[str]) -> Callable[[], str | None] | None:
    """For the keeper's wait between ticks: a look at the router's open requests alone (one request to its
    Prometheus port) that says why a tick is due now (services/keeper/autoscale.py ``router_overload``), or ``None``;
    no such look for a service that does not autoscale or whose router has no Prometheus port."""
    if not rec.scale or not (rec.router or {}).get("prometheus_port"):
        return None
    spec = autoscale.ScaleSpec.from_dict(rec.scale["spec"])
    memory = autoscale.Memory.from_dict(rec.scale.get("memory"))
    base = observation(rec, statuses, in_router, {}, time.time())
    if not autoscale.worth_watching(spec, memory, base):
        return None  # a tick now would change nothing: the router is not asked

    def look() -> str | None:
        snap = router_look(session, rec, timeout=1.0)
        if snap is None or snap.in_flight is None:
            return None
        return autoscale.router_overload(spec, memory, replace(base, now=time.time(), in_flight=snap.in_flight))

    return look


def refused_since(rec: ServiceRecord, snap: RouterSnapshot | None) -> float | None:
    """Requests the router failed since the last tick for want of a worker (its 503s and exhausted retries);
    ``None`` on the first look, for a router that did not answer, or one that restarted (its counters went
    down). The running total is kept in ``rec.scale["router_refused"]``."""
    if snap is None:
        return None
    total = snap.refused
    before = rec.scale.get("router_refused")
    rec.scale["router_refused"] = total
    if before is None or total < float(before):
        return None
    return total - float(before)


def idle_end(rec: ServiceRecord, snaps: Mapping[str, MetricsSnapshot], routable: int, now: float) -> str | None:
    """``--idle-cancel`` of a service: the reason to end it now, or ``None``. Idle means: every replica in the
    router answered, none runs or has waiting requests, and no replica's success counter moved since the last
    tick (a request that came and went between two ticks is seen too). A replica that does not answer is not
    idle; neither is a service none of whose replicas is routable yet."""
    if not rec.idle_cancel_s:
        return None
    sig = json.dumps(sorted((job, s.requests_success) for job, s in snaps.items()))
    busy = (not snaps or len(snaps) < routable or sig != rec.idle.get("sig")
            or any((s.running or 0) > 0 or (s.waiting or 0) > 0 for s in snaps.values()))
    since = now if busy or rec.idle.get("since") is None else float(rec.idle["since"])
    rec.idle = {"since": since, "sig": sig}
    if now - since >= rec.idle_cancel_s:
        return f"idle: no request for {short(now - since)} (--idle-cancel {short(rec.idle_cancel_s)})"
    return None


def observation(rec: ServiceRecord, statuses: Mapping[str, JobStatus], in_router: set[str],
                snaps: Mapping[str, MetricsSnapshot], now: float, refused: float | None = None,
                in_flight: float | None = None) -> autoscale.Observation:
    """This tick's look for the policy. A routable replica counts as serving even when its last look failed or
    its probe answered late (it is not "starting"); the queue is summed over the replicas whose ``/metrics``
    answered (``answered``), so one that did not answer this time neither hides the others' queue nor resets
    the policy's count. ``in_flight``: the requests open at the router (what clients wait for), set against what
    the replicas hold."""
    slots = active(rec)
    starting = sum(1 for s in slots if health.serving_job(s, statuses, in_router) is None)
    answered = [s for s in snaps.values() if s.waiting is not None or s.running is not None]
    return autoscale.Observation(
        now=now, target=len(slots), starting=starting,
        waiting=sum(s.waiting or 0 for s in answered) if answered else None,
        running=sum(s.running or 0 for s in answered) if answered else None,
        capacity=capacity(statuses) or rec.scale.get("capacity"), job_cap=int(rec.scale.get("job_cap") or 0),
        answered=len(answered), refused=refused, in_flight=in_flight)


def _router_verdict(session: ServiceSession, rec: ServiceRecord, statuses: Mapping[str, JobStatus],
                    in_router: set[str]) -> RouterSnapshot | None:
    """The router's figures this tick, where a routable replica's look failed (they decide whether it counts:
    looked at patiently, and the keeper's log says what the router saw) or the service autoscales."""
    snap = None
    if health.needs_router_view(statuses, in_router):
        snap, why = router_view(session, rec)
        if snap is None:
            keeper_log(f"the router's figures could not be read ({why}): a routable replica's failed look counts")
    elif rec.scale:
        snap = router_look(session, rec)
    if snap is not None:
        unvouched: dict[str, str] = {}
        for job in health.busy_at_router(statuses, in_router, snap, unvouched):
            keeper_log(f"{job} is busy (the router's view): {statuses[job].busy}")
        for job, why in unvouched.items():  # its failed look counts
            keeper_log(f"{job}: the router's view does not vouch for it: {why}")
    return snap


def step(session: ServiceSession, rec: ServiceRecord, statuses: Mapping[str, JobStatus],
         in_router: set[str], sighted: float | None = None) -> str | None:
    """This tick's look at the router (for every service whose routable replica's look failed: the router may
    tell it busy, services/health.py ``busy_at_router``), idle check and scaling decision, applied. ``sighted``:
    when the keeper's watch saw the router's figure show the overload that woke this tick. Returns why the
    service must end now (idle), or ``None``."""
    silent = silent_looks(statuses, in_router)  # before the router's view marks some of them busy
    snap = _router_verdict(session, rec, statuses, in_router)
    if not rec.scale and not rec.idle_cancel_s:
        return None
    now = time.time()
    snaps = snapshots(session, rec, statuses, in_router, silent)
    routable = health.routable_count(active(rec), statuses, in_router)
    why = idle_end(rec, snaps, routable, now)
    if why or not rec.scale:
        return why
    spec = autoscale.ScaleSpec.from_dict(rec.scale["spec"])
    obs = observation(rec, statuses, in_router, snaps, now, refused_since(rec, snap),
                      snap.in_flight if snap is not None else None)
    before = autoscale.Memory.from_dict(rec.scale.get("memory"))
    decision, memory = autoscale.decide(spec, before, replace(obs, sighted=sighted))
    line = autoscale.news(before, memory, decision)
    if line:
        keeper_log(line)
    rec.scale["memory"] = memory.to_dict()
    rec.scale["now"] = decision.to_dict()
    if obs.capacity:
        rec.scale["capacity"] = obs.capacity
    if decision.action == "up":
        grow(session, rec, decision)
    elif decision.action == "down":
        shrink(rec, statuses, in_router, decision)
    return None


def grow(session: ServiceSession, rec: ServiceRecord, decision: autoscale.Decision) -> None:
    """A new slot and its replica job; its index is never reused (job names stay unique)."""
    from pbs_toolkit.services.manage import launch_replica

    index = max([s.index for s in rec.slots] + [int(rec.scale.get("next_index") or 0) - 1]) + 1
    rec.scale["next_index"] = index + 1
    slot = Slot(index)
    rec.slots.append(slot)
    rec.replicas = len(active(rec))
    rec.scale["last"] = decision.to_dict()
    launch_replica(session, rec, slot)
    keeper_log(f"scale up to {rec.replicas}: {decision.reason}; r{index} is {slot.current}")


def shrink(rec: ServiceRecord, statuses: Mapping[str, JobStatus], in_router: set[str],
           decision: autoscale.Decision) -> None:
    """Mark one slot ``retiring``: a queued or starting one first (nothing to drain), else the newest routable
    one that answers its probes; one that is merely busy or slow (services/health.py ``slow``) only when every
    routable one is."""
    slots = active(rec)
    waiting = [s for s in slots if health.serving_job(s, statuses, in_router) is None]
    brisk = [s for s in slots if not health.slow(health.serving_job(s, statuses, in_router), in_router)]
    slot = max(waiting or brisk or slots, key=lambda s: s.index)
    slot.retiring = True
    rec.replicas = len(active(rec))
    rec.scale["last"] = decision.to_dict()
    keeper_log(f"scale down to {rec.replicas}: {decision.reason}; r{slot.index} ({slot.current}) drains and goes")


def retire_jobs(slot: Slot, statuses: Mapping[str, JobStatus], in_router: set[str]) -> list[str]:
    """A retiring slot's first step: the urls of its jobs to take out of the router now (then ``to_cancel``,
    given the router's workers as they were before this step)."""
    return [u for j in (slot.current, slot.successor) if j and (st := statuses.get(j)) is not None
            and (u := worker_url(st)) is not None and u in in_router]


def to_cancel(slot: Slot, statuses: Mapping[str, JobStatus], in_router: set[str]) -> list[str]:
    """The retiring slot's jobs to cancel at once (not serving: nothing to drain); its serving job (routable in
    ``in_router``, the workers before the slot's jobs left: a busy or slow one too) is moved to ``draining``."""
    cancel = []
    cur = statuses.get(slot.current or "")
    serves = slot.current and (health.routable(cur, in_router) or health.ready(cur))
    if serves and slot.draining:  # a keep-alive predecessor still drains: this one (out of the router) waits
        gone, slot.successor = slot.successor, None
        return [gone] if gone else []
    if serves:
        slot.draining, slot.drain_started = slot.current, time.time()
    elif slot.current:
        cancel.append(slot.current)
    if slot.successor:
        cancel.append(slot.successor)
    slot.current = slot.successor = None
    return cancel


def summary(scale: Mapping[str, Any], replicas: int, ready: int) -> str | None:
    """``autoscaling 1..4: target 2, 2 routable; last: up at 12:03:04 (7 request(s) waiting ...)``."""
    if not scale:
        return None
    spec = scale.get("spec") or {}
    text = f"autoscaling {spec.get('min_replicas')}..{spec.get('max_replicas')}: target {replicas}, {ready} routable"
    last = scale.get("last")
    if last:
        at = time.strftime("%H:%M:%S", time.localtime(last.get("at") or 0))
        text += f"; last: {last.get('action')} at {at} ({last.get('reason')})"
    now = scale.get("now")
    if now and now.get("action") == "hold":
        text += f"; now: {now.get('reason')}"
    return text
