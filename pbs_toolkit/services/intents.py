"""A replica launch's intent in its service's record, so that no job ever runs with the service's key unknown to it.

``launch`` (jobs/launch.py) already records its intent before submitting and adopts an interrupted launch from its
run directory; but the *service* learnt of a replica only once ``launch`` returned. A ``serve`` or a keeper killed
during the submission then left a job that no teardown cancelled, and a resumed keeper tried the same name again
("a job named ... is already active") on every tick. So before anything is submitted the slot records the job's
name, the role it will take and when (``Slot.launching``), saved only while the service is active (a ``cancel``
that came first wins: nothing is launched); whoever finds such an intent later (the keeper's next tick, a teardown)
settles it here: the job that launch recorded or adopted takes its role, or, when nothing was submitted, the
intent is dropped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.launch import resolve_remote_intents

if TYPE_CHECKING:
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.record import ServiceRecord, Slot
    from pbs_toolkit.services.session import ServiceSession

#: a launch's job record is made after its slot's intent: allow for float rounding, never for another launch
_SLACK_S = 1.0


class ServiceEnded(PbstkError):
    """The service was ended (cancelled) before this launch could be recorded: nothing was submitted."""


def begin(slot: Slot, name: str, role: str) -> None:
    slot.launching, slot.launching_role, slot.launching_since = name, role, time.time()


def done(slot: Slot, job_id: str) -> None:
    setattr(slot, slot.launching_role, job_id)
    clear(slot)


def clear(slot: Slot) -> None:
    slot.launching, slot.launching_role, slot.launching_since = None, "current", 0.0


def launched_job(session: ServiceSession, rec: ServiceRecord, slot: Slot) -> JobRecord | None:
    """The job the slot's interrupted launch submitted, when the store knows it (recorded, or adopted from its run
    directory by this very read)."""
    found = [r for r in session.store.all() if r.name == slot.launching and r.transport == rec.transport
             and r.created >= slot.launching_since - _SLACK_S]
    return found[0] if found else None


def in_flight(session: ServiceSession, rec: ServiceRecord, slot: Slot) -> bool:
    """Whether the launch's own intent is still unresolved (being submitted, or its outcome unknown yet)."""
    intents = [i for i in session.store.intents() if i.name == slot.launching and i.transport == rec.transport]
    if intents and rec.transport:  # on a login node: read its run directory's markers there
        resolve_remote_intents(session.store, session.runner(rec.transport), intents)
        intents = [i for i in session.store.intents() if i.name == slot.launching and i.transport == rec.transport]
    return bool(intents)


def settle(session: ServiceSession, rec: ServiceRecord, slot: Slot, wait_s: float = 0.0) -> bool:
    """Turn the slot's launch intent into its job (or drop it when nothing was submitted); waits at most
    ``wait_s`` for a submission still under way. ``False``: still unresolved (the intent stays)."""
    if not slot.launching:
        return True
    deadline = time.monotonic() + wait_s
    while True:
        job = launched_job(session, rec, slot)
        if job is not None:
            done(slot, job.job_id)
            return True
        if not in_flight(session, rec, slot):
            if (job := launched_job(session, rec, slot)) is not None:  # recorded between the two looks
                done(slot, job.job_id)
            else:
                clear(slot)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
