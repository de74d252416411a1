"""The job store's SQLite side: the schema and its migrations, the lock file, rows in and out, services
re-adopted from their directories, and ``sqlite3`` errors in words. ``JobStore`` (jobs/store.py) uses these."""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pbs_toolkit.errors import StoreError
from pbs_toolkit.jobs.records import (
    ACCOUNTING_KEY,
    COLUMNS,
    COUNTERS_KEY,
    FINAL_AT_KEY,
    Intent,
    JobRecord,
    record_values,
    row_to_record,
)
from pbs_toolkit.jobs.spec import SPEC_KEYS, split_legacy_extra

#: 2: the launch settings moved from ``extra`` into their own ``spec`` column (see ``migrate_spec``)
#: 3: the ``endpoints`` table: which registry entries each job wrote (removed when the job ends or is cancelled)
#: 4: the ``services`` table: several replica jobs behind one router (``pbstk serve``; services/record.py)
#: (4 still) the ``ledger`` table: what ``pbstk usage`` needs of a job whose record ``pbstk clean`` removed. Added
#: without a new version: a store lacking it gets it (``TABLES``), and an older pbstk reads a store that has it
#: (it only ignores the ledger), where a new version would make that pbstk refuse the store
SCHEMA_VERSION = 4
SCHEMA = """
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
    spec TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (transport, job_id)
);
CREATE TABLE IF NOT EXISTS intents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    transport TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    created REAL NOT NULL,
    launcher TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS endpoints (
    transport TEXT NOT NULL,
    job_id TEXT NOT NULL,
    registry TEXT NOT NULL,
    format TEXT NOT NULL,
    alias TEXT NOT NULL,
    url TEXT NOT NULL,
    keep INTEGER NOT NULL DEFAULT 0,
    written REAL NOT NULL,
    PRIMARY KEY (transport, job_id, registry, alias)
);
CREATE TABLE IF NOT EXISTS services (
    name TEXT PRIMARY KEY,
    transport TEXT NOT NULL,
    created REAL NOT NULL,
    ended REAL,
    api_key TEXT,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    transport TEXT NOT NULL,
    job_id TEXT NOT NULL,
    created REAL NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (transport, job_id)
);
"""
#: every table of the current schema (a store lacking one gets it, keeping its rows)
TABLES = frozenset({"jobs", "intents", "counters", "endpoints", "services", "ledger"})
#: what a ledger row keeps of a record's ``extra``: when it ended and what ``usage`` recorded; the rest (reasons,
#: endpoints, absence counts) is of no use once the job is forgotten
LEDGER_EXTRA = (FINAL_AT_KEY, ACCOUNTING_KEY, COUNTERS_KEY)


def keep_in_ledger(conn: sqlite3.Connection, record: JobRecord) -> None:
    """Keep ``record``'s usage figures (no secret, ``extra`` cut to ``LEDGER_EXTRA``) before its row goes."""
    data = record.public()
    data["extra"] = {k: v for k, v in record.extra.items() if k in LEDGER_EXTRA}
    data["spec"] = record.spec.to_dict()
    conn.execute("INSERT OR REPLACE INTO ledger (transport, job_id, created, data) VALUES (?, ?, ?, ?)",
                 (record.transport, record.job_id, record.created, json.dumps(data)))


def load_ledger(conn: sqlite3.Connection) -> list[JobRecord]:
    """The records kept in the ledger (compact: no key, ``extra`` cut), newest first; unreadable rows skipped."""
    out = []
    for row in conn.execute("SELECT data FROM ledger ORDER BY created DESC"):
        try:
            data = json.loads(row["data"])
            record, _ = row_to_record({**data, "extra": json.dumps(data.get("extra") or {}),
                                       "spec": json.dumps(data.get("spec") or {})})
        except (ValueError, TypeError, AttributeError):
            record = None
        if record is not None:
            out.append(record)
    return out


