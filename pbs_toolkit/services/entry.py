"""The service as a job, for the registry code (endpoints/ takes a ``JobStatus``): its entry ``service:NAME``
at the router's address with the service's key, and the endpoint a client of it needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.jobs.launch import key_env_name
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.services.keeper.process import service_dir
from pbs_toolkit.services.record import ServiceRecord, find

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobStore


def service_job_record(rec: ServiceRecord) -> Any:
    """A ``JobRecord`` standing for the service: id ``service:NAME``, the router's key and the service's name."""
    return JobRecord(job_id=rec.entry_id, scheduler=rec.scheduler, profile=rec.profile, model=rec.model,
                     served_model_name=rec.served_model_name, preset="service", name=rec.name,
                     run_dir=str(service_dir(rec.name)), transport=rec.transport, created=rec.created,
                     api_key=rec.api_key, api_key_env=key_env_name(rec.name) if rec.api_key else None)


def service_job_status(rec: ServiceRecord) -> JobStatus:
    """A READY ``JobStatus`` at the router's address: what ``update_endpoint`` and ``env_values`` read."""
    from pbs_toolkit.jobs.status import JobStatus, ServerState

    return JobStatus(record=service_job_record(rec), state=ServerState.READY, address=rec.router["host"],
                     port=int(rec.router["port"]))


def routed_status(store: JobStore, name: str | ServiceRecord, what: str = "point at") -> JobStatus:
    """``service_job_status`` of a service that has a router (else ``ServerFailed``: nothing to ``what``)."""
    rec = find(store, name) if isinstance(name, str) else name
    if rec.ended is not None or not rec.router:
        raise ServerFailed(f"service {rec.name} is {rec.state}: no router to {what}")
    return service_job_status(rec)


def registration(store: JobStore, name: str | ServiceRecord, served: str | None = None
                 ) -> tuple[Callable[[], Any], Callable[[Any], JobStatus]]:
    """(record, ready) for ``endpoints.register.register``: the service's entry record, found when asked, and its
    READY status at the router (no wait: the router is the endpoint). ``served``: one model of a multi-model
    service (its entry's ``model``)."""
    seen: list[JobStatus] = []

    def record() -> Any:
        st = routed_status(store, name, "register")
        if served is not None:
            st = replace(st, record=replace(st.record, served_model_name=served))
        seen.append(st)
        return seen[-1].record

    return record, lambda _record: seen[-1]
