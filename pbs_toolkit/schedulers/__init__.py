"""The registry of scheduler backends: the one place that lists them.

Profile validation, the CLI's ``--scheduler`` choices, ``pbstk profiles`` and the docs all read ``BACKENDS``;
a backend's name appears nowhere else outside its own module. CONTRIBUTING.md "Adding a backend" says how to
add one.
"""

from __future__ import annotations

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers.base import JobRef, Outcome, SchedState, Scheduler, SchedulerJob
from pbs_toolkit.schedulers.local import LocalScheduler
from pbs_toolkit.schedulers.pbs import PBSScheduler
from pbs_toolkit.schedulers.slurm import SlurmScheduler

#: name -> backend class (the first is the default for profiles that do not say)
BACKENDS: dict[str, type[Scheduler]] = {cls.name: cls for cls in (PBSScheduler, LocalScheduler, SlurmScheduler)}
#: the backend a profile without ``scheduler:`` uses
DEFAULT_BACKEND = next(iter(BACKENDS))


def backend_class(name: str) -> type[Scheduler]:
    """The class registered as ``name``; ``UsageError`` naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown scheduler {name!r} (known: {', '.join(BACKENDS)})") from None


def get_scheduler(name: str) -> Scheduler:
    """A fresh backend instance (instances may hold per-launch state such as ``id_source``)."""
    return backend_class(name)()


def runs_on_submit_host(name: str) -> bool:
    """Whether backend ``name``'s jobs run on the host that submits them (``Scheduler.runs_on_submit_host``);
    ``False`` for a name no longer registered (an old record's)."""
    cls = BACKENDS.get(name)
    return cls is not None and cls.runs_on_submit_host


def stream_names() -> list[str]:
    """Every scheduler output stream name some backend offers (``sched-out``, ``sched-err``)."""
    return list(dict.fromkeys(name for cls in BACKENDS.values() for name in cls.streams))


def stream_aliases() -> dict[str, str]:
    """Older stream names the CLI still accepts -> the generic ones (``pbs-out`` -> ``sched-out``)."""
    return {alias: name for cls in BACKENDS.values() for alias, name in cls.stream_aliases.items()}


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "JobRef", "Outcome", "SchedState", "Scheduler", "SchedulerJob",
           "backend_class", "get_scheduler", "runs_on_submit_host", "stream_aliases", "stream_names"]