@contextmanager
def file_lock(path: Path, timeout: float, store: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, waited for at most ``timeout`` seconds (then ``StoreError``)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(f"the job store {store} is locked by another pbstk for more than "
                                     f"{timeout:g} s ({path})") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def service_stopping(data: str) -> bool:
    """Whether a service row's data says its teardown is not finished (services/record.py ``STOPPING``)."""
    try:
        return bool(json.loads(data).get("state") == "STOPPING")
    except (ValueError, TypeError, AttributeError):
        return False


def readopt_services(conn: sqlite3.Connection, directory: Path) -> list[str]:
    """Services whose ``services/NAME/service.json`` (services/record.py ``write_file``) the store lacks."""
    names = []
    for path in sorted(directory.glob("*/service.json")):
        try:
            row = json.loads(path.read_text())
            values = tuple(row[k] for k in ("name", "transport", "created", "ended", "api_key", "data"))
            with conn:
                if conn.execute("INSERT OR IGNORE INTO services (name, transport, created, ended, api_key, data) "
                                "VALUES (?, ?, ?, ?, ?, ?)", values).rowcount:
                    names.append(str(row["name"]))
        except (OSError, ValueError, TypeError, KeyError, sqlite3.Error):
            continue
    return names


def insert_record(conn: sqlite3.Connection, record: JobRecord) -> None:
    marks = ", ".join("?" for _ in COLUMNS)
    try:
        conn.execute(f"INSERT INTO jobs ({', '.join(COLUMNS)}) VALUES ({marks})", record_values(record))  # noqa: S608
    except sqlite3.IntegrityError:
        raise sqlite3.IntegrityError(f"job {record.job_id} is already recorded; not replacing it") from None


def migrate_spec(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2: add the ``spec`` column and move each row's launch keys out of ``extra`` into it.

    One ``BEGIN IMMEDIATE`` transaction that looks at the columns again, so two pbstk processes opening the
    same old store at once migrate it once; a row whose ``extra`` is not JSON is left as it was (it is read
    with a warning, as before)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "spec" not in {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}:
            conn.execute("ALTER TABLE jobs ADD COLUMN spec TEXT NOT NULL DEFAULT '{}'")
            for row in conn.execute("SELECT rowid, extra FROM jobs").fetchall():
                try:
                    extra = json.loads(row["extra"] or "{}")
                except (ValueError, TypeError):
                    continue
                if not isinstance(extra, dict) or not SPEC_KEYS & extra.keys():
                    continue
                spec, rest = split_legacy_extra(extra, None)
                conn.execute("UPDATE jobs SET extra = ?, spec = ? WHERE rowid = ?",
                             (json.dumps(rest), json.dumps(spec.to_dict()), row["rowid"]))
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # not when BEGIN itself failed (locked): keep that error, not ROLLBACK's
            conn.execute("ROLLBACK")
        raise


def load_intents(conn: sqlite3.Connection) -> list[Intent]:
    out = []
    for row in conn.execute("SELECT id, name, transport, run_dir, created, launcher, record FROM intents"):
        try:
            data = json.loads(row["record"])
            record, _ = row_to_record({**data, "extra": json.dumps(data.get("extra") or {}),
                                        "spec": json.dumps(data.get("spec") or {})})
        except (ValueError, TypeError):
            record = None
        if record is None:
            continue
        out.append(Intent(row["id"], row["name"], row["transport"], row["run_dir"], row["created"],
                          row["launcher"], record))
    return out


def long_empty(path: Path) -> bool:
    """0 bytes for a while and no journal: a store that lost its content, not one being created right now."""
    st = path.stat()
    return st.st_size == 0 and time.time() - st.st_mtime > 2 and not path.with_name(path.name + "-journal").exists()


def describe_error(exc: sqlite3.Error, path: Path) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return f"the job store {path} is locked by another process (waited too long): {text}"
    if "full" in text:
        return f"the job store {path} cannot be written: the disk is full"
    if "readonly" in text or "read-only" in text:
        return f"the job store {path} is read-only: {text}"
    return f"the job store {path} is unusable: {text}"
