"""``wait_until_ready``: returns the moment the server answers, fails fast with the cause when it cannot.

Scheduler queries follow docs/pbs.md "Polling politely" (2, 4, 8 s, then every 30 s); once the job runs, the run
directory and the server's HTTP endpoints are polled quickly, since they cost the scheduler nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import SchedulerUnavailable, ServerFailed, WaitTimeout
from pbs_toolkit.jobs.logs import tail_lines
from pbs_toolkit.jobs.status import JobStatus, ServerState, observe, query_group, remember_final, without_scheduler
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import SchedState, SchedulerJob
from pbs_toolkit.transports import Runner, open_runner

DEFAULT_SCHEDULER_INTERVALS = (2.0, 4.0, 8.0, 30.0)
#: how long a fatal log line must stand (with the server not restarting) before we give up
FATAL_GRACE_S = 3.0
#: ... or, when the start script will restart it in eager mode, until that restart shows up
FALLBACK_GRACE_S = 120.0
#: when the run directory says the job ended, ask the scheduler why for at most this long (E -> F)
CONFIRM_END_S = 5.0
#: a server that says it is ready but cannot be reached from here for this long fails the wait
#: (``PBSTK_UNREACHABLE_GRACE_S``): a restart or a slow resolver gets a moment, a wrong address does not wait an hour
DEFAULT_UNREACHABLE_GRACE_S = 10.0


def unreachable_grace() -> float:
    return env_float("PBSTK_UNREACHABLE_GRACE_S", DEFAULT_UNREACHABLE_GRACE_S, lambda v: 0 <= v < float("inf"))


def scheduler_intervals() -> tuple[float, ...]:
    """``PBSTK_POLL_INTERVALS=2,4,8,30`` overrides the ramp (the last value repeats)."""
    raw = os.environ.get("PBSTK_POLL_INTERVALS")
    if not raw:
        return DEFAULT_SCHEDULER_INTERVALS
    try:
        values = tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        return DEFAULT_SCHEDULER_INTERVALS
    return values or DEFAULT_SCHEDULER_INTERVALS


def _failure(st: JobStatus, runner: Runner) -> ServerFailed:
    where = f" (log: {st.log_file})"  # a failed worker's own log on a job over several nodes
    details = st.log_excerpt
    if not details:  # cancelled, lost or walltime: the log's last lines still say how far it got
        details = [line for line in tail_lines(runner, st.log_file, 8) if line.strip()]
    return ServerFailed(f"job {st.record.job_id} is {st.state.value}: {st.reason or 'no reason given'}{where}",
                        details=details)


def _confirm_end(runner: Runner, record: JobRecord, st: JobStatus,
                 sched: SchedulerJob | None) -> tuple[JobStatus, SchedulerJob | None]:
    """The run directory says the job ended but the scheduler was last asked while it ran: ask again.

    Only the scheduler knows *why* (its backend's ``Outcome``: walltime, cancelled, ...), and only once the
    job is finished. A few queries, once per job, then the run directory's verdict stands. Returns the status and
    the scheduler's latest view of the job.
    """
    if sched is None or sched.state is SchedState.FINISHED or st.failed_node is not None:
        return st, sched  # (a failed worker's marker already says why; the scheduler adds nothing to that)
    deadline = time.monotonic() + CONFIRM_END_S
    while True:
        try:
            fresh = query_group(runner, [record])[record.job_id]
        except SchedulerUnavailable:
            fresh = None
        if fresh is not None and fresh.state is SchedState.FINISHED:
            confirmed = observe(runner, record, fresh)
            return (confirmed, fresh) if confirmed.state.final else (st, sched)
        if time.monotonic() + 1.0 > deadline:
            return st, sched
        time.sleep(1.0)


def _fatal_grace(st: JobStatus) -> float:
    """How long a fatal log line may stand before we give up: long when an eager restart is coming."""
    return FALLBACK_GRACE_S if st.restart_expected else FATAL_GRACE_S


@dataclass
class _Waiter:
    """The state of one wait: the scheduler's poll ramp and last view, the foreign-server timer, the fatal grace.

    Each loop step is one method, so every rule (polite polling, READY only once /v1/models proved the server is
    ours, a fatal line must stand a while, a foreign verdict must stand on one address) reads on its own.
    """

    record: JobRecord
    runner: Runner
    store: JobStore | None
    on_progress: Callable[[JobStatus, float], None] | None
    poll: float
    intervals: tuple[float, ...]
    start: float
    next_query: float = 0.0
    query_index: int = 0
    sched: SchedulerJob | None = None
    fatal_since: float | None = None
    last_key: tuple[object, ...] | None = None
    marker_seen: bool = False
    unreachable: str | None = None  # set while the scheduler has never answered
    answered: bool = False
    foreign: tuple[tuple[str | None, int | None], float] | None = None
    unreachable_since: float | None = None

    def ask_scheduler(self, now: float) -> bool:
        """Query the scheduler when the ramp says so; True for a new answer (counts towards LOST)."""
        if now < self.next_query:
            return False
        fresh = False
        try:
            self.sched = query_group(self.runner, [self.record])[self.record.job_id]
            self.answered, self.unreachable, fresh = True, None, True
        except SchedulerUnavailable as exc:
            # transient: keep the last known state; with none yet, judge from the run directory only
            self.unreachable = None if self.answered else str(exc)
        running = self.sched is not None and self.sched.state in (SchedState.RUNNING, SchedState.EXITING)
        self.next_query = now + self.intervals[min(self.query_index, len(self.intervals) - 1)]
        self.query_index += 1
        if running:  # the job's own files now tell us more than the scheduler
            self.next_query = now + max(self.intervals[-1], 10.0)
        return fresh

    def look(self, now: float, fresh: bool) -> JobStatus:
        """The same rules as `pbstk status`: READY only once /v1/models proved the server is ours."""
        st = observe(self.runner, self.record, self.sched, store=self.store, answered=self.answered, counted=fresh)
        if self.unreachable is not None:
            st = without_scheduler(st, self.unreachable)
        if st.state is ServerState.PENDING and not self.marker_seen:
            # The start script wrote its marker: the job runs. Ask the scheduler now rather than at
            # the end of a 30 s back-off (one extra query per job).
            self.marker_seen = self.runner.size(f"{self.record.run_dir}/server.json") is not None
            if self.marker_seen:
                self.next_query = now + self.poll
        return st

    def report(self, st: JobStatus, elapsed: float) -> None:
        """Tell ``on_progress`` only what changed, so a caller's progress lines do not repeat."""
        key = (st.state, st.phase, st.comment, st.scheduler_state, st.estimated_start)
        if self.on_progress and key != self.last_key:
            self.on_progress(st, elapsed)
        self.last_key = key

    def check_foreign(self, st: JobStatus, now: float) -> None:
        """A wrong key or model is usually *another* job's server: fail only once it stands on one address.

        Two jobs on one node may pick the same free port, and the loser moves on and rewrites its marker. Only a
        verdict that stands on the same address for a while is about this job.
        """
        if st.foreign is None:
            self.foreign = None
            return
        where = (st.address, st.port)
        if self.foreign is None or self.foreign[0] != where:
            self.foreign = (where, now)
        elif now - self.foreign[1] >= FATAL_GRACE_S:
            raise ServerFailed(f"the server at {st.url} {st.foreign}: is this the right job?")

    def check_reachable(self, st: JobStatus, now: float) -> None:
        """The server says it is ready but its address cannot be reached from here: no log will explain that."""
        if st.unreachable is None:
            self.unreachable_since = None
            return
        self.unreachable_since = self.unreachable_since or now
        if now - self.unreachable_since >= unreachable_grace():
            raise ServerFailed(f"job {st.record.job_id}: {st.unreachable}",
                               details=["the address is the node's name as the profile's `address` and "
                                        "`address_suffix` make it (`pbstk config show` prints both); the job keeps "
                                        f"running until `pbstk cancel {st.record.job_id}`"])

    def check_failed(self, st: JobStatus, now: float) -> None:
        """Raise once the job failed: at once when final, after the grace when only the log says so."""
        if st.state is ServerState.FAILED and not st.confirmed:
            self.fatal_since = self.fatal_since or now
            if now - self.fatal_since >= _fatal_grace(st):
                raise _failure(st, self.runner)
        elif st.state.final:
            self.fail_final(st)
        else:
            self.fatal_since = None

    def fail_final(self, st: JobStatus) -> NoReturn:
        """The job ended: ask the scheduler why, remember the verdict, raise it."""
        confirmed, latest = _confirm_end(self.runner, self.record, st, self.sched)
        if self.on_progress and (confirmed.state, confirmed.reason) != (st.state, st.reason):
            self.on_progress(confirmed, time.monotonic() - self.start)
        if self.answered:  # a scheduler that never answered cannot have settled anything
            remember_final(self.store, confirmed, latest)
        raise _failure(confirmed, self.runner)


def _timed_out(record: JobRecord, st: JobStatus, timeout: float) -> WaitTimeout:
    return WaitTimeout(
        f"job {record.job_id} was not ready after {timeout:g} s (state {st.state.value}"
        f"{', ' + st.phase if st.phase else ''}); `pbstk logs {record.job_id}` shows why"
    )


def wait_until_ready(
    record: JobRecord,
    *,
    timeout: float = 3600.0,
    store: JobStore | None = None,
    runner: Runner | None = None,
    on_progress: Callable[[JobStatus, float], None] | None = None,
    poll: float = 0.5,
    intervals: Sequence[float] | None = None,
) -> JobStatus:
    """Block until ``record``'s server is READY; return its status. Raises ``ServerFailed``/``WaitTimeout``."""
    own = runner is None
    runner = runner or open_runner(record.transport or None)
    start = time.monotonic()
    w = _Waiter(record, runner, store, on_progress, poll, tuple(intervals or scheduler_intervals()), start,
                next_query=start)
    try:
        while True:
            now = time.monotonic()
            st = w.look(now, w.ask_scheduler(now))
            elapsed = now - start
            w.report(st, elapsed)
            if st.state is ServerState.READY:
                if store is not None:
                    store.update_extra(record, ready_after_s=round(elapsed, 1))
                return st
            w.check_foreign(st, now)
            w.check_reachable(st, now)
            w.check_failed(st, now)
            if elapsed > timeout:
                raise _timed_out(record, st, timeout)
            time.sleep(poll)
    finally:
        if own:
            runner.close()


def require_ready(st: JobStatus, hint: str) -> JobStatus:
    """``st`` when READY; else ``ServerFailed`` saying why, ending in ``hint`` (how to wait, in the caller's words)
    for a job that has not ended (waiting helps only that one)."""
    if st.state is not ServerState.READY:
        advice = "it has ended: `pbstk launch` a new one" if st.state.final else hint
        raise ServerFailed(f"job {st.record.job_id} is {st.state.value}, not READY"
                           f"{': ' + st.reason if st.reason else ''} ({advice})")
    return st
