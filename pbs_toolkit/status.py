"""Server state: the scheduler's view, the run directory's markers and the server's own HTTP answer, combined.

One scheduler query per transport per call, whatever the number of jobs (FACTS.md: never poll per job).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit import probe
from pbs_toolkit.errors import SchedulerUnavailable
from pbs_toolkit.jobstore import JobRecord, JobStore
from pbs_toolkit.logs import tail_lines
from pbs_toolkit.schedulers import JobRef, SchedState, SchedulerJob, get_scheduler
from pbs_toolkit.transports import Runner, open_runner

LOG_TAIL_LINES = 400


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

    @property
    def url(self) -> str | None:
        if self.address and self.port:
            return f"http://{self.address}:{self.port}/v1"
        return None

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "job_id": r.job_id, "name": r.name, "model": r.model, "served_model_name": r.served_model_name,
            "preset": r.preset, "profile": r.profile, "scheduler": r.scheduler,
            "transport": r.transport or "local", "state": self.state.value,
            "scheduler_state": self.scheduler_state, "phase": self.phase, "node": self.node,
            "address": self.address, "port": self.port, "url": self.url, "exit_status": self.exit_status,
            "comment": self.comment, "reason": self.reason, "eager_fallback": self.eager_fallback,
            "run_dir": r.run_dir, "created": r.created, "log_excerpt": self.log_excerpt,
        }


def read_marker(runner: Runner, run_dir: str) -> dict[str, Any] | None:
    """``server.json`` written by the start script, or ``None`` before it exists."""
    try:
        data = json.loads(runner.read_bytes(f"{run_dir}/server.json"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def current_attempt(lines: Sequence[str]) -> list[str]:
    """Log lines of the newest start attempt (an eager fallback leaves the failed attempt above it)."""
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("pbstk: ") and ": starting vLLM on " in lines[index]:
            return list(lines[index:])
    return list(lines)


def classify_exit(exit_status: int | None) -> tuple[ServerState, str]:
    """PBS ``Exit_status`` -> state and reason (FACTS.md: 256+signal, negative = PBS codes, -29 walltime)."""
    if exit_status is None:
        return ServerState.CANCELLED, "deleted before it ran"
    if exit_status == 0:
        return ServerState.FINISHED, "exited normally"
    if exit_status == -29:
        return ServerState.FAILED, "walltime exceeded: the scheduler killed the job"
    if exit_status < 0:
        return ServerState.FAILED, f"PBS could not run the job (execution code {exit_status})"
    if exit_status >= 256:
        signal = exit_status - 256
        names = {15: "SIGTERM", 9: "SIGKILL", 2: "SIGINT", 1: "SIGHUP"}
        return ServerState.CANCELLED, f"killed by signal {signal} ({names.get(signal, '?')}), e.g. qdel"
    return ServerState.FAILED, f"the job script exited with code {exit_status}"


def combine(
    record: JobRecord,
    sched: SchedulerJob | None,
    marker: dict[str, Any] | None,
    log_lines: list[str],
    health_status: int | None,
) -> JobStatus:
    """The truth about one job from everything we could observe. Pure: tested without any I/O."""
    from pbs_toolkit.observe.startup import current_phase, find_fatal, is_compile_failure

    attempt = current_attempt(log_lines)
    st = JobStatus(record=record, state=ServerState.LOST)
    if marker:
        st.address = marker.get("address") or None
        st.port = int(marker["port"]) if marker.get("port") else None
        st.node = marker.get("host") or None
        st.eager_fallback = bool(marker.get("eager_fallback"))
    if sched:
        st.scheduler_state = sched.raw_state
        st.comment = sched.comment
        st.exit_status = sched.exit_status
        st.node = sched.exec_host or st.node
    phase = (marker or {}).get("phase")
    fatal = find_fatal(attempt)

    def failed(reason: str) -> JobStatus:
        st.state, st.reason = ServerState.FAILED, reason
        st.log_excerpt = fatal or [line for line in attempt[-8:] if line.strip()]
        return st

    if sched is not None and sched.state in (SchedState.QUEUED, SchedState.HELD):
        st.state = ServerState.PENDING
        if sched.state is SchedState.HELD:
            st.reason = "held by the scheduler"
        return st
    if sched is not None and (sched.state is SchedState.FINISHED
                              or (sched.state is SchedState.EXITING and sched.exit_status is not None)):
        # PBS sets Exit_status on entering E; it does not change at F (status() records it only at F)
        state, reason = classify_exit(sched.exit_status)
        if phase == "cancelled" and sched.exit_status != -29:
            # the start script trapped the stop signal and exited on its own (PBS then records 143, not 271)
            state, reason = ServerState.CANCELLED, "stopped by a signal (qdel or pbstk cancel)"
        if state is ServerState.FAILED or (state is ServerState.FINISHED and phase == "failed"):
            if phase == "failed" and fatal:
                reason = f"vLLM failed before it was ready: {fatal[0]}"
            return failed(reason)
        st.state, st.reason = state, reason
        return st
    if phase in ("exited", "failed", "cancelled"):
        # the run directory explains the end: the scheduler forgot the job (history off or expired), or has
        # not noticed yet (R/E for a moment after the start script exits)
        code = (marker or {}).get("exit_code")
        st.exit_status = code
        if phase == "cancelled":
            st.state, st.reason = ServerState.CANCELLED, "stopped by a signal"
            return st
        if phase == "failed":
            return failed(f"vLLM failed before it was ready: {fatal[0]}" if fatal else f"start failed (exit {code})")
        st.state, st.reason = (ServerState.FINISHED, "exited normally") if code == 0 else (
            ServerState.FAILED, f"vLLM exited with code {code}")
        return st
    if sched is None and health_status != 200:
        st.state = ServerState.LOST
        st.reason = "the scheduler no longer knows this job and its run directory does not explain it"
        return st
    # running (or exiting, or forgotten but still answering)
    if health_status == 200:
        st.state, st.phase = ServerState.READY, "ready"
        return st
    if fatal:
        st.confirmed = False
        st.restart_expected = (not record.extra.get("eager") and not st.eager_fallback
                               and is_compile_failure(attempt))
        return failed(f"vLLM failed: {fatal[0]}")
    st.state = ServerState.STARTING
    st.phase = "job started" if phase in (None, "setup") else current_phase(attempt)
    if st.eager_fallback:
        st.phase += " (eager fallback)"
    return st


def observe(runner: Runner, record: JobRecord, sched: SchedulerJob | None) -> JobStatus:
    """Read the markers, the log tail and ``/health`` for one job whose scheduler state is known."""
    queued = sched is not None and sched.state in (SchedState.QUEUED, SchedState.HELD)
    marker = None if queued else read_marker(runner, record.run_dir)
    lines = [] if queued else tail_lines(runner, f"{record.run_dir}/vllm.log", LOG_TAIL_LINES)
    health_status = None
    if marker and marker.get("port") and marker.get("phase") in ("ready", "starting"):
        health_status = probe.health(runner, marker.get("address") or "127.0.0.1", int(marker["port"]))
    return combine(record, sched, marker, lines, health_status)


def without_scheduler(st: JobStatus, why: str) -> JobStatus:
    """A status judged while the scheduler was unreachable: what the job did not explain is UNKNOWN, not LOST."""
    st.scheduler_state, st.comment = "?", why
    if st.state is ServerState.LOST:
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
                              exit_status=st.exit_status, log_excerpt=st.log_excerpt)


def query_group(runner: Runner, records: Sequence[JobRecord]) -> dict[str, SchedulerJob | None]:
    """One scheduler call for all ``records`` (same transport and scheduler)."""
    scheduler = get_scheduler(records[0].scheduler)
    found = scheduler.query(runner, [JobRef(r.job_id, r.run_dir) for r in records])
    return {r.job_id: found.get(r.job_id) for r in records}


def status(records: Iterable[JobRecord], store: JobStore | None = None,
           runners: dict[str, Runner] | None = None) -> list[JobStatus]:
    """Current state of ``records``. Final states are remembered in ``store`` and not queried again."""
    records = list(records)
    out: dict[int, JobStatus] = {}
    groups: dict[tuple[str, str], list[tuple[int, JobRecord]]] = {}
    for index, record in enumerate(records):
        if record.final_state:
            extra = record.extra
            out[index] = JobStatus(record=record, state=ServerState(record.final_state),
                                   reason=extra.get("final_reason") or "(final state recorded earlier)",
                                   exit_status=extra.get("exit_status"),
                                   log_excerpt=list(extra.get("log_excerpt") or []))
        else:
            groups.setdefault((record.transport, record.scheduler), []).append((index, record))
    own_runners = runners is None
    runners = runners if runners is not None else {}
    try:
        for (transport, _), items in groups.items():
            runner = runners.get(transport) or runners.setdefault(transport, open_runner(transport or None))
            try:
                sched = query_group(runner, [r for _, r in items])
            except SchedulerUnavailable as exc:
                # Transient: judge from the run directory and HTTP alone, and record nothing as final.
                for index, record in items:
                    out[index] = without_scheduler(observe(runner, record, None), str(exc))
                continue
            for index, record in items:
                job = sched[record.job_id]
                st = observe(runner, record, job)
                out[index] = st
                remember_final(store, st, job)
    finally:
        if own_runners:
            for runner in runners.values():
                runner.close()
    return [out[i] for i in range(len(records))]
