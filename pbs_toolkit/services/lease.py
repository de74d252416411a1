"""The lease of a service that ``pbstk run --replicas N`` started, as its keeper watches it (docs/campaigns.md
"The lease").

The run rewrites ``lease`` in the service's directory on this machine (services/keeper/process.py
``service_dir``) every ``lease / 5`` seconds (campaigns/lease.py ``Renewal``), a new content each time; its
replicas have no lease of their own (``LEASE_S=0``): the keeper, which runs on the same machine, watches that
file, comparing its content by its own monotonic clock from its start. Once the content has not changed for the
lease (``kill -9`` of the run, a laptop that slept), the keeper drains the routable replicas (no request running
or waiting, at most ``PBSTK_SERVICE_DRAIN_S``) and ends the whole service as ``--idle-cancel`` does, recorded
ENDED with ``end_reason`` ``the lease of pbstk run lapsed ...``. ``--keep``, ``--reuse`` and ``pbstk serve``
services have no lease (``lease_s`` 0 in the record).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pbs_toolkit.jobs.lease import LEASE_FILE, command_note, lapsed_reason
from pbs_toolkit.perf.scrape import wait_drained
from pbs_toolkit.services.keeper import scaler
from pbs_toolkit.services.keeper.process import keeper_log, service_dir
from pbs_toolkit.services.record import ServiceRecord

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.session import ServiceSession

#: seconds between two looks at the replicas' ``/metrics`` while they drain
DRAIN_LOOK_S = 0.5


class LeaseWatch:
    """The keeper's view of its service's lease: the file's last content and since when (this clock) it holds it."""

    def __init__(self, name: str, lease_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path: Path = service_dir(name) / LEASE_FILE
        self.name = name
        self.lease_s = lease_s
        self._armed = bool(lease_s)
        self._clock = clock
        self._seen = self._read()
        self._since = clock()

    def arm(self, rec: ServiceRecord) -> None:
        """Take the lease from the service's record, once (the keeper's first read), and say it in its log."""
        if self._armed:
            return
        self._armed, self.lease_s = True, rec.lease_s
        if rec.lease_s:
            keeper_log(f"service {rec.name} ends once pbstk run has not renewed its lease for {rec.lease_s:g} s")

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def lapsed(self) -> str | None:
        """The service's end reason once no renewal came for the lease, else ``None`` (always, with no lease).
        Each call is one look: a content that changed since the last one starts the lease again."""
        if self.lease_s <= 0:
            return None
        now, content = self._clock(), self._read()
        if content != self._seen:
            self._seen, self._since = content, now
            return None
        if now - self._since < self.lease_s:
            return None
        note = command_note(f"service-{self.name}") if self.name else None
        return lapsed_reason(self.lease_s, "the service") + (f"; {note}" if note else "")

    def due(self) -> bool:
        """Whether the lease lapsed (a look, as :meth:`lapsed`): the keeper's wait ends, its next tick ends it."""
        return self.lapsed() is not None


def drain(session: ServiceSession, rec: ServiceRecord, statuses: Mapping[str, JobStatus], in_router: set[str],
          bound_s: float) -> None:
    """Wait until no routable replica runs or queues a request (their ``/metrics``; one that does not answer runs
    none), at most ``bound_s``: what was sent before the lease lapsed finishes before the teardown."""
    def busy() -> float:
        snaps = scaler.snapshots(session, rec, statuses, in_router)
        return sum((s.running or 0) + (s.waiting or 0) for s in snaps.values())

    left = wait_drained(busy, bound_s,
                        lambda n: keeper_log(f"service {rec.name}: draining {n:g} request(s) before it ends"),
                        step_s=DRAIN_LOOK_S)
    if left:
        keeper_log(f"service {rec.name}: {left:g} request(s) still in flight after {bound_s:g} s of drain")
