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
#: a teardown that began but has not stopped everything yet (the store refuses a new service of that name)
STOPPING = "STOPPING"
#: the service's own copy of its record, next to its keeper's files: what a lost job store re-adopts it from
SERVICE_FILE = "service.json"


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
    #: the intent of a launch in progress, saved before anything is submitted: the job's name, the role it will
    #: take (``current`` or ``successor``) and when; whoever finds it later settles it (services/intents.py)
    launching: str | None = None
    launching_role: str = "current"
    launching_since: float = 0.0
    #: the local scheduler: the GPUs (``CUDA_VISIBLE_DEVICES``) each of the slot's jobs was given
    gpus: dict[str, str] = field(default_factory=dict)
    #: the autoscaler removes this slot (services/scaler.py): out of the router, drained, cancelled, dropped
    retiring: bool = False
    #: each job's worker URL as the keeper saw it: a job whose status no longer has its address (recorded final)
    #: is still known as the service's own, never a foreign worker
    urls: dict[str, str] = field(default_factory=dict)
    #: a multi-model service: each job's worker URLs, one per model (URL -> served name), as the keeper saw them,
    #: so that a job that ended still takes all its workers out of the router, each named by its model
    model_urls: dict[str, dict[str, str]] = field(default_factory=dict)
    #: restarts (services/restarts.py): replacements launched after a failure, when (those in the window count),
    #: the failed job last noted and why it failed, when the next replacement may start, why no more will
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    failed_job: str | None = None
    last_failure: str = ""
    retry_at: float | None = None
    gave_up: str = ""
    #: replacements launched in a row that only waited for GPU memory another process held (no restart spent)
    held_waits: int = 0

    def jobs(self) -> list[str]:
        return [j for j in (self.current, self.successor, self.draining) if j]

    def known_urls(self, job: str) -> list[str]:
        """Every worker URL of ``job`` the keeper saw (its own, then its other models'), once its status has none."""
        own = self.urls.get(job)
        return [*([own] if own else []), *(u for u in self.model_urls.get(job, {}) if u != own)]


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
    #: STARTING, READY, DEGRADED, DOWN (the keeper's last look), STOPPING (a teardown not finished yet: ``ended``
    #: is set, so the keeper stops, but something may still run), then CANCELLED or ENDED (``stop_as``)
    state: str = "STARTING"
    stop_as: str = ""
    ready: int = 0
    ever_ready: bool = False
    created: float = field(default_factory=time.time)
    ended: float | None = None
    #: autoscaling (services/scaler.py): ``spec`` (min/max, W, D), the policy's ``memory``, this tick's decision
    #: (``now``) and the last change (``last``), ``next_index``, ``job_cap``, ``capacity``; empty: fixed replicas
    scale: dict[str, Any] = field(default_factory=dict)
    #: the restart policy of its replicas (services/restarts.py ``RestartPolicy.to_dict``); empty: the defaults
    restart: dict[str, Any] = field(default_factory=dict)
    #: ``--idle-cancel`` of the whole service in seconds (0: off), and the idle watch's ``since``/``sig``
    idle_cancel_s: float = 0.0
    idle: dict[str, Any] = field(default_factory=dict)
    #: the lease of the ``pbstk run`` that started it, in seconds (services/lease.py: its keeper watches it); 0: none
    lease_s: float = 0.0
    #: why the keeper ended the service itself (``idle: no request for 30m00s ...``); "" otherwise
    end_reason: str = ""
    #: routable replicas whose last looks failed (services/health.py): job id -> ``since``, ``looks``
    health: dict[str, Any] = field(default_factory=dict)
    #: the profile's ``replica_unhealthy_looks`` and ``replica_unhealthy_after`` at ``serve``: ``looks``, ``seconds``
    health_rule: dict[str, Any] = field(default_factory=dict)
    #: a multi-model service (services/multi.py): each model's row of the plan (served name, model, preset,
    #: job, node, GPUs, memory share, port); empty: one model
    models: list[dict[str, Any]] = field(default_factory=list)
    #: secret: never in ``to_dict``
    api_key: str | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """Not ended, or ended but its teardown not finished (``pbstk cancel NAME`` finishes it)."""
        return self.ended is None or self.state == STOPPING

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

    def row(self) -> dict[str, Any]:
        """The store's row of this record (what ``from_row`` reads; the service file holds the same)."""
        return {"name": self.name, "transport": self.transport, "created": self.created, "ended": self.ended,
                "api_key": self.api_key, "data": self.data()}


def load(store: JobStore, name: str, created: float | None = None) -> ServiceRecord | None:
    """The service of that name (``created``: only that very one, not a later service of the same name)."""
    rows = store.service_rows(name)
    if not rows or (created is not None and rows[0]["created"] != created):
        return None
    return ServiceRecord.from_row(rows[0])


def find(store: JobStore, name: str) -> ServiceRecord:
    record = load(store, name)
    if record is None:
        from pbs_toolkit.errors import JobNotFound

        raise JobNotFound(f"unknown service {name!r}: `pbstk status` lists the services pbstk knows")
    return record


def all_services(store: JobStore, include_ended: bool = False) -> list[ServiceRecord]:
    """Services newest first; without ``include_ended`` those still active (a ``STOPPING`` one included)."""
    out = [ServiceRecord.from_row(r) for r in store.service_rows()]
    return [s for s in out if include_ended or s.active]


