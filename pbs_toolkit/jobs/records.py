"""What the job store holds, as Python values: ``JobRecord`` (one launched job), ``RegistryEntry`` (an endpoint
entry a job wrote), ``Intent`` (a launch not recorded yet), the markers a launch leaves in its run directory, and
a database row read back into a record (``row_to_record``). jobs/store.py keeps them in SQLite."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pbs_toolkit.errors import JobNotFound, UsageError
from pbs_toolkit.jobs.spec import LaunchSpec, split_legacy_extra

#: extra key: when the job was first recorded as ended (``pbstk clean --older-than`` counts from it)
FINAL_AT_KEY = "final_at"
#: extra keys of what ``pbstk usage`` keeps of an ended job: the scheduler's final accounting
#: (campaigns/usage.py) and the server's counters scraped before its cancel (campaigns/counters.py)
ACCOUNTING_KEY = "usage_accounting"
COUNTERS_KEY = "usage_counters"
#: final states a record may carry (status.ServerState's final members)
FINAL_STATES = frozenset({"FAILED", "FINISHED", "CANCELLED", "LOST"})
#: what a scheduler job id may look like in a ``RUN_DIR/job_id`` marker
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.\[\]-]{1,200}$")
#: markers the submission leaves in the run directory (see schedulers/marker.py)
JOB_ID_MARKER = "job_id"
SUBMITTING_MARKER = ".submitting"
RECORD_MARKER = "pbstk-job.json"
#: an intent whose launcher is gone but whose submission may still be running is kept this long
INTENT_GRACE_S = 3600.0


@dataclass
class JobRecord:
    job_id: str
    scheduler: str
    profile: str
    model: str
    served_model_name: str
    preset: str
    name: str
    run_dir: str
    #: "" for this machine, else the SSH host the job was submitted through
    transport: str = ""
    created: float = field(default_factory=time.time)
    #: secret: never in ``repr`` (a notebook prints reprs and saves them) nor in ``public``/``to_dict``
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    #: set once a final state is known, so later status calls skip the scheduler
    final_state: str | None = None
    #: runtime bookkeeping only (final reason, absence count, verified endpoint, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    #: what the job was launched with (layout, vLLM arguments, ...): written once by ``launch``
    spec: LaunchSpec = field(default_factory=LaunchSpec)

    def public(self) -> dict[str, Any]:
        """Everything but the secret."""
        data = asdict(self)
        data.pop("api_key")
        return data

    def to_dict(self) -> dict[str, Any]:
        """The ``job`` object of ``pbstk jobs --json`` (docs/json.md): :meth:`public` with the transport named
        ``local`` for this machine, as ``status --json`` (which adds the state fields) and the tables name it."""
        from pbs_toolkit.schema import stamp

        data = self.public()
        data["transport"] = self.transport or "local"
        return stamp("job", data)


COLUMNS = tuple(f.name for f in fields(JobRecord))
TEXT_FIELDS = ("job_id", "transport", "scheduler", "profile", "model", "served_model_name", "preset", "name", "run_dir")


@dataclass
class RegistryEntry:
    """One entry a job wrote into an endpoint registry: what ``cancel`` and the job's end remove again."""

    job_id: str
    transport: str
    #: the real path of the registry file that was written
    registry: str
    format: str
    alias: str
    url: str
    #: ``update-endpoint --keep-after-end`` / ``cancel --keep-endpoint``: leave it when the job ends
    keep: bool = False
    written: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Intent:
    """A launch that wrote its plan but whose job id is not recorded yet."""

    id: int
    name: str
    transport: str
    run_dir: str
    created: float
    launcher: str
    record: JobRecord


def record_values(record: JobRecord) -> list[Any]:
    data = asdict(record)
    data["extra"] = json.dumps(record.extra)
    data["spec"] = json.dumps(record.spec.to_dict())
    return [data[c] for c in COLUMNS]


def row_to_record(data: dict[str, Any]) -> tuple[JobRecord | None, str | None]:
    """A record and what is wrong with it; ``None`` when the row cannot stand for a job at all."""
    if any(not isinstance(data.get(k), str) for k in TEXT_FIELDS) or not isinstance(data.get("created"), (int, float)):
        return None, "a required field is missing or not text"
    if data.get("final_state") is not None and data["final_state"] not in FINAL_STATES:
        return None, f"unknown final state {str(data['final_state'])[:40]!r}"
    for key in ("api_key", "api_key_env"):
        if data.get(key) is not None and not isinstance(data[key], str):
            data[key] = None
    problem = None
    try:
        extra = json.loads(data.get("extra") or "{}")
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except (ValueError, TypeError) as exc:
        extra, problem = {"broken_record": f"extra is not a JSON object: {exc}"}, "bad extra JSON"
    try:
        spec = json.loads(data.get("spec") or "{}")
    except (ValueError, TypeError):
        spec, problem = {}, problem or "bad spec JSON"
    # rows, intents and run-directory records written before LaunchSpec kept its keys in extra
    data["spec"], data["extra"] = split_legacy_extra(extra, spec)
    return JobRecord(**data), problem


def find_in(records: list[JobRecord], ref: str) -> JobRecord:
    """A job of ``records`` (newest first) by full id, id prefix (``123`` for ``123.server``), or name (the newest
    job of that name); ``JobNotFound`` or, for a prefix or name several jobs share, ``UsageError``."""
    for match in (
        [r for r in records if r.job_id == ref],
        [r for r in records if r.job_id.split(".", 1)[0] == ref],
        [r for r in records if r.name == ref],
    ):
        if len(match) == 1 or (match and match[0].name == ref):
            return match[0]  # newest job of that name
        if len(match) > 1:
            ids = ", ".join(r.job_id for r in match[:5])
            raise UsageError(f"job {ref!r} is ambiguous: {ids}")
    raise JobNotFound(f"unknown job {ref!r}: `pbstk jobs` lists the jobs pbstk knows")
