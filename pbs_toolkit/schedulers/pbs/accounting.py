"""``pbstk usage`` from PBS's own accounting: ``resources_used.walltime`` (updated by the MoM every poll while the
job runs, final once it has ended), ``Resource_List.nodect`` and ``Resource_List.ngpus`` of the one batched
``qstat -x -f -F json`` that ``query`` already makes (docs/campaigns.md)."""

from __future__ import annotations

from typing import Any

from pbs_toolkit.schedulers.base import Accounting, SchedState, SchedulerJob, hms_seconds

SOURCE = "qstat resources_used.walltime"


def _count(value: Any) -> int | None:
    """A count PBS prints as a number or a numeric string (``"4"``); ``None`` for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def _hosts(exec_host: Any) -> int | None:
    """Distinct hosts of ``exec_host`` (``node1/0*64+node2/0*64``)."""
    if not isinstance(exec_host, str) or not exec_host.strip():
        return None
    return len({part.split("/", 1)[0] for part in exec_host.split("+") if part})


def sub_attr(info: dict[str, Any], key: str, sub: str) -> Any:
    """``info[key][sub]`` of a resource-style attribute, ``None`` when absent or not a mapping."""
    value = info.get(key)
    return value.get(sub) if isinstance(value, dict) else None


def duration_s(value: Any) -> int | None:
    """``HH:MM:SS`` or plain seconds (``qstat -F json`` prints some as numbers) -> seconds, ``None`` otherwise."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value) if value >= 0 else None
    return hms_seconds(str(value))


def accounting(jobs: dict[str, SchedulerJob]) -> dict[str, Accounting]:
    """The accounting of each job ``query`` returned (a job that never ran has no ``resources_used``: absent)."""
    found = {}
    for job_id, job in jobs.items():
        used = duration_s(sub_attr(job.raw, "resources_used", "walltime"))
        if used is None:
            continue
        nodes = _count(sub_attr(job.raw, "Resource_List", "nodect")) or _hosts(job.raw.get("exec_host"))
        gpus = _count(sub_attr(job.raw, "Resource_List", "ngpus"))
        found[job_id] = Accounting(job_id, float(used), SOURCE, nodes=nodes, gpus=gpus,
                                   final=job.state is SchedState.FINISHED)
    return found
