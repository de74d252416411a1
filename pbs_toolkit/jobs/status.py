"""Server state: the scheduler's view, the run directory's markers and the server's own HTTP answer, combined.

One scheduler query per transport per call, whatever the number of jobs (docs/pbs.md "Status": never
poll per job); the run directories and servers are then looked at concurrently, each probe with a short timeout.

Two rules keep status from lying:

* READY means the server proved it is the job's own: the key-authenticated ``/v1/models`` lists the served
  name (checked once per address and port, remembered in ``extra["verified_endpoint"]``). A server that
  answers ``/health`` but not as ours keeps the job STARTING ("port N answered by another server").
* LOST is recorded only after the scheduler has not known the job in ``LOST_AFTER_POLLS`` consecutive
  answers spanning ``PBSTK_LOST_AFTER_S`` seconds (default 60) during which the run directory showed no sign
  of life: the job's own server did not answer, and neither ``vllm.log`` nor ``server.json`` changed (a change
  restarts the count). Until then the job is UNKNOWN with the count in its reason (``extra["sched_absence"]``).
  A scheduler that did not answer at all (hung, killed, garbled) counts for nothing either way.
"""

from __future__ import annotations

import enum
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, SchedulerError, SchedulerUnavailable, TransportError
from pbs_toolkit.jobs import idle
from pbs_toolkit.jobs.nodes import NodeMarker, NodesView, node_log_name, node_phase_text
from pbs_toolkit.jobs.rundir import VERIFIED_KEY, RunDirView, look, look_all
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import JobRef, Outcome, SchedState, SchedulerJob, get_scheduler
from pbs_toolkit.server.phases import FINAL_PHASES, Phase
from pbs_toolkit.transports import Runner, open_runner
from pbs_toolkit.transports.http import Identity

#: consecutive scheduler answers without the job before it may be LOST ...
LOST_AFTER_POLLS = 3
#: ... spanning at least this many seconds (``PBSTK_LOST_AFTER_S``)
DEFAULT_LOST_AFTER_S = 60.0
#: record.extra key owned by this module (``rundir`` owns ``verified_endpoint``)
ABSENCE_KEY = "sched_absence"
#: a running job with less walltime left than this is flagged (``walltime_ending``): about to be killed
WALLTIME_ENDING_S = 600


def lost_after_s() -> float:
    """``PBSTK_LOST_AFTER_S``: how long the scheduler must not know a job before it is LOST (default 60)."""
    return env_float("PBSTK_LOST_AFTER_S", DEFAULT_LOST_AFTER_S, lambda v: 0 <= v < float("inf"))


