"""What one look at a job teaches its record, written: the absence count, the verified address and the frozen
start-up phases that ``judge`` (pure) hands back, and the final state once the scheduler can no longer change it.
``observe`` is one look (jobs/rundir.py), its judgement and these writes."""

from __future__ import annotations

from typing import Any

from pbs_toolkit.jobs.judge import count_absence, judge
from pbs_toolkit.jobs.rundir import RunDirView, look
from pbs_toolkit.jobs.status_types import Absence, JobStatus
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import SchedState, SchedulerJob
from pbs_toolkit.transports import Runner


def keep(store: JobStore | None, record: JobRecord, values: dict[str, Any]) -> None:
    """Write ``values`` into the job's ``extra`` (in the store, or only in ``record`` without one)."""
    if not values:
        return
    if store is not None:
        store.update_extra(record, **values)
    else:
        record.extra.update(values)


def note_absence(store: JobStore | None, record: JobRecord, fingerprint: list[int | None],
                 counted: bool) -> Absence:
    """Count one more scheduler answer without the job (when ``counted``) and keep the count in ``record.extra``."""
    absence, values = count_absence(record, fingerprint, counted)
    keep(store, record, values or {})
    return absence


def judge_and_keep(record: JobRecord, sched: SchedulerJob | None, view: RunDirView, *,
                   store: JobStore | None = None, answered: bool = True, counted: bool = True) -> JobStatus:
    """``judge`` one look, then keep what it learned (see :func:`pbs_toolkit.jobs.judge.judge` for the flags)."""
    st, values = judge(record, sched, view, answered=answered, counted=counted)
    keep(store, record, values)
    return st


def observe(runner: Runner, record: JobRecord, sched: SchedulerJob | None, *, store: JobStore | None = None,
            answered: bool = True, counted: bool = True) -> JobStatus:
    """Look at one job whose scheduler state is known and judge it, keeping what the look learned."""
    return judge_and_keep(record, sched, look(runner, record, sched), store=store, answered=answered,
                          counted=counted)


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
