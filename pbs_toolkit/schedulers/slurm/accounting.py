"""``pbstk usage`` from Slurm's own accounting (docs/campaigns.md).

One ``sacct --allocations`` call for all jobs: ``Elapsed`` (running jobs too), ``NNodes`` and ``AllocTRES``
(``gres/gpu=N``), from the accounting database (slurmdbd). Many clusters have none (``sacct`` then says
"Slurm accounting storage is disabled"); ``sacct -c`` still reads finished jobs from the job-completion log
(``JobCompType=jobcomp/filetxt``), without TRES; whatever sacct cannot say comes from ``squeue``'s ``TimeUsed``
(what ``query`` reads, kept ``MinJobAge`` after a job ends). Each figure says which of these it came from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from pbs_toolkit.errors import SchedulerError, SchedulerUnavailable
from pbs_toolkit.schedulers.base import (
    Accounting,
    JobRef,
    SchedState,
    SchedulerJob,
    hms_seconds,
    run_with_retry,
    scheduler_timeout,
)
from pbs_toolkit.transports.base import Result, Runner

FIELDS = ("JobID", "Elapsed", "NNodes", "State", "AllocTRES")
#: sacct states of jobs still running or waiting: their figures still grow
_LIVE = ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STAGE_OUT",
         "SIGNALING")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")
_GPUS = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")
#: (runner name, mode) pairs whose sacct did not answer: not asked again in this process
_REFUSED: set[tuple[str, str]] = set()


def sacct_argv(job_ids: Sequence[str], completion: bool = False) -> list[str]:
    mode = ["--completion"] if completion else ["--allocations"]
    fields = FIELDS[:4] if completion else FIELDS  # the completion log has no TRES
    return ["sacct", "--noheader", "--parsable2", *mode, f"--jobs={','.join(job_ids)}",
            f"--format={','.join(fields)}"]


def parse_sacct(stdout: str, source: str) -> dict[str, Accounting]:
    """Rows of ``sacct_argv``'s answer (``|`` between columns); other lines (job steps, noise) are skipped."""
    found: dict[str, Accounting] = {}
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) < 3 or not _JOB_ID.fullmatch(cols[0]):
            continue
        elapsed = hms_seconds(cols[1])
        if elapsed is None:
            continue
        state = cols[3].split(" ", 1)[0] if len(cols) > 3 else ""
        tres = _GPUS.search(cols[4]) if len(cols) > 4 else None
        found[cols[0]] = Accounting(cols[0], float(elapsed), source,
                                    nodes=int(cols[2]) if cols[2].isdigit() and int(cols[2]) > 0 else None,
                                    gpus=int(tres.group(1)) if tres else None,
                                    final=bool(state) and state not in _LIVE)
    return found


def _ask(runner: Runner, ids: Sequence[str], completion: bool, is_transient: Callable[[Result], bool]
         ) -> dict[str, Accounting]:
    mode = "completion" if completion else "allocations"
    if (runner.name, mode) in _REFUSED:
        return {}
    try:
        result = run_with_retry(runner, sacct_argv(ids, completion), is_transient, attempts=1,
                                timeout=scheduler_timeout())
    except (SchedulerError, SchedulerUnavailable):
        result = Result(1, "", "")
    if result.rc != 0:
        _REFUSED.add((runner.name, mode))
        return {}
    return parse_sacct(result.stdout, "sacct -c Elapsed" if completion else "sacct Elapsed")


def accounting(runner: Runner, refs: Sequence[JobRef], query: Callable[[], dict[str, SchedulerJob]],
               is_transient: Callable[[Result], bool]) -> dict[str, Accounting]:
    """sacct (database, then completion log), then squeue for the jobs neither knows."""
    ids = list(dict.fromkeys(ref.job_id for ref in refs))
    found = _ask(runner, ids, False, is_transient)
    missing = [i for i in ids if i not in found]
    if missing:
        found.update(_ask(runner, missing, True, is_transient))
    if any(i not in found for i in ids):
        for job_id, job in query().items():
            used = hms_seconds(job.walltime_used)
            if job_id not in found and used is not None:
                found[job_id] = Accounting(job_id, float(used), "squeue TimeUsed",
                                           final=job.state is SchedState.FINISHED)
    return {i: found[i] for i in ids if i in found}
