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

import fcntl
import json
import os
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import JobNotFound, StoreError, UsageError
from pbs_toolkit.jobs.spec import SPEC_KEYS, LaunchSpec, split_legacy_extra

#: 2: the launch settings moved from ``extra`` into their own ``spec`` column (see ``_migrate_spec``)
#: 3: the ``endpoints`` table: which registry entries each job wrote (removed when the job ends or is cancelled)
#: 4: the ``services`` table: several replica jobs behind one router (``pbstk serve``; services/record.py)
SCHEMA_VERSION = 4
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
"""
#: every table of the current schema (a store lacking one gets it, keeping its rows)
_TABLES = frozenset({"jobs", "intents", "counters", "endpoints", "services"})
#: extra key: when the job was first recorded as ended (``pbstk clean --older-than`` counts from it)
FINAL_AT_KEY = "final_at"
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


_COLUMNS = tuple(f.name for f in fields(JobRecord))
_TEXT = ("job_id", "transport", "scheduler", "profile", "model", "served_model_name", "preset", "name", "run_dir")


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


def _warn(message: str) -> None:
    sys.stderr.write(f"pbstk: warning: {message}\n")


def launcher_token(pid: int | None = None) -> str:
    """``host:pid:starttime`` of a process: tells a live launcher from a dead one whose pid was reused."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def launcher_alive(token: str) -> bool:
    """Whether the process that wrote an intent still runs (unknowable for another host: assume so)."""
    host, _, rest = token.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != socket.gethostname():
        return True
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return start in ("?", _start_time(pid))


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
            raise StoreError(_describe(exc, self.path)) from None
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
        elif not self._checked and _long_empty(self.path):
            existed_empty = True
        conn = sqlite3.connect(self.path, timeout=self.timeout)
        conn.row_factory = sqlite3.Row
        if self._checked:
            return conn
        try:
            problem = self._check(conn)
        except sqlite3.OperationalError as exc:  # locked, read-only, I/O: not corruption, never move aside
            conn.close()
            raise StoreError(_describe(exc, self.path)) from None
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
        if cols and not set(_COLUMNS) - {"spec"} <= cols:
            return f"not a pbstk job store (table jobs lacks {', '.join(sorted(set(_COLUMNS) - cols))})"
        if cols and "spec" not in cols:
            _migrate_spec(conn)
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not cols and tables - _TABLES - {"sqlite_sequence"}:
            return f"not a pbstk job store (tables {', '.join(sorted(tables))})"
        if version < SCHEMA_VERSION or not _TABLES <= tables:  # 2 -> 3 -> 4: new tables, old rows kept
            self._create(conn)
        return None

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.executescript(_SCHEMA)
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
                raise StoreError(_describe(exc, self.path)) from None
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
        for run_dir in _logged_run_dirs(self.path.parent):
            record = read_run_dir_record(run_dir)
            if record is None:
                continue
            try:
                with conn:
                    _insert(conn, record)
                adopted.append(record.job_id)
            except sqlite3.IntegrityError:
                skipped += 1
        services = _readopt_services(conn, self.path.parent / "services")
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
                _insert(conn, record)
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
            rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs ORDER BY created DESC").fetchall()  # noqa: S608
        out, broken = [], []
        for row in rows:
            record, problem = _row_to_record(dict(row))
            if record is None:
                broken.append(f"{row['job_id']!r} ({problem})")
                continue
            if problem:
                broken.append(f"{record.job_id} ({problem}; shown without its details)")
            out.append(record)
        if broken:
            self._warn_once(f"{len(broken)} broken record(s) in the job store {self.path}: {'; '.join(broken[:5])}")
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
        """Forget the job and the registry entries it recorded (the entries themselves are not touched)."""
        with self._connect() as conn:
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
            if row is not None and _service_stopping(row["data"]):  # its teardown has not finished: its router
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
                _insert(conn, record)
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
                    _insert(conn, record)
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
            return _load_intents(conn)

    def _resolve_intents(self, conn: sqlite3.Connection) -> None:
        """Adopt interrupted launches on this machine whose run directory holds a job id; drop those that
        clearly submitted nothing (launcher gone and no submission started, or the submission failed)."""
        for intent in _load_intents(conn):
            if intent.transport:
                continue  # on a login node: `launch` resolves them through its SSH connection
            if launcher_alive(intent.launcher):
                continue  # that launch records its job itself
            job_id = read_job_id_marker(intent.run_dir)
            if job_id:
                self._adopt(conn, intent, job_id)
            elif _nothing_submitted(intent):
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
                ", ".join(_COLUMNS), ", ".join("?" for _ in _COLUMNS)), _values(intent.record))
        _warn(f"adopted job {job_id} ({intent.name}): its launch was interrupted before it was recorded")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            _warn(message)


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


def _service_stopping(data: str) -> bool:
    """Whether a service row's data says its teardown is not finished (services/record.py ``STOPPING``)."""
    try:
        return bool(json.loads(data).get("state") == "STOPPING")
    except (ValueError, TypeError, AttributeError):
        return False


def _readopt_services(conn: sqlite3.Connection, directory: Path) -> list[str]:
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


def _insert(conn: sqlite3.Connection, record: JobRecord) -> None:
    marks = ", ".join("?" for _ in _COLUMNS)
    try:
        conn.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({marks})", _values(record))  # noqa: S608
    except sqlite3.IntegrityError:
        raise sqlite3.IntegrityError(f"job {record.job_id} is already recorded; not replacing it") from None


