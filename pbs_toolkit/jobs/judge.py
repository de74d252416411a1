"""Deciding a job's state from what one look saw: the scheduler's answer, the run directory's markers, the
server's HTTP answer and its log (``judge``), each rule a small function. Pure: no I/O and no writes; what a look
teaches the job's record (the absence count, the verified address, the frozen start-up) is handed back, and
jobs/remember.py writes it; jobs/rundir.py looks, jobs/status.py asks the scheduler once per transport.

Two rules keep status from lying (jobs/status.py says more): READY only for a server that proved it is the
job's own, and LOST only after ``LOST_AFTER_POLLS`` answers over ``PBSTK_LOST_AFTER_S`` without a sign of life."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from pbs_toolkit.jobs import idle, lease
from pbs_toolkit.jobs.nodes import NodeMarker, NodesView, node_log_name, node_phase_text
from pbs_toolkit.jobs.rundir import VERIFIED_KEY, RunDirView
from pbs_toolkit.jobs.startup_phases import job_startup, to_freeze
from pbs_toolkit.jobs.status_types import (
    ABSENCE_KEY,
    LOST_AFTER_POLLS,
    Absence,
    JobStatus,
    ServerState,
    lost_after_s,
)
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.schedulers import Outcome, SchedState, SchedulerJob
from pbs_toolkit.server.phases import FINAL_PHASES, Phase
from pbs_toolkit.transports.http import Identity


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
    busy: str | None = None,
) -> JobStatus:
    """The truth about one job from everything we could observe. Pure: tested without any I/O.

    ``identity``: what ``/v1/models`` said when ``/health`` answered 200 (READY needs it to be ours).
    ``absence``: how long the scheduler has not known the job, when ``sched`` is ``None`` because it answered
    without it; ``answered=False`` means it did not answer at all (that tells nothing about the job).
    ``busy``: ``/health`` did not answer in time, but the server proved it is ours at this address before and
    its ``/metrics`` shows requests (rundir.py ``busy``): READY, busy, not STARTING.
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
    if ours and (marker or {}).get("models_starting"):  # its first model answers, others still start (models.sh)
        st.state, st.phase = ServerState.STARTING, "the job's other models are still starting"
        return st
    if ours or (busy and not fatal):
        st.state, st.phase, st.busy = ServerState.READY, Phase.READY.value, None if ours else busy
        return st
    return _not_ready(st, phase, fatal, attempt, health_status, identity)


def co_models(text: Any) -> dict[str, int]:
    """server.json's ``models`` (``SERVED@PORT SERVED@PORT``, a multi-model job's other models) as served name ->
    port; anything malformed is left out."""
    out: dict[str, int] = {}
    for word in text.split() if isinstance(text, str) else ():
        served, _, port = word.rpartition("@")
        if served and port.isdigit() and 0 < int(port) < 65536:
            out[served] = int(port)
    return out


def _seed(record: JobRecord, sched: SchedulerJob | None, marker: dict[str, Any] | None) -> JobStatus:
    """A status holding what the run directory's marker and the scheduler say about where the job is."""
    st = JobStatus(record=record, state=ServerState.LOST)
    if marker:
        st.address = marker.get("address") or None
        st.port = marker.get("port") or None
        st.node = marker.get("host") or None
        st.eager_fallback = bool(marker.get("eager_fallback"))
        st.models = co_models(marker.get("models"))
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


#: the start script's own failure (models.sh, markers.sh pbstk_fail): ``pbstk: HH:MM:SS error: WHY``
_SCRIPT_ERROR = re.compile(r"^pbstk: (?:\d\d:\d\d:\d\d )?error: (.+)")


def _start_failure(fatal: list[str] | None, attempt: list[str]) -> str | None:
    """Why the start failed: vLLM's fatal line, else the start script's own error line (e.g. another model of the
    job exited before it was ready, with the cause from its log), else ``None``."""
    if fatal:
        return f"vLLM failed before it was ready: {fatal[0]}"
    said = [match.group(1) for line in attempt if (match := _SCRIPT_ERROR.match(line))]
    return said[-1] if said else None


