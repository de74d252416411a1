"""The local record of launched jobs: SQLite in ``$XDG_STATE_HOME/pbstk/jobs.sqlite3`` (mode 0600).

SQLite gives atomic, crash-safe writes and concurrent readers for free. API keys live here too, which is
why the directory is 0700 and the file 0600.

A launch is recorded twice: an *intent* (name, run directory, the planned record) before anything is
submitted, then the job id, in one transaction that also removes the intent. When pbstk dies in between,
the submission itself leaves the job id in ``RUN_DIR/job_id``; the next read of the store adopts it. Every
``sqlite3`` failure becomes a ``StoreError`` naming the path; a store that is not a readable pbstk store is
moved aside (``jobs.sqlite3.corrupt-<time>``) and the jobs it knew are re-adopted from their run directories.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import JobNotFound, StoreError, UsageError
from pbs_toolkit.jobs.launcher import launcher_alive, launcher_token
from pbs_toolkit.jobs.records import (
    COLUMNS,
    FINAL_AT_KEY,
    FINAL_STATES,
    INTENT_GRACE_S,
    JOB_ID_MARKER,
    JOB_ID_RE,
    RECORD_MARKER,
    SUBMITTING_MARKER,
    Intent,
    JobRecord,
    RegistryEntry,
    find_in,
    record_values,
    row_to_record,
)
from pbs_toolkit.jobs.run_markers import (
    forget_run_dirs,
    log_run_dir,
    logged_run_dirs,
    nothing_submitted,
    nothing_submitted_here,
    read_job_id_marker,
    read_run_dir_record,
    record_from_marker,
)
from pbs_toolkit.jobs.store_sql import (
    SCHEMA,
    SCHEMA_VERSION,
    TABLES,
    describe_error,
    file_lock,
    insert_record,
    keep_in_ledger,
    load_intents,
    load_ledger,
    long_empty,
    migrate_spec,
    readopt_services,
    service_stopping,
)

#: the names this module has always offered (importers keep importing them from here)
__all__ = ["FINAL_AT_KEY", "FINAL_STATES", "INTENT_GRACE_S", "JOB_ID_MARKER", "JOB_ID_RE", "RECORD_MARKER",
           "SCHEMA_VERSION", "SUBMITTING_MARKER", "Intent", "JobRecord", "JobStore", "RegistryEntry", "StoreError",
           "file_lock", "forget_run_dirs", "launcher_alive", "launcher_token", "log_run_dir", "nothing_submitted",
           "read_job_id_marker", "read_run_dir_record", "record_from_marker"]


def _warn(message: str) -> None:
    sys.stderr.write(f"pbstk: warning: {message}\n")


class JobStore:
    def __init__(self, path: Path | None = None, *, timeout: float | None = None) -> None:
        self.path = path or paths.user_state_dir() / "jobs.sqlite3"
        #: how long a write waits for another writer's lock before StoreError (PBSTK_STORE_TIMEOUT, default 30)
        self.timeout = (timeout if timeout is not None
                        else env_float("PBSTK_STORE_TIMEOUT", 30.0, lambda v: 0 <= v < 1e6))
        self._checked = False
        self._warned: set[str] = set()

    # -- opening, checking, moving a bad store aside ------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """One connection in one transaction; every sqlite3/OS failure becomes one ``StoreError`` line."""
        try:
            conn = self._open()
        except OSError as exc:
            raise StoreError(f"cannot open the job store {self.path}: {exc.strerror or exc}") from None
        try:
            with conn:
                yield conn
        except sqlite3.Error as exc:
            raise StoreError(describe_error(exc, self.path)) from None
        except OSError as exc:
            raise StoreError(f"cannot write the job store {self.path}: {exc.strerror or exc}") from None
        finally:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        existed_empty = created = False
        if not self.path.exists():
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
            created = (self.path.parent / "run_dirs.log").exists()  # a store deleted after launches
        elif not self._checked and long_empty(self.path):
            existed_empty = True
        conn = sqlite3.connect(self.path, timeout=self.timeout)
        conn.row_factory = sqlite3.Row
        if self._checked:
            return conn
        try:
            problem = self._check(conn)
        except sqlite3.OperationalError as exc:  # locked, read-only, I/O: not corruption, never move aside
            conn.close()
            raise StoreError(describe_error(exc, self.path)) from None
        except sqlite3.DatabaseError as exc:
            problem = str(exc)
        if problem:
            conn.close()
            self._move_aside(problem)
            conn = sqlite3.connect(self.path, timeout=self.timeout)
            conn.row_factory = sqlite3.Row
            self._create(conn)
            self._checked = True
            self._readopt_from_run_dirs(conn)
        elif existed_empty or created:
            self._checked = True
            self._readopt_from_run_dirs(conn, empty=existed_empty)
        self._checked = True
        return conn

    def _check(self, conn: sqlite3.Connection) -> str | None:
        """Why this file is not a usable pbstk store (``None`` when it is); creates the tables when new."""
        result = conn.execute("PRAGMA quick_check").fetchone()
        if result is None or result[0] != "ok":
            return f"integrity check failed: {result[0] if result else 'no answer'}"
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            conn.close()
            raise StoreError(f"the job store {self.path} was written by a newer pbstk (schema {version}); "
                             f"upgrade pbstk or set XDG_STATE_HOME elsewhere")
        cols = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
        if cols and not set(COLUMNS) - {"spec"} <= cols:
            return f"not a pbstk job store (table jobs lacks {', '.join(sorted(set(COLUMNS) - cols))})"
        if cols and "spec" not in cols:
            migrate_spec(conn)
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not cols and tables - TABLES - {"sqlite_sequence"}:
            return f"not a pbstk job store (tables {', '.join(sorted(tables))})"
        if version < SCHEMA_VERSION or not TABLES <= tables:  # 2 -> 3 -> 4: new tables, old rows kept
            self._create(conn)
        return None

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _move_aside(self, problem: str) -> None:
        """Rename the bad store (under a lock, so two processes never move a fresh store) and say so."""
        with file_lock(self.path.parent / ".store.lock", self.timeout, self.path):
            try:
                conn = sqlite3.connect(self.path, timeout=self.timeout)
                try:
                    still_bad = self._check(conn) is not None
                finally:
                    conn.close()
            except sqlite3.OperationalError as exc:
                raise StoreError(describe_error(exc, self.path)) from None
            except sqlite3.DatabaseError:
                still_bad = True
            if not still_bad:
                return  # another process already replaced it
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.replace(self.path, aside)
            journal = self.path.with_name(self.path.name + "-journal")
            if journal.exists():
                os.replace(journal, aside.with_name(aside.name + "-journal"))
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        _warn(f"the job store {self.path} is unusable ({problem}); moved it to {aside} and started a new one")

    def _readopt_from_run_dirs(self, conn: sqlite3.Connection, *, empty: bool = False) -> None:
        """A lost store must not silently forget jobs: re-record every run directory pbstk launched here
        that holds a job id (``run_dirs.log`` lists them)."""
        adopted, skipped = [], 0
        for run_dir in logged_run_dirs(self.path.parent):
            record = read_run_dir_record(run_dir)
            if record is None:
                continue
            try:
                with conn:
                    insert_record(conn, record)
                adopted.append(record.job_id)
            except sqlite3.IntegrityError:
                skipped += 1
        services = readopt_services(conn, self.path.parent / "services")
        if adopted:
            _warn(f"re-adopted {len(adopted)} job(s) from their run directories: {', '.join(adopted[:10])}")
        if services:
            _warn(f"re-adopted {len(services)} service(s) from their service files: {', '.join(services[:10])}")
        elif empty:
            _warn(f"the job store {self.path} was empty (0 bytes); no run directory with a job id to re-adopt")

    # -- jobs -------------------------------------------------------------------------------------------

    def add(self, record: JobRecord) -> None:
        """Record a job. Never replaces: the same (transport, job id) twice is a ``StoreError``."""
        try:
            with self._connect() as conn:
                insert_record(conn, record)
        except StoreError as exc:
            raise StoreError(f"job {record.job_id} could not be recorded: {exc}") from None

    def set_final_state(self, record: JobRecord, state: str, **extra: Any) -> None:
        """Record the final state (and ``extra`` values such as the reason, and when) in one transaction."""
        record.final_state = state
        record.extra.update(extra)
        record.extra.setdefault(FINAL_AT_KEY, time.time())
        with self._connect() as conn:
            conn.execute("UPDATE jobs SET final_state = ?, extra = ? WHERE job_id = ? AND transport = ?",
                         (state, json.dumps(record.extra), record.job_id, record.transport))

    def update_extra(self, record: JobRecord, **values: Any) -> None:
        record.extra.update(values)
        with self._connect() as conn:
            conn.execute("UPDATE jobs SET extra = ? WHERE job_id = ? AND transport = ?",
                         (json.dumps(record.extra), record.job_id, record.transport))

    def all(self) -> list[JobRecord]:
        """Every record, newest first. Unreadable rows are skipped with one warning line; interrupted
        launches whose run directory holds a job id are adopted first."""
        if not self.path.exists() and not (self.path.parent / "run_dirs.log").exists():
            return []
        with self._connect() as conn:
            self._resolve_intents(conn)
            rows = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM jobs ORDER BY created DESC").fetchall()  # noqa: S608
        out, broken = [], []
        for row in rows:
            record, problem = row_to_record(dict(row))
            if record is None:
                broken.append(f"{row['job_id']!r} ({problem})")
                continue
            if problem:
                broken.append(f"{record.job_id} ({problem}; shown without its details)")
            out.append(record)
        if broken:
            self._warn_once(f"{len(broken)} broken record(s) in the job store {self.path}: {'; '.join(broken[:5])}")
        return out

    def ledger(self) -> list[JobRecord]:
        """The compact records of forgotten jobs (``remove``), newest first: what ``pbstk usage`` still reports."""
        if not self.path.exists():
            return []
        with self._connect() as conn:
            return load_ledger(conn)

    def find(self, ref: str | None) -> JobRecord:
        """A job by full id, id prefix (``123`` for ``123.server``), or name; ``None`` = the newest job."""
        records = self.all()
        if not records:
            raise JobNotFound("no jobs launched yet: start one with `pbstk launch MODEL`")
        return records[0] if ref is None else find_in(records, ref)

    def job_named(self, ref: str | None) -> JobRecord | None:
        """The job ``ref`` names by its full id or its name (``None``: the newest job), else ``None``: an id
        prefix may be a service's name, and a service's name is a job's only when no job has it
        (services/record.py ``unless_a_job``)."""
        records = self.all()
        if ref is None:
            return records[0] if records else None
        if not any(r.job_id == ref or r.name == ref for r in records):
            return None
        return find_in(records, ref)

    def remove(self, record: JobRecord) -> None:
        """Forget the job and its records of registry entries (not the entries); its usage moves to the ledger."""
        with self._connect() as conn:
            keep_in_ledger(conn, record)
            conn.execute("DELETE FROM jobs WHERE job_id = ? AND transport = ?", (record.job_id, record.transport))
            conn.execute("DELETE FROM endpoints WHERE job_id = ? AND transport = ?", (record.job_id, record.transport))

    # -- registry entries written by jobs -----------------------------------------------------------------

    def add_registry_entry(self, entry: RegistryEntry) -> None:
        """Record (or re-record: same job, registry and alias) an entry ``update-endpoint`` wrote."""
        with self._connect() as conn:
            conn.execute("INSERT OR REPLACE INTO endpoints (transport, job_id, registry, format, alias, url, keep, "
                         "written) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (entry.transport, entry.job_id, entry.registry, entry.format, entry.alias, entry.url,
                          int(entry.keep), entry.written))

    def registry_entries(self, record: JobRecord | None = None) -> list[RegistryEntry]:
        """The entries ``record`` wrote (``None``: every job's), oldest first."""
        query = "SELECT transport, job_id, registry, format, alias, url, keep, written FROM endpoints"
        args: tuple[str, ...] = ()
        if record is not None:
            query, args = query + " WHERE job_id = ? AND transport = ?", (record.job_id, record.transport)
        if not self.path.exists():
            return []
        with self._connect() as conn:
            rows = conn.execute(query + " ORDER BY written", args).fetchall()
        return [RegistryEntry(job_id=r["job_id"], transport=r["transport"], registry=r["registry"],
                              format=r["format"], alias=r["alias"], url=r["url"], keep=bool(r["keep"]),
                              written=float(r["written"])) for r in rows]

    def forget_registry_entry(self, entry: RegistryEntry) -> None:
        with self._connect() as conn:
            conn.execute("DELETE FROM endpoints WHERE transport = ? AND job_id = ? AND registry = ? AND alias = ?",
                         (entry.transport, entry.job_id, entry.registry, entry.alias))

    def forget_alias(self, registry: str, alias: str) -> None:
        """Every job's record of ``alias`` in ``registry`` (the user removed the entry by hand)."""
        with self._connect() as conn:
            conn.execute("DELETE FROM endpoints WHERE registry = ? AND alias = ?", (registry, alias))

    def keep_registry_entries(self, record: JobRecord) -> None:
        """Mark every entry of ``record`` as kept after its end (``cancel --keep-endpoint``)."""
        with self._connect() as conn:
            conn.execute("UPDATE endpoints SET keep = 1 WHERE job_id = ? AND transport = ?",
                         (record.job_id, record.transport))

    def next_id(self, scheduler: str) -> int:
        """A number this store never handed out before for ``scheduler``: ids for backends that number their own
        jobs. The first call starts above the highest numeric id recorded for that scheduler."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT value FROM counters WHERE name = ?", (scheduler,)).fetchone()
            if row is None:
                ids = [r[0] for r in conn.execute("SELECT job_id FROM jobs WHERE scheduler = ?", (scheduler,))]
                start = max([int(i.split(".", 1)[0]) for i in ids if i.split(".", 1)[0].isdigit()], default=0)
                value = start + 1
                conn.execute("INSERT INTO counters (name, value) VALUES (?, ?)", (scheduler, value))
            else:
                value = int(row[0]) + 1
                conn.execute("UPDATE counters SET value = ? WHERE name = ?", (value, scheduler))
        return value

    # -- services (rows are services/record.py's JSON; the key in its own column, like a job's) ----------

    def put_service(self, name: str, transport: str, created: float, data: str, api_key: str | None) -> None:
        """Record a new service, replacing an ended one of that name; an active one of that name is refused."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT ended, data FROM services WHERE name = ?", (name,)).fetchone()
            if row is not None and row["ended"] is None:
                raise UsageError(f"a service named {name!r} is already active; cancel it or pass another --name")
            if row is not None and service_stopping(row["data"]):  # its teardown has not finished: its router
                raise UsageError(f"a service named {name!r} is still being stopped (an interrupted `pbstk cancel`?); "
                                 f"run `pbstk cancel {name}` to finish it, or pass another --name")
            conn.execute("INSERT OR REPLACE INTO services (name, transport, created, ended, api_key, data) "
                         "VALUES (?, ?, ?, NULL, ?, ?)", (name, transport, created, api_key, data))

    def update_service(self, name: str, data: str, *, ended: float | None = None, only_active: bool = True,
                       created: float | None = None) -> bool:
        """Rewrite a service's data (``ended``: mark it ended too). ``only_active``: never over an ended one (the
        keeper's writes after a cancel must not bring it back). ``created``: only that very service, not a later one
        of the same name. ``False`` when nothing was written."""
        query = "UPDATE services SET data = ?" + (", ended = ?" if ended is not None else "") + " WHERE name = ?"
        args: tuple[Any, ...] = (data, ended, name) if ended is not None else (data, name)
        if only_active:
            query += " AND ended IS NULL"
        if created is not None:
            query, args = query + " AND created = ?", (*args, created)
        with self._connect() as conn:
            return conn.execute(query, args).rowcount > 0

    def change_service(self, name: str, created: float,
                       change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Read-modify-write of one service's row in one transaction (so nobody's write in between is lost):
        ``change`` gets the row and returns the row to write (``ended``, ``data``), or ``None`` to leave it.
        Returns the row as it is now; ``None`` when that service (``created``) is not recorded."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            found = conn.execute("SELECT name, transport, created, ended, api_key, data FROM services "
                                 "WHERE name = ? AND created = ?", (name, created)).fetchone()
            if found is None:
                return None
            row = dict(found)
            new = change(dict(row))
            if new is None:
                return row
            conn.execute("UPDATE services SET ended = ?, data = ? WHERE name = ? AND created = ?",
                         (new["ended"], new["data"], name, created))
            return {**row, "ended": new["ended"], "data": new["data"]}

    def service_rows(self, name: str | None = None) -> list[dict[str, Any]]:
        """Service rows (``name``: that one), newest first, as dictionaries."""
        if not self.path.exists():
            return []
        query = "SELECT name, transport, created, ended, api_key, data FROM services"
        args: tuple[str, ...] = ()
        if name is not None:
            query, args = query + " WHERE name = ?", (name,)
        with self._connect() as conn:
            return [dict(r) for r in conn.execute(query + " ORDER BY created DESC", args).fetchall()]

    def remove_service(self, name: str) -> None:
        with self._connect() as conn:
            conn.execute("DELETE FROM services WHERE name = ?", (name,))

    # -- intents ----------------------------------------------------------------------------------------

    def add_intent(self, record: JobRecord) -> int:
        """Write the plan of a launch before anything is submitted; returns the intent's id."""
        data = json.dumps(asdict(record))
        with self._connect() as conn:
            cur = conn.execute(
                "INSERT INTO intents (name, transport, run_dir, created, launcher, record) VALUES (?, ?, ?, ?, ?, ?)",
                (record.name, record.transport, record.run_dir, time.time(), launcher_token(), data))
            return int(cur.lastrowid or 0)

    def record_submitted(self, intent_id: int, record: JobRecord) -> None:
        """The job id, in the same transaction that retires the intent."""
        try:
            with self._connect() as conn:
                insert_record(conn, record)
                conn.execute("DELETE FROM intents WHERE id = ?", (intent_id,))
        except StoreError as exc:
            raise StoreError(f"job {record.job_id} could not be recorded: {exc}") from None

    def record_service_job(self, intent_id: int, record: JobRecord, name: str, created: float, data: str) -> bool:
        """A service's own job (its router job), submitted: the service's row gets ``data`` (which names the job)
        in the transaction that retires the intent. A service ended meanwhile gets nothing: the job is recorded as
        a plain job instead, so it is never unknown. ``True`` when the service recorded it."""
        try:
            with self._connect() as conn:
                took = conn.execute("UPDATE services SET data = ? WHERE name = ? AND created = ? AND ended IS NULL",
                                    (data, name, created)).rowcount > 0
                if not took:
                    insert_record(conn, record)
                conn.execute("DELETE FROM intents WHERE id = ?", (intent_id,))
        except StoreError as exc:
            raise StoreError(f"job {record.job_id} could not be recorded: {exc}") from None
        return took

    def drop_intent(self, intent_id: int) -> None:
        with self._connect() as conn:
            conn.execute("DELETE FROM intents WHERE id = ?", (intent_id,))

    def intents(self) -> list[Intent]:
        """Launches not yet resolved (after adopting what can be adopted)."""
        if not self.path.exists() and not (self.path.parent / "run_dirs.log").exists():
            return []
        with self._connect() as conn:
            self._resolve_intents(conn)
            return load_intents(conn)

    def _resolve_intents(self, conn: sqlite3.Connection) -> None:
        """Adopt interrupted launches on this machine whose run directory holds a job id; drop those that
        clearly submitted nothing (launcher gone and no submission started, or the submission failed)."""
        for intent in load_intents(conn):
            if intent.transport:
                continue  # on a login node: `launch` resolves them through its SSH connection
            if launcher_alive(intent.launcher):
                continue  # that launch records its job itself
            job_id = read_job_id_marker(intent.run_dir)
            if job_id:
                self._adopt(conn, intent, job_id)
            elif nothing_submitted_here(intent):
                with conn:
                    conn.execute("DELETE FROM intents WHERE id = ?", (intent.id,))

    def resolve_intent(self, intent: Intent, job_id: str | None, nothing_submitted: bool) -> None:
        """Adopt ``intent`` as job ``job_id``, or drop it when ``nothing_submitted`` (markers read elsewhere)."""
        if launcher_alive(intent.launcher):
            return
        with self._connect() as conn:
            if job_id:
                self._adopt(conn, intent, job_id)
            elif nothing_submitted:
                conn.execute("DELETE FROM intents WHERE id = ?", (intent.id,))

    def _adopt(self, conn: sqlite3.Connection, intent: Intent, job_id: str) -> None:
        intent.record.job_id = job_id
        with conn:
            conn.execute("DELETE FROM intents WHERE id = ?", (intent.id,))
            conn.execute("INSERT OR IGNORE INTO jobs ({}) VALUES ({})".format(  # noqa: S608
                ", ".join(COLUMNS), ", ".join("?" for _ in COLUMNS)), record_values(intent.record))
        _warn(f"adopted job {job_id} ({intent.name}): its launch was interrupted before it was recorded")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            _warn(message)