class ServerState(enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    FINISHED = "FINISHED"
    CANCELLED = "CANCELLED"
    LOST = "LOST"
    #: the scheduler did not answer and neither the run directory nor HTTP tells (transient; not final)
    UNKNOWN = "UNKNOWN"

    @property
    def final(self) -> bool:
        return self in (ServerState.FAILED, ServerState.FINISHED, ServerState.CANCELLED, ServerState.LOST)


@dataclass
class JobStatus:
    record: JobRecord
    state: ServerState
    scheduler_state: str | None = None
    comment: str | None = None
    phase: str | None = None
    node: str | None = None
    address: str | None = None
    port: int | None = None
    exit_status: int | None = None
    reason: str | None = None
    eager_fallback: bool = False
    log_excerpt: list[str] = field(default_factory=list)
    #: False when only a log line says FAILED and the process may still restart (eager fallback)
    confirmed: bool = True
    #: the log shows a graph/compile failure and the start script will restart the server in eager mode
    restart_expected: bool = False
    #: another server answers on the job's port: how it gave itself away (``rejected the API key (401)``)
    foreign: str | None = None
    #: the server says it is ready but pbstk cannot reach its address (DNS, route, refused), in words
    unreachable: str | None = None
    #: seconds the job has been running, per its scheduler (``None``: not running, or not known)
    uptime_s: float | None = None
    #: the job's walltime limit in seconds (``None``: none, or not known)
    walltime_s: int | None = None
    #: when the scheduler expects the queued job to start (epoch seconds), if it says
    estimated_start: float | None = None
    #: a job over several nodes: how many, how many are up (``None``: single-node), every node's marker
    nnodes: int = 1
    nodes_ready: int | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    #: the worker whose failure ended the job (its log is ``vllm.node<K>.log``); ``None``: the head, or none
    failed_node: int | None = None

    @property
    def nodes_text(self) -> str | None:
        """``2/2 nodes`` for a job over several nodes, ``None`` for a single-node one."""
        if self.nnodes <= 1 or self.nodes_ready is None:
            return None
        return f"{self.nodes_ready}/{self.nnodes} nodes"

    @property
    def log_file(self) -> str:
        """The log that explains this status: the failed worker's, else the head's ``vllm.log``."""
        return f"{self.record.run_dir}/{node_log_name(self.failed_node or 0)}"

    @property
    def walltime_left_s(self) -> float | None:
        """Seconds until the scheduler kills the running job for its walltime (``None``: not known)."""
        if self.uptime_s is None or self.walltime_s is None:
            return None
        return max(0.0, self.walltime_s - self.uptime_s)

    @property
    def walltime_ending(self) -> bool:
        """Within ``WALLTIME_ENDING_S`` of the walltime: clients should expect the server to go away soon."""
        left = self.walltime_left_s
        return left is not None and left <= WALLTIME_ENDING_S

    @property
    def url(self) -> str | None:
        if self.address and self.port:
            return f"http://{self.address}:{self.port}/v1"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The ``job`` object of ``status``/``wait --json``: the record's fields exactly as ``jobs --json``
        prints them (``JobRecord.to_dict``), then the state fields (docs/json.md)."""
        return {
            **self.record.to_dict(), "state": self.state.value,
            "scheduler_state": self.scheduler_state, "phase": self.phase, "node": self.node,
            "address": self.address, "port": self.port, "url": self.url, "exit_status": self.exit_status,
            "comment": self.comment, "reason": self.reason, "eager_fallback": self.eager_fallback,
            "confirmed": self.confirmed, "restart_expected": self.restart_expected, "foreign": self.foreign,
            "unreachable": self.unreachable,
            "log_excerpt": self.log_excerpt,
            "uptime_s": _rounded(self.uptime_s), "walltime_s": self.walltime_s,
            "walltime_left_s": _rounded(self.walltime_left_s), "walltime_ending": self.walltime_ending,
            "estimated_start": self.estimated_start,
            "nnodes": self.nnodes, "nodes_ready": self.nodes_ready, "nodes": self.nodes,
            "failed_node": self.failed_node, "ended": idle.ended_how(self.state.value, self.reason),
        }


def _rounded(seconds: float | None) -> int | None:
    return None if seconds is None else int(round(seconds))


@dataclass(frozen=True)
class Absence:
    """How long the scheduler has not known a job: consecutive answers, and seconds since the first of them."""

    polls: int
    seconds: float

    @property
    def settled(self) -> bool:
        """Long enough to call the job LOST (when nothing in its run directory says otherwise)."""
        return self.polls >= LOST_AFTER_POLLS and self.seconds >= lost_after_s()


def current_attempt(lines: Sequence[str]) -> list[str]:
    """Log lines of the newest start attempt (an eager fallback leaves the failed attempt above it)."""
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("pbstk: ") and ": starting vLLM on " in lines[index]:
            return list(lines[index:])
    return list(lines)


_SIGNALS = {15: "SIGTERM", 9: "SIGKILL", 2: "SIGINT", 1: "SIGHUP"}


def classify(outcome: Outcome | None, code: int | None = None) -> tuple[ServerState, str]:
    """How the job ended (as its backend put it) -> state and reason. No scheduler's codes are known here."""
    if outcome is Outcome.EXITED and code == 0:
        return ServerState.FINISHED, "exited normally"
    if outcome is Outcome.EXITED:
        return ServerState.FAILED, f"the job script exited with code {code}"
    if outcome is Outcome.WALLTIME:
        return ServerState.FAILED, "walltime exceeded: the scheduler killed the job"
    if outcome is Outcome.SCHEDULER_ERROR:
        return ServerState.FAILED, f"the scheduler could not run the job (execution code {code})"
    if outcome is Outcome.KILLED:
        return ServerState.CANCELLED, f"killed by signal {code} ({_SIGNALS.get(code or 0, '?')}), e.g. a cancel"
    if outcome is Outcome.CANCELLED:
        return ServerState.CANCELLED, "stopped by a signal (pbstk cancel)"
    return ServerState.CANCELLED, "deleted before it ran"  # NEVER_RAN


def combine(
    record: JobRecord,
    sched: SchedulerJob | None,
    marker: dict[str, Any] | None,
    log_lines: list[str],
    health_status: int | None,
    identity: Identity | None = None,
    absence: Absence | None = None,
    answered: bool = True,
) -> JobStatus:
    """The truth about one job from everything we could observe. Pure: tested without any I/O.

    ``identity``: what ``/v1/models`` said when ``/health`` answered 200 (READY needs it to be ours).
    ``absence``: how long the scheduler has not known the job, when ``sched`` is ``None`` because it answered
    without it; ``answered=False`` means it did not answer at all (that tells nothing about the job).
    """
    from pbs_toolkit.vllm.startup import find_fatal

    attempt = current_attempt(log_lines)
    st = _seed(record, sched, marker)
    ours = health_status == 200 and identity is not None and identity.ours
    phase = (marker or {}).get("phase")
    fatal = find_fatal(attempt)
    if sched is not None and sched.state in (SchedState.QUEUED, SchedState.HELD):
        st.state = ServerState.PENDING
        if sched.state is SchedState.HELD:
            st.reason = "held by the scheduler"
        return st
    if sched is not None and sched.outcome is not None:
        return _ended_by_scheduler(st, sched, phase, fatal, attempt)
    if phase in FINAL_PHASES:
        return _ended_in_run_dir(st, marker, phase, fatal, attempt)
    if sched is None and not (ours and not answered):
        return _unlisted(st, ours, answered, absence)
    # running (or exiting, or the scheduler did not answer but the server proves it is ours)
    if ours:
        st.state, st.phase = ServerState.READY, Phase.READY.value
        return st
    return _not_ready(st, phase, fatal, attempt, health_status, identity)


def _seed(record: JobRecord, sched: SchedulerJob | None, marker: dict[str, Any] | None) -> JobStatus:
    """A status holding what the run directory's marker and the scheduler say about where the job is."""
    st = JobStatus(record=record, state=ServerState.LOST)
    if marker:
        st.address = marker.get("address") or None
        st.port = marker.get("port") or None
        st.node = marker.get("host") or None
        st.eager_fallback = bool(marker.get("eager_fallback"))
    if sched:
        st.scheduler_state = sched.raw_state
        st.comment = sched.comment
        st.exit_status = sched.exit_status
        st.node = sched.exec_host or st.node
        st.uptime_s, st.walltime_s, st.estimated_start = sched.uptime_s, sched.walltime_s, sched.estimated_start
    return st


def _failed(st: JobStatus, reason: str, fatal: list[str] | None, attempt: list[str]) -> JobStatus:
    st.state, st.reason = ServerState.FAILED, reason
    st.log_excerpt = fatal or [line for line in attempt[-8:] if line.strip()]
    return st


def _ended_by_scheduler(st: JobStatus, sched: SchedulerJob, phase: str | None, fatal: list[str] | None,
                        attempt: list[str]) -> JobStatus:
    """The backend says how the job ended (possibly while still exiting; status() records it only once
    finished); the run directory may refine why."""
    state, reason = classify(sched.outcome, sched.outcome_code)
    if phase == Phase.CANCELLED and sched.outcome is not Outcome.WALLTIME:
        # the start script trapped the stop signal and exited on its own (so the code is its own, e.g. 143)
        state, reason = ServerState.CANCELLED, "stopped by a signal (pbstk cancel or the scheduler's own)"
    if state is ServerState.FAILED or (state is ServerState.FINISHED and phase == Phase.FAILED):
        if phase == Phase.FAILED and fatal:
            reason = f"vLLM failed before it was ready: {fatal[0]}"
        return _failed(st, reason, fatal, attempt)
    st.state, st.reason = state, reason
    return st


def _ended_in_run_dir(st: JobStatus, marker: dict[str, Any] | None, phase: str | None, fatal: list[str] | None,
                      attempt: list[str]) -> JobStatus:
    """The run directory explains the end: the scheduler forgot the job (history off or expired), or has not
    noticed yet (R/E for a moment after the start script exits)."""
    code = (marker or {}).get("exit_code")
    st.exit_status = code
    if phase == Phase.CANCELLED:
        st.state, st.reason = ServerState.CANCELLED, "stopped by a signal"
        return st
    if phase == Phase.FAILED:
        reason = f"vLLM failed before it was ready: {fatal[0]}" if fatal else f"start failed (exit {code})"
        return _failed(st, reason, fatal, attempt)
    st.state, st.reason = (ServerState.FINISHED, "exited normally") if code == 0 else (
        ServerState.FAILED, f"vLLM exited with code {code}")
    return st


def _not_ready(st: JobStatus, phase: str | None, fatal: list[str] | None, attempt: list[str], health_status: int | None,
               identity: Identity | None) -> JobStatus:
    """A running job whose server has not proved it is ours: failing (maybe restarting), or still starting."""
    from pbs_toolkit.vllm.startup import current_phase, is_compile_failure

    if fatal:
        st.confirmed = False
        st.restart_expected = (not st.record.spec.eager and not st.eager_fallback
                               and is_compile_failure(attempt))
        return _failed(st, f"vLLM failed: {fatal[0]}", fatal, attempt)
    st.state = ServerState.STARTING
    st.phase = "job started" if phase is None or phase == Phase.SETUP else current_phase(attempt)
    if health_status == 200 and identity is not None and identity.foreign:
        st.foreign = identity.detail
        st.phase = f"port {st.port} answered by another server (it {identity.detail})"
    elif st.eager_fallback:
        st.phase += " (eager fallback)"
    return st


def _unlisted(st: JobStatus, ours: bool, answered: bool, absence: Absence | None) -> JobStatus:
    """No scheduler state and no end in the run directory: UNKNOWN, or LOST once the absence is settled."""
    st.state = ServerState.UNKNOWN
    if not answered:
        st.reason = "the scheduler did not answer"
    elif ours:  # alive, whatever the scheduler says: never LOST, but not READY either
        st.reason = f"the scheduler no longer knows this job, but its server still answers at {st.url}"
    elif absence is not None and absence.settled:
        st.state = ServerState.LOST
        st.reason = "the scheduler no longer knows this job and its run directory does not explain it"
    else:
        polls, seconds = (absence.polls, absence.seconds) if absence else (0, 0.0)
        st.reason = (f"the scheduler did not list this job ({polls} answer(s) over {seconds:.0f} s); LOST after "
                     f"{LOST_AFTER_POLLS} over {lost_after_s():g} s without a sign of life in its run directory")
    return st


def with_nodes(st: JobStatus, nodes: NodesView, head_reason: Any = None, head_lines: Sequence[str] = ()) -> JobStatus:
    """A job over several nodes: READY only once every node is up, FAILED naming the worker that failed first.

    The head alone would hang (or answer ``/health`` for nothing) when a worker died, so a worker's ``failed``
    marker beats the head's answer. A node failure explains a job the scheduler ended badly, or a job still
    running; a cancelled or queued job stays what it is. ``head_reason``: ``server.json``'s ``reason``, the
    head's own words when it failed because of something other than a worker's marker (the launcher could not
    start a node, ...); ``head_lines``: the head's log (its compile failure restarts every node). Pure.
    """
    st.nnodes, st.nodes = nodes.nnodes, nodes.node_dicts()
    if st.state is ServerState.FAILED and st.confirmed and isinstance(head_reason, str) and head_reason.strip():
        st.reason = head_reason.strip()
    head_ours = st.state is ServerState.READY
    st.nodes_ready = sum(nodes.up(head_ours))
    running = not st.state.final or not st.confirmed  # the job should still be serving (or restarting)
    culprit = nodes.culprit(running)
    if culprit is not None and culprit.rank > 0 and st.state not in (ServerState.PENDING, ServerState.CANCELLED):
        settled = not running or nodes.stopped  # the job ended, or the head (or launcher) decided it is over
        attempts = (current_attempt(nodes.logs.get(culprit.rank, [])), current_attempt(head_lines))
        return _node_failed(st, culprit, attempts, settled)
    down = nodes.first_down(head_ours)
    if down is None or st.state not in (ServerState.READY, ServerState.STARTING):
        return st
    doing = node_phase_text(nodes, down, st.phase, current_attempt(nodes.logs.get(down, [])))
    st.state, st.phase = ServerState.STARTING, f"{st.nodes_ready}/{nodes.nnodes} nodes up ({doing})"
    return st


#: the start script's own log lines begin ``pbstk: HH:MM:SS``; a reason quoting one leaves that out
_PBSTK_STAMP = re.compile(r"^pbstk: (?:\d\d:\d\d:\d\d )?")


def _node_failed(st: JobStatus, node: NodeMarker, attempts: tuple[list[str], list[str]], settled: bool) -> JobStatus:
    """FAILED because worker ``node`` failed: its reason and log lines, not the head's.

    Confirmed once ``settled``. Before that the head has not decided yet (it checks its workers each second):
    it stops every node and fails, or, after a graph/compile error on any node (a worker also loses the head
    whose own compile failed), restarts them all in eager mode with a new attempt, and this marker is then old.
    ``wait`` gives an unconfirmed verdict a few seconds (120 s when an eager restart is expected).
    ``attempts``: the current attempt's lines of the node's log and of the head's."""
    from pbs_toolkit.vllm.startup import find_fatal, is_compile_failure

    attempt, head_attempt = attempts
    fatal = find_fatal(attempt)
    tail = [line for line in attempt[-8:] if line.strip()]
    verb = "failed" if node.phase == Phase.FAILED else "exited"
    code = f" with exit {node.exit_code}" if node.exit_code is not None else ""
    said = fatal[0] if fatal else (tail[-1] if tail else f"(nothing in {node_log_name(node.rank)})")
    said = _PBSTK_STAMP.sub("", said)  # "pbstk: 09:28:31 vLLM exited with code 137 ..." -> "vLLM exited ..."
    st.state, st.reason, st.failed_node = ServerState.FAILED, f"{node.name} {verb}{code}: {said}", node.rank
    st.log_excerpt = fatal or tail
    eager_next = not st.record.spec.eager and not st.eager_fallback
    compile_failed = is_compile_failure(attempt) or is_compile_failure(head_attempt)  # as the head decides
    st.restart_expected = not settled and eager_next and compile_failed
    st.confirmed = settled
    return st


def _save(store: JobStore | None, record: JobRecord, **values: Any) -> None:
    if store is not None:
        store.update_extra(record, **values)
    else:
        record.extra.update(values)


def note_absence(store: JobStore | None, record: JobRecord, fingerprint: list[int | None],
                 counted: bool) -> Absence:
    """Count one more scheduler answer without the job (when ``counted``); a changed run directory restarts
    the count. Kept in ``record.extra`` so separate ``pbstk`` calls add up."""
    now = time.time()
    prev: Any = record.extra.get(ABSENCE_KEY)
    try:
        since, polls, seen = float(prev["since"]), int(prev["polls"]), prev.get("fingerprint")
    except (TypeError, KeyError, ValueError, AttributeError):
        since, polls, seen = now, 0, None
    if counted:
        if polls and seen == fingerprint:
            polls += 1
        else:
            since, polls = now, 1
        _save(store, record, **{ABSENCE_KEY: {"since": since, "polls": polls, "fingerprint": fingerprint}})
    return Absence(polls, max(0.0, now - since))


def judge(record: JobRecord, sched: SchedulerJob | None, view: RunDirView, *, store: JobStore | None = None,
          answered: bool = True, counted: bool = True) -> JobStatus:
    """The status from one look, keeping the absence count and the verified address in ``record.extra``.

    ``answered``: the scheduler answered this poll (``sched`` is ``None`` because it does not know the job);
    ``counted``: this is a fresh answer, not the last one reused between polls.
    """
    absence = None
    if answered and sched is None:
        absence = note_absence(store, record, view.fingerprint, counted)
    elif answered and record.extra.get(ABSENCE_KEY):
        _save(store, record, **{ABSENCE_KEY: None})
    st = combine(record, sched, view.marker, view.lines, view.health, identity=view.identity, absence=absence,
                 answered=answered)
    st = idle.mark(st, view.lines)  # stopped by its idle watcher (--idle-cancel): says so
    if view.nodes is not None:
        st = with_nodes(st, view.nodes, (view.marker or {}).get("reason"), view.lines)
    if view.identity is not None and view.identity.ours and view.marker:
        where = f"{view.marker.get('address') or '127.0.0.1'}:{view.marker['port']}"
        if record.extra.get(VERIFIED_KEY) != where:
            _save(store, record, **{VERIFIED_KEY: where})
    if view.problem:
        st.reason = f"{st.reason} ({view.problem})" if st.reason else view.problem
        if st.state is ServerState.STARTING:
            st.phase = f"{st.phase}; {view.problem}"
    nodes_up = st.nnodes <= 1 or st.nodes_ready == st.nnodes  # a node still starting is the first thing to say
    if view.unreachable and st.state is ServerState.STARTING and nodes_up:
        st.unreachable = st.phase = view.unreachable
    return st


def observe(runner: Runner, record: JobRecord, sched: SchedulerJob | None, *, store: JobStore | None = None,
            answered: bool = True, counted: bool = True) -> JobStatus:
    """Look at one job whose scheduler state is known (see :func:`judge` for the flags) and judge it."""
    return judge(record, sched, look(runner, record, sched), store=store, answered=answered, counted=counted)


def without_scheduler(st: JobStatus, why: str) -> JobStatus:
    """A status judged while the scheduler was unreachable: what the job did not explain is UNKNOWN, not LOST."""
    st.scheduler_state, st.comment = "?", why
    if st.state in (ServerState.LOST, ServerState.UNKNOWN):
        st.state, st.reason = ServerState.UNKNOWN, f"the scheduler did not answer ({why}); try again later"
    return st


def remember_final(store: JobStore | None, st: JobStatus, job: SchedulerJob | None) -> None:
    """Record ``st`` in ``store`` if it is final and the scheduler can no longer change it.

    That is when the scheduler says F (E is not final yet, and a marker seen while the job still runs may be
    overtaken by a walltime kill) or has forgotten the job (``job`` is None after it answered). The reason
    and log lines are kept so later calls can still say why without asking anyone.
    """
    settled = job is None or job.state is SchedState.FINISHED
    if store is not None and st.state.final and settled:
        store.set_final_state(st.record, st.state.value, final_reason=st.reason,
                              exit_status=st.exit_status, log_excerpt=st.log_excerpt,
                              final_scheduler_state=st.scheduler_state)


def query_group(runner: Runner, records: Sequence[JobRecord]) -> dict[str, SchedulerJob | None]:
    """One scheduler call for all ``records`` (same transport and scheduler)."""
    scheduler = get_scheduler(records[0].scheduler)
    found = scheduler.query(runner, [JobRef(r.job_id, r.run_dir) for r in records])
    return {r.job_id: found.get(r.job_id) for r in records}


def _warn(message: str) -> None:
    sys.stderr.write(f"pbstk: warning: {message}\n")


def _query_or_why(runner: Runner, records: Sequence[JobRecord]) -> tuple[dict[str, SchedulerJob | None], str | None,
                                                                           PbstkError | None]:
    """The scheduler's answer for one group, or why there is none: ``(answer, why, error)``.

    A scheduler that did not answer (``SchedulerUnavailable``) or refused (``SchedulerError``: not on PATH,
    permission denied, ...) leaves its jobs to the run directory and HTTP; ``error`` is the refusal, or the
    ``TransportError`` of a login node that cannot be reached (nothing there can be looked at then)."""
    try:
        return query_group(runner, records), None, None
    except SchedulerUnavailable as exc:
        return {}, str(exc), None
    except (SchedulerError, TransportError) as exc:
        return {}, str(exc), exc


def _judge_group(runner: Runner, items: list[tuple[int, JobRecord]], sched: dict[str, SchedulerJob | None],
                 why: str | None, store: JobStore | None) -> list[tuple[int, JobStatus]]:
    """Judge one group's jobs from the scheduler's answer (``why``: there was none) and their run directories."""
    out = []
    views = look_all(runner, [(record, sched.get(record.job_id)) for _, record in items])
    for (index, record), view in zip(items, views):
        job = sched.get(record.job_id)
        st = judge(record, job, view, store=store, answered=why is None)
        if why is not None:
            st = without_scheduler(st, why)
        else:
            remember_final(store, st, job)
        out.append((index, st))
    return out


def unreachable_status(record: JobRecord, error: PbstkError) -> JobStatus:
    """UNKNOWN, for a job whose login node cannot be reached (nothing about it could be looked at)."""
    return JobStatus(record=record, state=ServerState.UNKNOWN, scheduler_state="?", comment=error.message,
                     reason=f"{record.transport} cannot be reached ({error.message}); try again later")


def unreachable_warning(transport: str, error: PbstkError, count: int) -> str:
    return f"{transport} cannot be reached: {error.message}; its {count} job(s) are shown as UNKNOWN"


def status(records: Iterable[JobRecord], store: JobStore | None = None,
           runners: dict[str, Runner] | None = None, *,
           warn: Callable[[str], None] | None = None) -> list[JobStatus]:
    """Current state of ``records``. Final states are remembered in ``store`` and not queried again.

    One scheduler that did not answer or refused does not hide the others' jobs: its jobs are judged from their
    run directories (UNKNOWN where those do not tell) and ``warn`` (default: stderr) hears one line naming it.
    Only when it is the only scheduler asked and nothing else is shown does its refusal raise (exit 3)."""
    records = list(records)
    out: dict[int, JobStatus] = {}
    groups: dict[tuple[str, str], list[tuple[int, JobRecord]]] = {}
    for index, record in enumerate(records):
        if record.final_state:
            out[index] = recorded_status(record)
        else:
            groups.setdefault((record.transport, record.scheduler), []).append((index, record))
    own_runners = runners is None
    runners = runners if runners is not None else {}
    warnings: list[str] = []
    refusals: list[PbstkError] = []
    try:
        for (transport, scheduler), items in groups.items():
            runner = runners.get(transport) or runners.setdefault(transport, open_runner(transport or None))
            sched, why, refused = _query_or_why(runner, [r for _, r in items])
            if isinstance(refused, TransportError):
                refusals.append(refused)
                warnings.append(unreachable_warning(transport, refused, len(items)))
                out.update((index, unreachable_status(record, refused)) for index, record in items)
                continue
            if why is not None:
                where = f" on {transport}" if transport else ""
                warnings.append(f"{scheduler.upper()}{where} did not answer: {why}; its {len(items)} job(s) are "
                                "shown from their run directories (UNKNOWN where those do not tell)")
            if refused is not None:
                refusals.append(refused)
            out.update(_judge_group(runner, items, sched, why, store))
    finally:
        if own_runners:
            for runner in runners.values():
                runner.close()
    if refusals and len(refusals) == len(groups) and not any(r.final_state for r in records):
        raise refusals[0]  # nothing but that scheduler's jobs, and it refused: the command fails as before
    for line in warnings:
        (warn or _warn)(line)
    return [out[i] for i in range(len(records))]


def recorded_status(record: JobRecord) -> JobStatus:
    """The status a record recorded as final keeps, without asking anyone."""
    extra = record.extra
    return JobStatus(record=record, state=ServerState(record.final_state or "UNKNOWN"),
                     reason=extra.get("final_reason") or "(final state recorded earlier)",
                     exit_status=extra.get("exit_status"), scheduler_state=extra.get("final_scheduler_state"),
                     log_excerpt=list(extra.get("log_excerpt") or []))
