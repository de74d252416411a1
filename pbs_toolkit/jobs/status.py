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

import sys
from collections.abc import Callable, Iterable, Sequence

from pbs_toolkit.errors import PbstkError, SchedulerError, SchedulerUnavailable, TransportError
from pbs_toolkit.jobs.judge import (
    classify,
    combine,
    current_attempt,
    with_nodes,
    without_scheduler,
)
from pbs_toolkit.jobs.remember import judge_and_keep, note_absence, observe, remember_final
from pbs_toolkit.jobs.rundir import look_all
from pbs_toolkit.jobs.startup_phases import STARTUP_KEY
from pbs_toolkit.jobs.status_types import (
    ABSENCE_KEY,
    DEFAULT_LOST_AFTER_S,
    LOST_AFTER_POLLS,
    WALLTIME_ENDING_S,
    Absence,
    JobStatus,
    ServerState,
    lost_after_s,
)
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import JobRef, SchedulerJob, get_scheduler
from pbs_toolkit.transports import Runner, open_runner

__all__ = ["ABSENCE_KEY", "DEFAULT_LOST_AFTER_S", "LOST_AFTER_POLLS", "WALLTIME_ENDING_S", "Absence", "JobStatus",
           "ServerState", "classify", "combine", "current_attempt", "judge_and_keep", "lost_after_s", "note_absence",
           "observe", "query_group", "recorded_status", "remember_final", "status", "status_of",
           "unreachable_status", "unreachable_warning", "with_nodes", "without_scheduler"]


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
        st = judge_and_keep(record, job, view, store=store, answered=why is None)
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
                     log_excerpt=list(extra.get("log_excerpt") or []), startup=extra.get(STARTUP_KEY))


def status_of(records: list[JobRecord], store: JobStore, runner: Callable[[str], Runner], runners: dict[str, Runner],
              on_ended: Callable[[list[JobRecord]], None] | None = None) -> list[JobStatus]:
    """``status`` of ``records`` through ``runner`` (the transport's open runner, kept in ``runners``); a login
    node that cannot be reached leaves its jobs UNKNOWN with one warning line, unless nothing else would be shown
    (then its ``TransportError``, exit 4). ``on_ended`` hears the jobs seen ended (their registry entries go)."""
    unreachable: dict[str, TransportError] = {}
    for transport in sorted({r.transport for r in records if not r.final_state}):  # ended jobs need none
        try:
            runner(transport)
        except TransportError as exc:
            unreachable[transport] = exc
    asked = [r for r in records if r.final_state or r.transport not in unreachable]
    if unreachable and not asked:
        raise next(iter(unreachable.values()))
    answered = iter(status(asked, store, runners=runners))
    results = [next(answered) if r.final_state or r.transport not in unreachable else
               unreachable_status(r, unreachable[r.transport]) for r in records]
    for transport, error in unreachable.items():
        count = sum(1 for r in records if r.transport == transport and not r.final_state)
        sys.stderr.write(f"pbstk: warning: {unreachable_warning(transport, error, count)}\n")
    if on_ended is not None:  # a log-only failure may still restart: not yet
        on_ended([s.record for s in results if s.state.final and s.confirmed])
    return results
