"""The keeper: one detached process per service that keeps the router's worker list true to the replicas.

Started by ``serve`` as ``python -m pbs_toolkit _keeper NAME`` in its own session, on the machine where pbstk
runs (same job store, same transports). It holds ``services/NAME/keeper.lock`` while it runs, so only one keeper
per service ever runs and ``status`` can tell whether it does. Each tick (``PBSTK_SERVICE_POLL_S``, default 15;
while some replica is still on its way to the router, on the scheduler ramp 2, 4, 8 s up to that):
one ``session.status`` over the service's jobs (one scheduler query), then for each replica slot:

* a READY job that is not in the router is added; one in the router leaves it at once when its job ended (failed,
  cancelled, lost), and after a few failed looks in a row otherwise (services/health.py: a replica too busy to
  answer one probe in time is not taken out of the router);
* keep-alive: a running job with a known walltime gets its successor, eligible ``handover`` seconds before the
  walltime ends (``begin_at``); when the successor is READY it is added, and on the next tick (the router has
  routed to it by then) the predecessor is removed, drained (its ``/metrics`` shows no running request, at most
  ``PBSTK_SERVICE_DRAIN_S``, default 60) and cancelled;
* a job that ends unexpectedly (crash, OOM, node failure, killed), with or without keep-alive, is replaced under
  the service's restart policy (services/keeper/restarts.py): after a backoff, at most K times in a window, then the
  slot is no longer restarted and the service says why;
* a service that ``pbstk run`` started and whose lease it no longer renews is drained and ended
  (services/lease.py);
* a worker in the router that is none of the service's jobs is removed (added by hand, or by anyone at all
  with ``router_isolation: none``: the router's admin API has no authentication of its own).

The router admin object (for a login-node router, one channel per call over the runner's held SSH connection)
is kept across ticks (``AdminLink``) and made afresh only after a failure or for a new router.

Between ticks the keeper does not just sleep: every ``PROBE_S`` it probes ``/health`` of each replica that is
starting (its address known, not READY, not in the router) directly, which costs the scheduler nothing, and the
moment one answers the next tick runs at once. So a replica joins the router within about a second of its server
answering, not up to a tick later (a replica may cut the wait short ``WAKES_PER_JOB`` times: one whose ``/health``
answers but that ``status`` does not call READY, e.g. a foreign server on its port, cannot turn that into a
scheduler query every ``PROBE_S``). For an autoscaled service it also looks at the router's open requests every
``ROUTER_WATCH_S`` (one request to its Prometheus port): when they alone show an overload the next tick could act
on (services/keeper/autoscale.py ``router_overload``), that tick runs at once, and the overload counts as seen from that
moment; so a burst is acted on within about ``CONFIRM_S`` and two ticks of its start, whatever the poll interval.

The log stays short for a service that runs for days: a line per change, per overload seen (saying when the watch
sighted it) or dismissed (services/keeper/autoscale.py ``news``), per replica whose answer brought a tick forward, and a
tick's duration (with where it went) only when it took longer than ``LONG_TICK_S``. A sighting that the tick does
not count writes nothing.

It stops when the service is recorded ended (``pbstk cancel NAME``) or its record is gone.

This module runs the ticks; what a tick does to each slot is services/keeper/slots.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.readiness import scheduler_intervals
from pbs_toolkit.services import health
from pbs_toolkit.services import record as records
from pbs_toolkit.services.health import routable_count, still_starting, worker_url
from pbs_toolkit.services.keeper import autoscale, restarts, scaler
from pbs_toolkit.services.keeper.process import (
    TICK_FILE,
    heartbeat,
    hold_keeper_lock,
    keeper_log,
    poll_seconds,
    service_dir,
)
from pbs_toolkit.services.keeper.slots import drain, drain_seconds, reconcile, remove_foreign
from pbs_toolkit.services.lease import LeaseWatch
from pbs_toolkit.services.lease import drain as drain_all
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.state import service_state

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.router.process import RouterAdmin
    from pbs_toolkit.services.session import ServiceSession

#: seconds between two ``/health`` probes of a starting replica while the keeper waits for its next tick
PROBE_S = 0.5
#: how many times one job's answering ``/health`` may bring the next tick forward
WAKES_PER_JOB = 3
#: seconds between two looks at the router's open requests while an autoscaled service's keeper waits
ROUTER_WATCH_S = 1.0
#: a tick that takes longer than this is logged with its duration and where it went
LONG_TICK_S = 5.0


@dataclass
class Look:
    """What one tick saw: each job's status and the router's workers after the tick's changes."""

    statuses: dict[str, JobStatus] = field(default_factory=dict)
    in_router: set[str] = field(default_factory=set)
    #: slots whose reconciliation failed this tick (the others went on): the heartbeat's error
    failed: list[str] = field(default_factory=list)
    #: seconds this tick spent on its parts (the job status query; the router, scaling and idle looks)
    spent: dict[str, float] = field(default_factory=dict)

    def starting(self, rec: ServiceRecord) -> bool:
        """Some slot is not routable yet but has a job on its way: tick on the short ramp."""
        return still_starting(rec.slots, self.statuses, self.in_router)


