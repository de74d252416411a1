"""A service's state from its replicas' states: pure, so the rules are tested without any process.

"Ready" counts routable replicas (services/ready.py: READY and in the router, which answers the key). STARTING
n/N until the service was READY N/N once (while replicas are still on their way: a normal start with one of two
up is STARTING 1/2, not DEGRADED), READY n/N (all), DEGRADED n/N (some, after having been READY, e.g. a predecessor
ended before its late successor ran; or some while the others ended for good, or are no longer restarted),
DOWN (none, after having been up, or none and some replica no longer restarted: services/restarts.py; or 0/N
whenever the router is gone), then CANCELLED or ENDED once recorded so (STOPPING between: a teardown that has not
finished).
"""

from __future__ import annotations

import enum

from pbs_toolkit.services.record import ServiceRecord


class ServiceState(str, enum.Enum):
    """A service's state. A ``str``: the record keeps it and ``--json`` prints it as the word itself, and a
    state read back from the record (a plain string) compares equal to its member."""

    STARTING = "STARTING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    DOWN = "DOWN"
    STOPPING = "STOPPING"
    CANCELLED = "CANCELLED"
    ENDED = "ENDED"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


#: the states a service keeps once its end is recorded
_END_STATES = (ServiceState.CANCELLED, ServiceState.ENDED, ServiceState.STOPPING)


def service_state(record: ServiceRecord, ready: int, starting: bool = True, wanted: int | None = None
                  ) -> ServiceState:
    """The word for ``ready`` of ``record.replicas`` routable replicas (``wanted``: of that many instead, a
    multi-model service's models), given whether the service was ever READY N/N (``record.ever_ready``) and
    whether some replica not routable yet is still on its way (``starting``)."""
    if record.ended is not None:
        return ServiceState(record.state) if record.state in _END_STATES else ServiceState.ENDED
    if ready >= (record.replicas if wanted is None else wanted):
        return ServiceState.READY
    # a replica no longer restarted (services/restarts.py) will not come: short of it for good, never STARTING
    stopped = any(s.gave_up and not s.retiring for s in record.slots)
    if ready == 0:
        return ServiceState.DOWN if record.ever_ready or stopped else ServiceState.STARTING
    return ServiceState.DEGRADED if record.ever_ready or not starting or stopped else ServiceState.STARTING
