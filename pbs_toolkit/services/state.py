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

from collections.abc import Mapping, Sequence

from pbs_toolkit.services.record import ServiceRecord, Slot


def serving_job(slot: Slot, states: Mapping[str, str]) -> str | None:
    """The slot's job that serves (READY) now: the current one, else its successor, else ``None``."""
    for job in (slot.current, slot.successor):
        if job and states.get(job) == "READY":
            return job
    return None


def ready_count(slots: Sequence[Slot], states: Mapping[str, str]) -> int:
    return sum(1 for slot in slots if serving_job(slot, states))


def service_state(record: ServiceRecord, ready: int, starting: bool = True) -> str:
    """The word for ``ready`` of ``record.replicas`` routable replicas, given whether the service was ever READY
    N/N (``record.ever_ready``) and whether some replica not routable yet is still on its way (``starting``)."""
    if record.ended is not None:
        return record.state if record.state in ("CANCELLED", "ENDED", "STOPPING") else "ENDED"
    if ready >= record.replicas:
        return "READY"
    # a replica no longer restarted (services/restarts.py) will not come: short of it for good, never STARTING
    stopped = any(s.gave_up and not s.retiring for s in record.slots)
    if ready == 0:
        return "DOWN" if record.ever_ready or stopped else "STARTING"
    return "DEGRADED" if record.ever_ready or not starting or stopped else "STARTING"