def create(store: JobStore, record: ServiceRecord) -> None:
    store.put_service(record.name, record.transport, record.created, record.data(), record.api_key)
    write_file(store, record)


def save(store: JobStore, record: ServiceRecord) -> bool:
    """Write the record unless the service was ended meanwhile (``False`` then: stop touching it)."""
    saved = store.update_service(record.name, record.data(), created=record.created)
    if saved:
        write_file(store, record)
    return saved


def begin_stop(store: JobStore, record: ServiceRecord, final: str) -> ServiceRecord | None:
    """Mark the service ended (its keeper stops and launches nothing more; the keeper's later writes fail) and
    ``STOPPING``: the final word (``final``) is written by ``finish_stop`` only once everything is stopped, so an
    interrupted teardown is finished by the next ``pbstk cancel NAME``, and no new service takes the name
    meanwhile. One read-modify-write: the keeper's last write (a new job, a launch intent) is kept. Returns the
    record as it is now (``None``: already ended, or no longer recorded)."""

    def change(row: dict[str, Any]) -> dict[str, Any] | None:
        now = ServiceRecord.from_row(row)
        if not now.active:
            return None
        now.stop_as, now.state = now.stop_as or final, STOPPING
        now.ended = now.ended or time.time()
        return now.row()

    row = store.change_service(record.name, record.created, change)
    if row is None:
        return None
    now = ServiceRecord.from_row(row)
    write_file(store, now)
    return now if now.state == STOPPING else None


def finish_stop(store: JobStore, record: ServiceRecord) -> None:
    """Everything is stopped: the final word (CANCELLED or ENDED) replaces ``STOPPING``."""
    record.state = record.stop_as or (record.state if record.state in ("CANCELLED", "ENDED") else "ENDED")
    store.update_service(record.name, record.data(), ended=record.ended, only_active=False, created=record.created)
    write_file(store, record)


def end(store: JobStore, record: ServiceRecord, state: str) -> None:
    """Record the service ended as ``state`` at once, without stopping anything (a service known to be stopped;
    tests). ``pbstk cancel`` goes through ``begin_stop`` and ``finish_stop`` instead."""
    record.state, record.ended = state, record.ended or time.time()
    store.update_service(record.name, record.data(), ended=record.ended, only_active=False, created=record.created)
    write_file(store, record)


def keep_stopping(store: JobStore, record: ServiceRecord) -> None:
    """Write what a teardown settled (intents resolved into jobs) while the service stays ``STOPPING``."""
    store.update_service(record.name, record.data(), ended=record.ended, only_active=False, created=record.created)
    write_file(store, record)


def write_file(store: JobStore, record: ServiceRecord) -> None:
    """``services/NAME/service.json`` (0600: it holds the key), replaced atomically: the store's row, kept where a
    lost store re-adopts it from (``JobStore``'s re-adoption reads ``services/*/service.json``). Best effort: the
    store stays the truth while it is readable."""
    import contextlib
    import os

    directory = store.path.parent / "services" / record.name
    tmp = directory / f".{SERVICE_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(record.row()).encode())
        finally:
            os.close(fd)
        os.replace(tmp, directory / SERVICE_FILE)


def check_name(name: str) -> None:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,60}", name):
        raise UsageError(f"service name {name!r}: letters, digits, '.', '_' and '-' only (at most 61)")


def unless_a_job(store: JobStore, ref: str | None) -> ServiceRecord | None:
    """The service ``ref`` names, unless a job answers to it: a job of that exact id, or of that name while the
    job is active or the service has ended too. Active beats ended (a job's end is its recorded final state);
    both active or both ended: the job (docs/services.md "Names")."""
    if not ref:
        return None
    found = load(store, ref)
    if found is None:
        return None
    named = [r for r in store.all() if r.job_id == ref or r.name == ref]
    if not named:
        return found
    if found.active and all(r.name == ref and r.final_state for r in named):
        return found  # the jobs of that name have ended, the service runs: it is the one meant
    return None


def shared_name_note(store: JobStore, name: str, made: str) -> str | None:
    """What ``serve NAME`` (``made="service"``) or ``launch --name NAME`` (``made="job"``) says when a job and a
    service share NAME: which one later commands naming it act on (``unless_a_job``); ``None`` when none does."""
    jobs = [r for r in store.all() if r.name == name]
    svc = load(store, name)
    if made == "service":
        if not jobs:
            return None
        job = next((r for r in jobs if not r.final_state), jobs[0])
        if job.final_state:
            return (f"job {job.job_id} was named {name} too and has ended ({job.final_state}): `pbstk status {name}`, "
                    f"`pbstk cancel {name}` and the other commands naming {name} act on this service; name that "
                    f"job by its id")
        return (f"job {job.job_id} named {name} is still active: commands naming {name} act on that job while it "
                f"runs, not on this service (an active job wins); cancel it, or serve under another --name")
    if svc is None:
        return None
    if svc.active:
        return (f"service {name} is active too: commands naming {name} act on this job while it runs (an active "
                f"job wins), not on the service; pass another --name to keep them apart")
    return f"service {name} has ended ({svc.state}): commands naming {name} act on this job"