def _ended_by_scheduler(st: JobStatus, sched: SchedulerJob, phase: str | None, fatal: list[str] | None,
                        attempt: list[str]) -> JobStatus:
    """The backend says how the job ended (possibly while still exiting; status() records it only once
    finished); the run directory may refine why."""
    state, reason = classify(sched.outcome, sched.outcome_code)
    if phase == Phase.CANCELLED and sched.outcome is not Outcome.WALLTIME:
        # the start script trapped the stop signal and exited on its own (so the code is its own, e.g. 143)
        state, reason = ServerState.CANCELLED, "stopped by a signal (pbstk cancel or the scheduler's own)"
    if state is ServerState.FAILED or (state is ServerState.FINISHED and phase == Phase.FAILED):
        if phase == Phase.FAILED:
            reason = _start_failure(fatal, attempt) or reason
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
        reason = _start_failure(fatal, attempt) or f"start failed (exit {code})"
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


def count_absence(record: JobRecord, fingerprint: list[int | None],
                  counted: bool) -> tuple[Absence, dict[str, Any] | None]:
    """One more scheduler answer without the job (when ``counted``); a changed run directory restarts the count.
    The count and what ``record.extra`` must keep of it (``None``: nothing changes), so separate ``pbstk`` calls
    add up."""
    now = time.time()
    prev: Any = record.extra.get(ABSENCE_KEY)
    try:
        since, polls, seen = float(prev["since"]), int(prev["polls"]), prev.get("fingerprint")
    except (TypeError, KeyError, ValueError, AttributeError):
        since, polls, seen = now, 0, None
    keep = None
    if counted:
        if polls and seen == fingerprint:
            polls += 1
        else:
            since, polls = now, 1
        keep = {ABSENCE_KEY: {"since": since, "polls": polls, "fingerprint": fingerprint}}
    return Absence(polls, max(0.0, now - since)), keep


def judge(record: JobRecord, sched: SchedulerJob | None, view: RunDirView, *, answered: bool = True,
          counted: bool = True) -> tuple[JobStatus, dict[str, Any]]:
    """The status from one look, and what ``record.extra`` must keep of it (the absence count, the verified
    address, the frozen start-up phases; empty: nothing). Pure: jobs/remember.py writes what it hands back.

    ``answered``: the scheduler answered this poll (``sched`` is ``None`` because it does not know the job);
    ``counted``: this is a fresh answer, not the last one reused between polls.
    """
    keep: dict[str, Any] = {}
    absence = None
    if answered and sched is None:
        absence, counted_keep = count_absence(record, view.fingerprint, counted)
        keep.update(counted_keep or {})
    elif answered and record.extra.get(ABSENCE_KEY):
        keep[ABSENCE_KEY] = None
    st = combine(record, sched, view.marker, view.lines, view.health, identity=view.identity, absence=absence,
                 answered=answered, busy=view.busy)
    # stopped by --idle-cancel, or by the lease of a lost pbstk run: says so
    st.reason = idle.idle_reason(st.state.value, view.lines) or lease.lease_reason(st.state.value, view.lines) \
        or st.reason
    if view.command_note:  # the run that launched it died; the watch ended its COMMAND
        st.reason = f"{st.reason}; {view.command_note}" if st.reason else view.command_note
    if view.nodes is not None:
        st = with_nodes(st, view.nodes, (view.marker or {}).get("reason"), view.lines)
    if view.identity is not None and view.identity.ours and view.marker:
        where = f"{view.marker.get('address') or '127.0.0.1'}:{view.marker['port']}"
        if record.extra.get(VERIFIED_KEY) != where:
            keep[VERIFIED_KEY] = where
    st.startup = job_startup(record, st.state, view.startup_log, current_attempt(view.lines),
                             eager=record.spec.eager or st.eager_fallback)
    if freeze := to_freeze(st.state, st.startup, record):
        keep.update(freeze)
    if view.problem:
        st.reason = f"{st.reason} ({view.problem})" if st.reason else view.problem
        if st.state is ServerState.STARTING:
            st.phase = f"{st.phase}; {view.problem}"
    nodes_up = st.nnodes <= 1 or st.nodes_ready == st.nnodes  # a node still starting is the first thing to say
    if view.unreachable and st.state is ServerState.STARTING and nodes_up:
        st.unreachable = st.phase = view.unreachable
    return st, keep


def without_scheduler(st: JobStatus, why: str) -> JobStatus:
    """A status judged while the scheduler was unreachable: what the job did not explain is UNKNOWN, not LOST."""
    st.scheduler_state, st.comment = "?", why
    if st.state in (ServerState.LOST, ServerState.UNKNOWN):
        st.state, st.reason = ServerState.UNKNOWN, f"the scheduler did not answer ({why}); try again later"
    return st