def run(name: str, session: ServiceSession) -> int:
    """The keeper's life: take the lock (another keeper holds it: exit 0), tick until the service ends.
    ``session``: the caller's (``Client.keep_service``), whose runners the caller closes."""
    from pbs_toolkit.jobs.store import launcher_token

    fd = hold_keeper_lock(name)
    if fd is None:
        keeper_log(f"another keeper already keeps service {name}")
        return 0
    directory = service_dir(name)
    (directory / "keeper.json").write_text(json.dumps({"pid": os.getpid(), "token": launcher_token()}))
    (directory / TICK_FILE).unlink(missing_ok=True)  # an earlier keeper's (or service's) heartbeat is not ours
    keeper_log(f"keeper of service {name} started (pid {os.getpid()})")
    try:
        with AdminLink(session) as link:
            ramp, wakes, sighted = 0, {}, None  # type: int, dict[str, int], float | None
            lease = LeaseWatch(name)  # pbstk run's lease (services/lease.py), armed by the first record read
            while True:
                try:  # a store locked for a while, a router or scheduler that fails: logged, tried next tick
                    rec = records.load(session.store, name)
                    if rec is None or rec.ended is not None:
                        keeper_log(f"service {name} {'is gone' if rec is None else 'ended'}; keeper stops")
                        return 0
                    lease.arm(rec)
                    began = time.monotonic()
                    seen = tick(session, rec, link, lease, sighted)
                    heartbeat(name, "; ".join(seen.failed) or None)
                    log_long_tick(time.monotonic() - began, seen)
                except PbstkError as exc:
                    keeper_log(f"tick failed: {exc.message}")
                    heartbeat(name, exc.message)
                    time.sleep(poll_seconds())
                    continue
                except Exception as exc:  # noqa: BLE001 - nothing a tick meets may end the keeper for good
                    keeper_log(f"tick failed: {type(exc).__name__}: {exc}")
                    heartbeat(name, f"{type(exc).__name__}: {exc}")
                    time.sleep(poll_seconds())
                    continue
                wait = poll_seconds()
                if seen.starting(rec):  # replicas on their way: the scheduler's ramp, not a whole poll interval
                    steps = scheduler_intervals()
                    wait, ramp = min(wait, steps[min(ramp, len(steps) - 1)]), ramp + 1
                else:
                    ramp = 0
                due = restarts.next_due(rec)  # a replacement's backoff ends: not a whole poll interval later
                if due is not None:
                    wait = min(wait, max(PROBE_S, due - time.time()))
                confirm = autoscale.confirm_within(rec.scale, time.time())  # an overload seen: confirmed soon
                if confirm is not None:
                    wait = min(wait, confirm)
                overload = None if sighted else scaler.overload_watch(session, rec, seen.statuses, seen.in_router)
                woken = watch(session, seen, wait, wakes, lambda: _ended(session, name) or lease.due(), overload)
                sighted = time.time() if woken and woken.startswith("overload") else None
                if woken and not sighted:  # an overload sighted: the tick's "overload seen" line says so
                    keeper_log(f"{woken}: looking now")
    finally:
        os.close(fd)


def log_long_tick(took: float, seen: Look) -> None:
    """A tick longer than ``LONG_TICK_S``, in the log with where its time went (probes of busy replicas that
    time out make it long; a quiet tick writes nothing)."""
    if took > LONG_TICK_S:
        parts = ", ".join(f"{what} {s:.1f} s" for what, s in seen.spent.items())
        keeper_log(f"tick took {took:.1f} s ({parts})" if parts else f"tick took {took:.1f} s")


def _ended(session: ServiceSession, name: str) -> bool:
    try:
        rec = records.load(session.store, name)
    except PbstkError:  # a store locked for a moment: the next tick reads it again
        return False
    return rec is None or rec.ended is not None


