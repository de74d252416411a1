"""The local record of launched jobs: SQLite in ``$XDG_STATE_HOME/pbstk/jobs.sqlite3`` (mode 0600).

SQLite gives atomic, crash-safe writes and concurrent readers for free. API keys live here too, which is
why the directory is 0700 and the file 0600.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import JobNotFound, UsageError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT NOT NULL,
    transport TEXT NOT NULL,
    scheduler TEXT NOT NULL,
    profile TEXT NOT NULL,
    model TEXT NOT NULL,
    served_model_name TEXT NOT NULL,
    preset TEXT NOT NULL,
    name TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    created REAL NOT NULL,
    api_key TEXT,
    api_key_env TEXT,
    final_state TEXT,
    extra TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (transport, job_id)
)
"""


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
    api_key: str | None = None
    api_key_env: str | None = None
    #: set once a final state is known, so later status calls skip the scheduler
    final_state: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        """Everything but the secret."""
        data = asdict(self)
        data.pop("api_key")
        return data


class JobStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.user_state_dir() / "jobs.sqlite3"

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        new = not self.path.exists()
        if new:
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute(_SCHEMA)
            with conn:
                yield conn
        finally:
            conn.close()

    def add(self, record: JobRecord) -> None:
        data = asdict(record)
        data["extra"] = json.dumps(record.extra)
        cols = ", ".join(data)
        marks = ", ".join("?" for _ in data)
        with self._connect() as conn:
            conn.execute(f"INSERT OR REPLACE INTO jobs ({cols}) VALUES ({marks})", list(data.values()))  # noqa: S608

    def set_final_state(self, record: JobRecord, state: str, **extra: Any) -> None:
        """Record the final state (and ``extra`` values such as the reason) in one transaction."""
        record.final_state = state
        record.extra.update(extra)
        with self._connect() as conn:
            conn.execute("UPDATE jobs SET final_state = ?, extra = ? WHERE job_id = ? AND transport = ?",
                         (state, json.dumps(record.extra), record.job_id, record.transport))

    def update_extra(self, record: JobRecord, **values: Any) -> None:
        record.extra.update(values)
        with self._connect() as conn:
            conn.execute("UPDATE jobs SET extra = ? WHERE job_id = ? AND transport = ?",
                         (json.dumps(record.extra), record.job_id, record.transport))

    def all(self) -> list[JobRecord]:
        """Every record, newest first."""
        if not self.path.exists():
            return []
        with self._connect() as conn:
            rows = conn.execute("SELECT * FROM jobs ORDER BY created DESC").fetchall()
        out = []
        for row in rows:
            data = dict(row)
            data["extra"] = json.loads(data.get("extra") or "{}")
            out.append(JobRecord(**data))
        return out

    def find(self, ref: str | None) -> JobRecord:
        """A job by full id, id prefix (``123`` for ``123.server``), or name; ``None`` = the newest job."""
        records = self.all()
        if not records:
            raise JobNotFound("no jobs launched yet: start one with `pbstk launch MODEL`")
        if ref is None:
            return records[0]
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

    def remove(self, record: JobRecord) -> None:
        with self._connect() as conn:
            conn.execute("DELETE FROM jobs WHERE job_id = ? AND transport = ?", (record.job_id, record.transport))
