"""``pbstk cancel --all``: stop every active service and job of this machine's job store.

"All" is what this store records, never a scheduler-wide query: every service not ended (keeper, replicas,
router) and every job not recorded as ended, whatever its profile, launched here or through any login node
(each job is cancelled through the connection it was launched through). Jobs that someone submitted by hand,
or with pbstk on another machine, are not in this store and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.results import Cancellation
from pbs_toolkit.services.record import ServiceRecord


class Stopper(Protocol):
    """What ``cancel_all`` asks of its caller (``Client`` is one): the active services and jobs, and how to stop
    each. Passed in, so this floor never imports the client above it."""

    def services(self) -> list[ServiceRecord]: ...

    def cancel_service(self, name: ServiceRecord, *, keep_endpoint: bool = False) -> list[Cancellation]: ...

    def records(self) -> list[JobRecord]: ...

    def cancel(self, job: JobRecord, *, keep_endpoint: bool = False) -> bool: ...


@dataclass
class CancelAll:
    """What ``cancel --all`` did: one entry per service (its name and the jobs stopped with it), one per job,
    and the errors of those it could not stop (a login node that did not answer), by job or service."""

    services: list[tuple[str, list[Cancellation]]] = field(default_factory=list)
    jobs: list[Cancellation] = field(default_factory=list)
    failures: list[tuple[str, PbstkError]] = field(default_factory=list)


def cancel_all(client: Stopper, *, keep_endpoint: bool = False,
               on_done: Callable[[str], None] | None = None) -> CancelAll:
    """Cancel every active service, then every active job that was not one of theirs. One that cannot be
    stopped does not stop the others; its error is in ``failures``. ``on_done`` hears one line per stop."""
    result = CancelAll()
    said = on_done or (lambda line: None)
    handled: set[str] = set()
    for svc in client.services():
        try:
            stopped = client.cancel_service(svc, keep_endpoint=keep_endpoint)
        except PbstkError as exc:
            result.failures.append((f"service {svc.name}", exc))
            continue
        handled.update(c.job_id for c in stopped)
        result.services.append((svc.name, stopped))
        said(f"{svc.name}: {'cancelled' if stopped else 'already ended'} (service: {len(stopped)} job(s), "
             "router, keeper)")
    for record in client.records():
        if record.job_id in handled:
            continue
        try:
            done = Cancellation(record.job_id, record.name, client.cancel(record, keep_endpoint=keep_endpoint))
        except PbstkError as exc:
            result.failures.append((record.job_id, exc))
            continue
        result.jobs.append(done)
        said(f"{done.job_id}: {done.outcome}")
    return result