def watch(session: ServiceSession, seen: Look, seconds: float, wakes: dict[str, int],
          ended: Callable[[], bool] = lambda: False, overload: Callable[[], str | None] | None = None) -> str | None:
    """Wait ``seconds``, probing ``/health`` of every starting replica every ``PROBE_S`` meanwhile, and with
    ``overload`` (services/keeper/scaler.py ``overload_watch``) the router's open requests every ``ROUTER_WATCH_S``; why
    the next tick runs at once (``JOB answers``, or ``overload at the router: ...``), or ``None`` once the time is
    up or the service ended (a store read every ``PROBE_S``: ``cancel`` does not wait out a whole poll interval for
    the keeper)."""
    from pbs_toolkit.services.router.process import http_request

    deadline = time.monotonic() + seconds
    router_due = time.monotonic() + min(ROUTER_WATCH_S, seconds / 2)
    candidates = [st for job, st in seen.statuses.items()
                  if not st.state.final and not health.ready(st) and wakes.get(job, 0) < WAKES_PER_JOB
                  and (url := worker_url(st)) is not None and url not in seen.in_router]
    while True:
        for st in candidates:
            try:
                answer = http_request(session.runner(st.record.transport), str(st.address), int(st.port or 0),
                                      "/health", timeout=2.0, body_limit=0)[0]
            except PbstkError:
                answer = None
            if answer == 200:
                wakes[st.record.job_id] = wakes.get(st.record.job_id, 0) + 1
                return f"{st.record.job_id} answers"
        if overload is not None and time.monotonic() >= router_due:
            why = overload()
            if why:
                return f"overload at the router: {why}"
            router_due = time.monotonic() + ROUTER_WATCH_S
        left = deadline - time.monotonic()
        if left <= 0 or ended():
            return None
        time.sleep(min(PROBE_S, left))


class AdminLink:
    """The router's admin object, kept across ticks (a login-node router's calls each take a channel of the
    runner's held SSH connection, no tunnel). Made afresh only after a failure (``drop``) or when the router's
    record changes (a new router, another address)."""

    def __init__(self, session: ServiceSession) -> None:
        self.session = session
        self._stack: ExitStack | None = None
        self._admin: RouterAdmin | None = None
        self._for: dict[str, Any] = {}
        #: how many times a connection was opened (tests count them)
        self.opened = 0

    def get(self, rec: ServiceRecord) -> RouterAdmin:
        from pbs_toolkit.services.router.process import RouterInfo, open_admin

        if self._admin is not None and self._for == rec.router:
            return self._admin
        self.drop()
        stack = ExitStack()
        try:
            admin = stack.enter_context(open_admin(self.session.runner(rec.transport),
                                                   RouterInfo.from_dict(rec.router)))
        except BaseException:
            stack.close()
            raise
        self._stack, self._admin, self._for = stack, admin, dict(rec.router)
        self.opened += 1
        return admin

    def drop(self) -> None:
        stack, self._stack, self._admin, self._for = self._stack, None, None, {}
        if stack is not None:
            try:
                stack.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken tunnel must not end the keeper
                keeper_log(f"closing the router connection: {exc}")

    def __enter__(self) -> AdminLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


def tick(session: ServiceSession, rec: ServiceRecord, link: AdminLink | None = None,
         lease: LeaseWatch | None = None, sighted: float | None = None) -> Look:
    """One look and the reconciliation it calls for; the record is saved unless the service ended meanwhile
    (then whatever this tick launched is cancelled again). ``link``: the router connection kept across ticks
    (without one, a connection for this tick only); ``lease``: pbstk run's lease, which ends the service once
    it lapsed; ``sighted``: when the watch saw the overload at the router that woke this tick. Returns what it
    saw."""
    from pbs_toolkit.services import intents

    for slot in rec.slots:  # a launch that a killed keeper (or serve) left half done: its job takes its role
        if slot.launching and not intents.settle(session, rec, slot):
            keeper_log(f"slot {slot.index}: the submission of {slot.launching} has not finished yet")
    jobs = [j for s in rec.slots for j in s.jobs()]
    began = time.monotonic()
    statuses, unknown = _statuses(session, jobs)
    spent = {"job status": time.monotonic() - began}
    before = set(jobs)
    failed: list[str] = []
    with ExitStack() as own:
        if link is None:
            link = own.enter_context(AdminLink(session))
        admin = link.get(rec)
        try:
            in_router = set(admin.workers())
            began = time.monotonic()
            idle = _scale(session, rec, statuses, in_router, failed, lease, sighted)
            spent["router and scaling"] = time.monotonic() - began
            if idle:
                return _end_idle(session, rec, idle, Look(statuses, in_router, failed, spent))
            for slot in rec.slots:
                if slot.current and slot.current not in before:  # just added by scaling up: looked at next tick
                    continue
                try:  # one slot that fails (a launch refused, a job that cannot be cancelled) spoils no other
                    (_retire if slot.retiring else reconcile)(session, rec, slot, statuses, admin, in_router)
                except intents.ServiceEnded:
                    raise
                except PbstkError as exc:
                    failed.append(f"slot {slot.index}: {exc.message}")
                    keeper_log(failed[-1])
            remove_foreign([j for j in jobs if j not in unknown], statuses, admin, in_router,
                            {url for s in rec.slots for j in s.jobs() for url in s.known_urls(j)})
        except PbstkError:
            link.drop()  # a router or tunnel that failed is opened afresh next tick
            raise
    rec.slots = [s for s in rec.slots if not (s.retiring and not s.jobs() and not s.launching)]  # retired
    health.forget(rec, {j for s in rec.slots for j in s.jobs()})
    rec.ready = routable_count(rec.slots, statuses, in_router)
    rec.ever_ready = rec.ever_ready or rec.ready >= rec.replicas
    rec.state = service_state(rec, rec.ready, still_starting(rec.slots, statuses, in_router))
    if not records.save(session.store, rec):
        for job in {j for s in rec.slots for j in s.jobs()} - before:
            keeper_log(f"service ended while {job} was launched: cancelling it")
            session.cancel(job)
    return Look(statuses, in_router, failed, spent)


