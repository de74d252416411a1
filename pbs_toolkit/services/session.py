"""What the service code needs from its caller: the job store, runners, and launch / status / cancel of one job.

``Client`` builds one (``Client.service_session``); the service modules take it instead of the whole ``Client``,
so they never import the facade above them (no import circle) and a test can hand them exactly these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.launch import LaunchResult
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.transports import Runner


@dataclass(frozen=True)
class ServiceSession:
    """One caller's store and runners, and the job operations a service is made of."""

    store: JobStore
    #: the open runner of a transport ("" = this machine, else the SSH host), reused across calls
    runner: Callable[[str], Runner]
    #: launch a replica job: (request, api_key=..., begin_at=...) -> LaunchResult
    launch: Callable[..., LaunchResult]
    #: status of job records, one scheduler query per transport (ended ones take their registry entries along)
    status: Callable[[list[JobRecord]], list[JobStatus]]
    #: stop one job, a record or an id (its registry entries go with it); True if stopped now
    cancel: Callable[[JobRecord | str], bool]
    #: hears each registry entry taken back
    on_removal: Callable[[Removal], Any]
