"""The keeper: one detached process per service that keeps the router's worker list true to the replicas.

Started by ``serve`` as ``python -m pbs_toolkit _keeper NAME`` in its own session, on the machine where pbstk
runs (same job store, same transports). It holds ``services/NAME/keeper.lock`` while it runs, so only one keeper
per service ever runs and ``status`` can tell whether it does. Each tick (``PBSTK_SERVICE_POLL_S``, default 15):
one ``Client.status`` over the service's jobs (one scheduler query), then for each replica slot:

* a READY job that is not in the router is added; one that is not READY (ended, failed, restarting) is removed
  at once;
* keep-alive: a running job with a known walltime gets its successor, eligible ``handover`` seconds before the
  walltime ends (``begin_at``); when the successor is READY it is added, and on the next tick (the router has
  routed to it by then) the predecessor is removed, drained (its ``/metrics`` shows no running request, at most
  ``PBSTK_SERVICE_DRAIN_S``, default 60) and cancelled. A job that ends unexpectedly is replaced at once;
* a worker in the router that is none of the service's jobs is removed: the router's admin API has no
  authentication, so someone else added it.

The router admin connection (for a login-node router, an SSH tunnel) is kept open across ticks (``AdminLink``)
and opened afresh only after a failure or for a new router.

It stops when the service is recorded ended (``pbstk cancel NAME``) or its record is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.services import record as records
from pbs_toolkit.services.manage import launch_replica, poll_seconds, service_dir
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.state import ready_count, service_state

if TYPE_CHECKING:
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.router import RouterAdmin

#: a drained predecessor is looked at no sooner than this after leaving the router (requests in flight)
DRAIN_MIN_S = 2.0
#: the keeper's heartbeat in its service directory (``heartbeat``)
TICK_FILE = "keeper-tick.json"


def drain_seconds() -> float:
    """``PBSTK_SERVICE_DRAIN_S``: the most a predecessor is drained before it is cancelled (default 60)."""
    return env_float("PBSTK_SERVICE_DRAIN_S", 60.0, lambda v: 0 <= v <= 86400)


def _log(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    sys.stderr.flush()


def run(name: str) -> int:
    """The keeper's life: take the lock (another keeper holds it: exit 0), tick until the service ends."""
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.store import launcher_token

    directory = service_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(directory / "keeper.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _log(f"another keeper already keeps service {name}")
        return 0
    (directory / "keeper.json").write_text(json.dumps({"pid": os.getpid(), "token": launcher_token()}))
    (directory / TICK_FILE).unlink(missing_ok=True)  # an earlier keeper's (or service's) heartbeat is not ours
    _log(f"keeper of service {name} started (pid {os.getpid()})")
    try:
        with Client(on_removal=lambda r: None) as client, AdminLink(client) as link:
            while True:
                try:  # a store locked for a while, a router or scheduler that fails: logged, tried next tick
                    rec = records.load(client.store, name)
                    if rec is None or rec.ended is not None:
                        _log(f"service {name} {'is gone' if rec is None else 'ended'}; keeper stops")
                        return 0
                    tick(client, rec, link)
                    heartbeat(name, None)
                except PbstkError as exc:
                    _log(f"tick failed: {exc.message}")
                    heartbeat(name, exc.message)
                except Exception as exc:  # noqa: BLE001 - nothing a tick meets may end the keeper for good
                    _log(f"tick failed: {type(exc).__name__}: {exc}")
                    heartbeat(name, f"{type(exc).__name__}: {exc}")
                time.sleep(poll_seconds())
    finally:
        os.close(fd)


def heartbeat(name: str, error: str | None) -> None:
    """``keeper-tick.json``: when the last tick succeeded, and the last failure since (``status`` shows a keeper
    that runs but makes no progress). Written atomically; a full disk only costs the note."""
    path = service_dir(name) / TICK_FILE
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    now = time.time()
    body = {"ok_at": now, "error": None, "error_at": None, "failures": 0} if error is None else {
        "ok_at": old.get("ok_at"), "error": error, "error_at": now, "failures": int(old.get("failures") or 0) + 1}
    tmp = path.with_name(f".{TICK_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
    except OSError:
        pass


def last_tick(name: str) -> dict[str, Any]:
    """What the keeper's ``heartbeat`` last wrote (``ok_at``, ``error``, ``error_at``, ``failures``); ``{}``
    before its first tick."""
    try:
        data = json.loads((service_dir(name) / TICK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class AdminLink:
    """The router's admin connection, kept open across ticks: for a login-node router that is one SSH tunnel
    for the keeper's life instead of one per tick. Reopened only after a failure (``drop``) or when the
    router's record changes (a new router, another address)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._stack: ExitStack | None = None
        self._admin: RouterAdmin | None = None
        self._for: dict[str, Any] = {}
        #: how many times a connection was opened (tests count them)
        self.opened = 0

    def get(self, rec: ServiceRecord) -> RouterAdmin:
        from pbs_toolkit.services.router import RouterInfo, open_admin

        if self._admin is not None and self._for == rec.router:
            return self._admin
        self.drop()
        stack = ExitStack()
        try:
            admin = stack.enter_context(open_admin(self.client.runner(rec.transport), RouterInfo.from_dict(rec.router)))
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
                _log(f"closing the router connection: {exc}")

    def __enter__(self) -> AdminLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


def worker_url(st: JobStatus) -> str | None:
    """``http://host:port`` of a job's server (the router adds ``/v1/...`` itself)."""
    from pbs_toolkit.endpoints import endpoint_url

    if not st.address or not st.port:
        return None
    return endpoint_url(st)[: -len("/v1")]


def tick(client: Client, rec: ServiceRecord, link: AdminLink | None = None) -> None:
    """One look and the reconciliation it calls for; the record is saved unless the service ended meanwhile
    (then whatever this tick launched is cancelled again). ``link``: the router connection kept across ticks
    (without one, a connection for this tick only)."""
    from pbs_toolkit.services import intents

    for slot in rec.slots:  # a launch that a killed keeper (or serve) left half done: its job takes its role
        if slot.launching and not intents.settle(client, rec, slot):
            _log(f"slot {slot.index}: the submission of {slot.launching} has not finished yet")
    jobs = [j for s in rec.slots for j in s.jobs()]
    statuses, unknown = _statuses(client, jobs)
    before = set(jobs)
    failed: list[str] = []
    with ExitStack() as own:
        if link is None:
            link = own.enter_context(AdminLink(client))
        admin = link.get(rec)
        try:
            in_router = set(admin.workers())
            for slot in rec.slots:
                try:  # one slot that fails (a launch refused, a job that cannot be cancelled) spoils no other
                    _reconcile(client, rec, slot, statuses, admin, in_router)
                except intents.ServiceEnded:
                    raise
                except PbstkError as exc:
                    failed.append(f"slot {slot.index}: {exc.message}")
                    _log(failed[-1])
            _remove_foreign([j for j in jobs if j not in unknown], statuses, admin, in_router)
        except PbstkError:
            link.drop()  # a router or tunnel that failed is opened afresh next tick
            raise
    states = {j: st.state.value for j, st in statuses.items()}
    rec.ready = ready_count(rec.slots, states)
    rec.ever_ready = rec.ever_ready or rec.ready > 0
    rec.state = service_state(rec, rec.ready)
    if not records.save(client.store, rec):
        for job in {j for s in rec.slots for j in s.jobs()} - before:
            _log(f"service ended while {job} was launched: cancelling it")
            client.cancel(job)
    if failed:
        raise PbstkError("; ".join(failed))


def _statuses(client: Client, jobs: list[str]) -> tuple[dict[str, JobStatus], set[str]]:
    """One status query over the slots' jobs; a job the store no longer knows (its record cleaned away, a lost
    store) is left out, logged, and its slot treats it as lost, instead of failing every tick."""
    by_id = {r.job_id: r for r in client.store.all()} if jobs else {}
    known = [by_id[j] for j in jobs if j in by_id]
    unknown = {j for j in jobs if j not in by_id}
    for job in sorted(unknown):
        _log(f"job {job} is not in the job store: treated as lost")
    return {st.record.job_id: st for st in client.status(*known)} if known else {}, unknown


def _sync_router(st: JobStatus | None, admin: RouterAdmin, in_router: set[str]) -> None:
    """READY and not in the router: add; in the router and not READY: remove."""
    url = worker_url(st) if st is not None else None
    if st is None or url is None:
        return
    if st.state.value == "READY" and url not in in_router:
        admin.add_worker(url)
        in_router.add(url)
        _log(f"added {st.record.job_id} ({url}) to the router")
    elif st.state.value != "READY" and url in in_router:
        admin.remove_worker(url)
        in_router.discard(url)
        _log(f"removed {st.record.job_id} ({url}) from the router: {st.state.value}")


def _remove_foreign(jobs: list[str], statuses: dict[str, JobStatus], admin: RouterAdmin,
                    in_router: set[str]) -> None:
    """Remove every worker that is none of the service's jobs. The router's admin API has no authentication
    (docs/services.md "The router"): whoever reaches its port can add a worker of theirs, which would then receive
    prompts with the service's key. Skipped in a tick where the scheduler did not answer for some job (its
    worker could be one of those)."""
    if any(job not in statuses or statuses[job].state.value == "UNKNOWN" for job in jobs):
        return
    ours = {url for st in statuses.values() if (url := worker_url(st)) is not None}
    for url in sorted(in_router - ours):
        admin.remove_worker(url)
        in_router.discard(url)
        _log(f"removed {url} from the router: not a replica of this service (added by someone else)")


def _reconcile(client: Client, rec: ServiceRecord, slot: Slot, statuses: dict[str, JobStatus],
               admin: RouterAdmin, in_router: set[str]) -> None:
    cur = statuses.get(slot.current) if slot.current else None
    suc = statuses.get(slot.successor) if slot.successor else None
    # the successor takes over one tick after it joined the router, not in the tick that added it: removing the
    # predecessor right after /add_worker left the router with no usable worker for an instant (two 503s seen
    # under load in tests/test_service.py's handover)
    suc_url = worker_url(suc) if suc is not None else None
    joined = suc_url is not None and suc_url in in_router
    _sync_router(cur, admin, in_router)
    _sync_router(suc, admin, in_router)
    if suc is not None and suc.state.value == "READY" and joined:
        _hand_over(slot, cur, suc, admin, in_router)
        cur, suc = suc, None
    _drain(client, slot, statuses)
    slot.state = cur.state.value if cur is not None else "LOST"
    if cur is None or cur.state.final:
        _replace(client, rec, slot, suc)
    elif (rec.keep_alive and slot.successor is None and not slot.launching and cur.uptime_s is not None
          and cur.walltime_s):
        begin = time.time() - cur.uptime_s + cur.walltime_s - rec.handover_s
        launch_replica(client, rec, slot, "successor", begin_at=begin if begin > time.time() + 1 else None)
        _log(f"slot {slot.index}: successor {slot.successor} of {slot.current} eligible at "
             f"{time.strftime('%H:%M:%S', time.localtime(max(begin, time.time())))}")


def _hand_over(slot: Slot, cur: JobStatus | None, suc: JobStatus, admin: RouterAdmin, in_router: set[str]) -> None:
    """The successor is READY (and in the router): the predecessor leaves the router and starts draining."""
    if cur is not None:
        url = worker_url(cur)
        if url and url in in_router:
            admin.remove_worker(url)
            in_router.discard(url)
        if not cur.state.final:
            slot.draining, slot.drain_started = slot.current, time.time()
    _log(f"slot {slot.index}: {suc.record.job_id} took over from {slot.current}")
    slot.current, slot.successor = slot.successor, None


def _drain(client: Client, slot: Slot, statuses: dict[str, JobStatus]) -> None:
    """Cancel the drained predecessor once its server runs no request (or after the drain bound)."""
    if not slot.draining:
        return
    st = statuses.get(slot.draining)
    waited = time.time() - (slot.drain_started or 0)
    if st is not None and not st.state.final:
        if waited < min(DRAIN_MIN_S, drain_seconds()):
            return
        if waited < drain_seconds() and _running(client, st):
            return
        client.cancel(st.record)
        _log(f"slot {slot.index}: drained and cancelled {slot.draining} after {waited:.0f} s")
    slot.draining, slot.drain_started = None, None


def _running(client: Client, st: JobStatus) -> bool:
    """Whether the server still runs requests (its ``/metrics``); a server that does not answer runs none."""
    from pbs_toolkit.perf.scrape import scrape

    try:
        snap = scrape(client.runner(st.record.transport), st, timeout=3.0)
    except PbstkError:
        return False
    return bool(snap.running)


def _replace(client: Client, rec: ServiceRecord, slot: Slot, suc: JobStatus | None) -> None:
    """The current job has ended: a successor already starting (or queued past its begin time) takes its place;
    with keep-alive one still waiting for its handover time (state W) is cancelled and a replacement launched now."""
    if slot.current is None and slot.successor is None and not slot.launching:
        launch_replica(client, rec, slot)  # never launched (a serve killed before it got there): launch it now
        _log(f"slot {slot.index}: had no job; {slot.current} launched")
        return
    if not rec.keep_alive:
        if suc is not None and not suc.state.final:
            slot.current, slot.successor = slot.successor, None
        return
    if suc is not None and not suc.state.final and suc.scheduler_state != "W":
        # starting, or queued past its begin time (waiting for resources): it keeps its place in the queue
        slot.current, slot.successor = slot.successor, None
        return
    if slot.launching:  # a replacement's submission not settled yet (services/intents.py): never a second one
        return
    if suc is not None and not suc.state.final:  # still waiting for its handover time (W): too late now
        client.cancel(suc.record)
    ended = slot.current
    slot.successor = None
    launch_replica(client, rec, slot)
    _log(f"slot {slot.index}: {ended} ended unexpectedly; replacement {slot.current} launched")
