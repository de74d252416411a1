"""A service's record: what ``pbstk serve`` started and what its keeper keeps up to date.

Kept in the job store's ``services`` table (jobs/store.py, schema 4), not in a JSON file per service: the store
already gives atomic, crash-safe writes between processes (``serve``, the keeper, ``cancel`` and ``status`` all
touch a service at once), keeps the key in a 0600 file like a job's, and a cancel's ``ended`` can be made to win
over a keeper's late write with one ``WHERE ended IS NULL``. The replica jobs are ordinary rows of ``jobs``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobStore

#: the id under which a service's registry entries are recorded in the store's ``endpoints`` table
ENTRY_PREFIX = "service:"


@dataclass
class Slot:
    """Replica ``index``: the job serving now, its keep-alive successor, and one being drained."""

    index: int
    #: how many jobs this slot has launched so far (names: ``NAME-r<k>``, then ``NAME-r<k>-g<gen>``)
    gen: int = 0
    current: str | None = None
    successor: str | None = None
    #: a predecessor taken out of the router, cancelled once idle or after the drain bound
    draining: str | None = None
    drain_started: float | None = None
    #: what the keeper last saw of ``current`` (a ``ServerState`` value)
    state: str = "PENDING"
    #: the local scheduler: the GPUs (``CUDA_VISIBLE_DEVICES``) each of the slot's jobs was given
    gpus: dict[str, str] = field(default_factory=dict)

    def jobs(self) -> list[str]:
        return [j for j in (self.current, self.successor, self.draining) if j]


@dataclass
class ServiceRecord:
    name: str
    model: str
    served_model_name: str
    profile: str
    replicas: int
    #: the RenderRequest's fields (``dataclasses.asdict``): what every replica and successor is launched from
    #: (its ``env`` may hold a token the user passed: not in ``repr``)
    request: dict[str, Any] = field(repr=False)
    transport: str = ""
    scheduler: str = ""
    keep_alive: bool = False
    handover_s: float = 600.0
    walltime_s: int = 0
    policy: str = "round_robin"
    slots: list[Slot] = field(default_factory=list)
    #: services/router.py ``RouterInfo.to_dict()``; empty until the router runs (its token: not in ``repr``)
    router: dict[str, Any] = field(default_factory=dict, repr=False)
    #: ``router: job``: the router's own job (``job_id``, ``run_dir``, ``scheduler``); empty otherwise
    router_job: dict[str, Any] = field(default_factory=dict)
    #: STARTING, READY, DEGRADED, DOWN (the keeper's last look), then CANCELLED or ENDED
    state: str = "STARTING"
    ready: int = 0
    ever_ready: bool = False
    created: float = field(default_factory=time.time)
    ended: float | None = None
    #: secret: never in ``to_dict``
    api_key: str | None = field(default=None, repr=False)

    @property
    def entry_id(self) -> str:
        return ENTRY_PREFIX + self.name

    @property
    def url(self) -> str | None:
        """The base URL clients use (the router's ``/v1``), once the router runs."""
        if not self.router:
            return None
        return f"http://{self.router['host']}:{self.router['port']}/v1"

    def data(self) -> str:
        body = asdict(self)
        body.pop("api_key")
        return json.dumps(body)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ServiceRecord:
        body = json.loads(row["data"])
        body["slots"] = [Slot(**s) for s in body.get("slots") or []]
        body["ended"] = row["ended"]
        return cls(**body, api_key=row["api_key"])


def load(store: JobStore, name: str) -> ServiceRecord | None:
    rows = store.service_rows(name)
    return ServiceRecord.from_row(rows[0]) if rows else None


def find(store: JobStore, name: str) -> ServiceRecord:
    record = load(store, name)
    if record is None:
        from pbs_toolkit.errors import JobNotFound

        raise JobNotFound(f"unknown service {name!r}: `pbstk status` lists the services pbstk knows")
    return record


def all_services(store: JobStore, include_ended: bool = False) -> list[ServiceRecord]:
    out = [ServiceRecord.from_row(r) for r in store.service_rows()]
    return [s for s in out if include_ended or s.ended is None]


def create(store: JobStore, record: ServiceRecord) -> None:
    store.put_service(record.name, record.transport, record.created, record.data(), record.api_key)


def save(store: JobStore, record: ServiceRecord) -> bool:
    """Write the record unless the service was ended meanwhile (``False`` then: stop touching it)."""
    return store.update_service(record.name, record.data())


def end(store: JobStore, record: ServiceRecord, state: str) -> None:
    record.state, record.ended = state, time.time()
    store.update_service(record.name, record.data(), ended=record.ended, only_active=False)


def check_name(name: str) -> None:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,60}", name):
        raise UsageError(f"service name {name!r}: letters, digits, '.', '_' and '-' only (at most 61)")