def _migrate_spec(conn: sqlite3.Connection) -> None:
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


def _values(record: JobRecord) -> list[Any]:
    data = asdict(record)
    data["extra"] = json.dumps(record.extra)
    data["spec"] = json.dumps(record.spec.to_dict())
    return [data[c] for c in _COLUMNS]


def _row_to_record(data: dict[str, Any]) -> tuple[JobRecord | None, str | None]:
    """A record and what is wrong with it; ``None`` when the row cannot stand for a job at all."""
    if any(not isinstance(data.get(k), str) for k in _TEXT) or not isinstance(data.get("created"), (int, float)):
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


def _load_intents(conn: sqlite3.Connection) -> list[Intent]:
    out = []
    for row in conn.execute("SELECT id, name, transport, run_dir, created, launcher, record FROM intents"):
        try:
            data = json.loads(row["record"])
            record, _ = _row_to_record({**data, "extra": json.dumps(data.get("extra") or {}),
                                        "spec": json.dumps(data.get("spec") or {})})
        except (ValueError, TypeError):
            record = None
        if record is None:
            continue
        out.append(Intent(row["id"], row["name"], row["transport"], row["run_dir"], row["created"],
                          row["launcher"], record))
    return out


def read_job_id_marker(run_dir: str) -> str | None:
    """The job id the submission left in ``RUN_DIR/job_id`` (local paths only), if it is a valid id."""
    try:
        text = Path(run_dir, JOB_ID_MARKER).read_text(errors="replace").strip()
    except OSError:
        return None
    return text if JOB_ID_RE.match(text) else None


def _nothing_submitted(intent: Intent) -> bool:
    run = Path(intent.run_dir)
    return nothing_submitted(intent, run.is_dir(), (run / SUBMITTING_MARKER).exists(), (run / "submit_rc").exists())


def nothing_submitted(intent: Intent, run_dir_exists: bool, submitting: bool, failed: bool) -> bool:
    """Whether a launch whose launcher is gone and that left no job id can be forgotten: its run directory is
    gone, the submission never started or it failed; one still running after an hour is given up too."""
    if not run_dir_exists or not submitting or failed:
        return True
    return time.time() - intent.created > INTENT_GRACE_S


def read_run_dir_record(run_dir: str) -> JobRecord | None:
    """The record a launch left in ``RUN_DIR/pbstk-job.json`` with the job id from ``RUN_DIR/job_id``."""
    job_id = read_job_id_marker(run_dir)
    if not job_id:
        return None
    try:
        key_file = Path(run_dir, "api_key")
        return record_from_marker(Path(run_dir, RECORD_MARKER).read_bytes(), job_id,
                                  key_file.read_text().strip() if key_file.exists() else None)
    except OSError:
        return None


def record_from_marker(raw: bytes, job_id: str, api_key: str | None) -> JobRecord | None:
    """The record in a ``RUN_DIR/pbstk-job.json`` (``raw``) for job ``job_id`` with its key; ``None`` if unusable."""
    try:
        data = json.loads(raw)
        data["job_id"] = job_id
        data["api_key"] = api_key
        data["extra"] = json.dumps(data.get("extra") or {})
        data["spec"] = json.dumps(data.get("spec") or {})
        data.setdefault("final_state", None)
        record, _ = _row_to_record({k: data.get(k) for k in _COLUMNS})
    except (ValueError, TypeError, AttributeError):
        return None
    return record


def log_run_dir(state_dir: Path, run_dir: str) -> None:
    """Append a local run directory to ``run_dirs.log``: what a lost store is rebuilt from."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(state_dir / "run_dirs.log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            os.write(fd, (run_dir + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise StoreError(f"cannot write {state_dir / 'run_dirs.log'}: {exc.strerror or exc}") from None


def forget_run_dirs(state_dir: Path, removed: set[str]) -> None:
    """Drop removed run directories from ``run_dirs.log`` (``pbstk clean``), so it does not grow forever either.

    Rewritten to a temp file and renamed over the log; a launch appending meanwhile may lose its line, which
    only matters if the store is lost too (its job is then not re-adopted). Best effort: errors are ignored."""
    import contextlib

    log = state_dir / "run_dirs.log"
    with contextlib.suppress(OSError):
        lines = log.read_bytes().decode("utf-8", "replace").splitlines()
        kept = [line for line in lines if line not in removed]
        if len(kept) == len(lines):
            return
        tmp = log.with_name(f".run_dirs.log.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.write(fd, "".join(line + "\n" for line in kept).encode())
        finally:
            os.close(fd)
        os.replace(tmp, log)


def _logged_run_dirs(state_dir: Path) -> list[str]:
    try:
        text = (state_dir / "run_dirs.log").read_bytes().decode("utf-8", "replace")
    except OSError:
        return []
    return list(dict.fromkeys(line for line in text.splitlines() if line.startswith("/")))


def _long_empty(path: Path) -> bool:
    """0 bytes for a while and no journal: a store that lost its content, not one being created right now."""
    st = path.stat()
    return st.st_size == 0 and time.time() - st.st_mtime > 2 and not path.with_name(path.name + "-journal").exists()


def _describe(exc: sqlite3.Error, path: Path) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return f"the job store {path} is locked by another process (waited too long): {text}"
    if "full" in text:
        return f"the job store {path} cannot be written: the disk is full"
    if "readonly" in text or "read-only" in text:
        return f"the job store {path} is read-only: {text}"
    return f"the job store {path} is unusable: {text}"
