"""Schedulers behind one small interface: ``pbs`` (PBS Pro / OpenPBS) and ``local`` (this machine)."""

from __future__ import annotations

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers.base import JobRef, SchedState, Scheduler, SchedulerJob


def get_scheduler(name: str) -> Scheduler:
    if name == "pbs":
        from pbs_toolkit.schedulers.pbs import PBSScheduler

        return PBSScheduler()
    if name == "local":
        from pbs_toolkit.schedulers.local import LocalScheduler

        return LocalScheduler()
    raise UsageError(f"unknown scheduler {name!r} (known: pbs, local)")


__all__ = ["JobRef", "SchedulerJob", "SchedState", "Scheduler", "get_scheduler"]