def _scale(session: ServiceSession, rec: ServiceRecord, statuses: dict[str, JobStatus], in_router: set[str],
           failed: list[str], lease: LeaseWatch | None = None, sighted: float | None = None) -> str | None:
    """The lease of pbstk run, autoscaling and ``--idle-cancel`` (services/keeper/scaler.py), before the slots, which
    carry a decision out; why the service must end now (its lease lapsed: once the replicas drained; idle), or
    ``None``. A failure (a launch refused) is this tick's error."""
    lapsed = lease.lapsed() if lease is not None else None
    if lapsed:  # what runs finishes first (services/lease.py), then the service ends as an idle one does
        drain_all(session, rec, statuses, in_router, drain_seconds())
        return lapsed
    try:
        return scaler.step(session, rec, statuses, in_router, sighted)
    except PbstkError as exc:
        failed.append(f"scaling: {exc.message}")
        keeper_log(failed[-1])
        return None


def _end_idle(session: ServiceSession, rec: ServiceRecord, why: str, seen: Look) -> Look:
    """``--idle-cancel`` of the service, or its lapsed lease: the keeper ends the whole service itself (recorded
    ENDED, ``why`` kept)."""
    from pbs_toolkit.services.stop import teardown

    rec.end_reason = why
    if records.save(session.store, rec):
        keeper_log(f"service {rec.name} ends: {why}")
        teardown(session, rec, "ENDED", keeper_wait_s=0)  # never waits for (or stops) this keeper
    return seen


def _retire(session: ServiceSession, rec: ServiceRecord, slot: Slot, statuses: dict[str, JobStatus],
            admin: RouterAdmin, in_router: set[str]) -> None:
    """A slot the autoscaler removes: its jobs leave the router; the one serving drains like a handed-over
    predecessor (slots.py ``drain``), the others are cancelled now; the tick drops the slot once it holds
    no job."""
    routed = set(in_router)  # before its jobs leave: which of them served (and is drained, not cut off)
    for url in scaler.retire_jobs(slot, statuses, in_router):
        admin.remove_worker(url)
        in_router.discard(url)
        keeper_log(f"slot {slot.index}: removed {url} from the router (scaling down)")
    for job in scaler.to_cancel(slot, statuses, routed):
        st = statuses.get(job)
        if st is None or not st.state.final:
            session.cancel(st.record if st is not None else job)
            keeper_log(f"slot {slot.index}: cancelled {job} (scaling down)")
    drain(session, slot, statuses)


def _statuses(session: ServiceSession, jobs: list[str]) -> tuple[dict[str, JobStatus], set[str]]:
    """One status query over the slots' jobs; a job the store no longer knows (its record cleaned away, a lost
    store) is left out, logged, and its slot treats it as lost, instead of failing every tick."""
    by_id = {r.job_id: r for r in session.store.all()} if jobs else {}
    known = [by_id[j] for j in jobs if j in by_id]
    unknown = {j for j in jobs if j not in by_id}
    for job in sorted(unknown):
        keeper_log(f"job {job} is not in the job store: treated as lost")
    return {st.record.job_id: st for st in session.status(known)} if known else {}, unknown
