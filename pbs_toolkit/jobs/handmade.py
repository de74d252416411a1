"""Jobs submitted by hand: ``render -o DIR`` writes a run directory to submit yourself, ``adopt`` records its job.

``render -o DIR`` writes the job script, ``start_vllm.sh``, the job's API key (``DIR/api_key``, created 0600: the
start script serves with it, so a hand-submitted job is authenticated like a launched one) and the record marker
``DIR/pbstk-job.json`` (everything but the key). After submitting it by hand, ``pbstk adopt JOBID DIR``
records the job from those files; ``status``, ``wait``, ``update-endpoint`` ... then work on it, and also accept
``DIR`` itself in place of a job id once the job wrote its id there.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from pbs_toolkit import paths
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.launch import job_record, new_api_key
from pbs_toolkit.jobs.render import RenderedJob, RenderRequest
from pbs_toolkit.jobs.store import (
    JOB_ID_MARKER,
    JOB_ID_RE,
    RECORD_MARKER,
    JobRecord,
    JobStore,
    StoreError,
    log_run_dir,
    read_job_id_marker,
    record_from_marker,
)
from pbs_toolkit.transports.base import Runner

KEY_FILE = "api_key"


def _usable_key(path: str) -> str | None:
    """The key an earlier ``render -o`` left in ``path`` (a job submitted from it may already serve with it)."""
    try:
        with open(path, encoding="latin-1") as fh:
            key = fh.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return key if key and all(32 < ord(c) < 127 for c in key) else None


def write_render_dir(out_dir: str, rendered: RenderedJob, req: RenderRequest, *, use_api_key: bool = True,
                     api_key: str | None = None) -> list[str]:
    """Write ``rendered`` into ``out_dir`` for a hand submission: the scripts, the record marker and (unless
    ``use_api_key`` is off) the key, all or none; the paths written. A key already in ``DIR/api_key`` is kept
    (a job submitted from the directory before may serve with it), else ``api_key`` or a new one."""
    key_path = os.path.join(out_dir, KEY_FILE)
    key = (api_key or _usable_key(key_path) or new_api_key()) if use_api_key else None
    record = job_record(req, rendered, "", key)
    public = {k: v for k, v in record.public().items() if k not in ("job_id", "final_state")}
    files: dict[str, tuple[bytes, int]] = {
        rendered.script_name: (rendered.job_script.encode(), 0o755),
        "start_vllm.sh": (rendered.start_script.encode(), 0o755),
        RECORD_MARKER: (json.dumps(public, indent=2).encode() + b"\n", 0o644),
    }
    if key:
        files[KEY_FILE] = (key.encode() + b"\n", 0o600)
    _write_all(out_dir, files)
    if not use_api_key:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(key_path)  # an older render's key would make pbstk expect one the new job does not use
    return [os.path.join(out_dir, name) for name in files]


def _write_all(out_dir: str, files: dict[str, tuple[bytes, int]]) -> None:
    """Every file or none: each is created under a temporary name with its final mode (``O_EXCL``: never an
    existing file, never a moment with wider permissions), then all are renamed once all are written (a full
    disk or a read-only directory must not leave one new script next to an old one)."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    temps: dict[str, str] = {}
    try:
        for name, (data, mode) in files.items():
            tmp = os.path.join(out_dir, f".{name}.pbstk-tmp")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a leftover of an interrupted render
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            temps[name] = tmp
            try:
                os.fchmod(fd, mode)  # the umask may have narrowed it; never widened past ``mode``
                os.write(fd, data)
            finally:
                os.close(fd)
        for name, tmp in temps.items():
            os.replace(tmp, os.path.join(out_dir, name))
    except OSError:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        raise


def adopt(store: JobStore, job_id: str, run_dir: str, runner: Runner, transport: str = "") -> JobRecord:
    """Record job ``job_id``, submitted by hand from ``run_dir`` (written by ``render -o``), read through
    ``runner``; ``transport`` is the SSH host it was read through ("" for this machine)."""
    if not JOB_ID_RE.match(job_id):
        raise UsageError(f"bad job id {job_id[:60]!r}: the id the scheduler printed (e.g. 1234.pbs01)")
    where = runner.expanduser(run_dir)
    if not transport:
        where = os.path.realpath(where)
    try:
        raw = runner.read_bytes(f"{where}/{RECORD_MARKER}")
    except FileNotFoundError:
        raise UsageError(f"{run_dir} has no {RECORD_MARKER}: not a directory written by `pbstk render -o DIR`"
                         ) from None
    except OSError as exc:
        raise UsageError(f"cannot read {run_dir}/{RECORD_MARKER}: {exc.strerror or exc}") from None
    try:
        key = runner.read_bytes(f"{where}/{KEY_FILE}").decode("latin-1").strip() or None
    except FileNotFoundError:
        key = None
    record = record_from_marker(raw, job_id, key)
    if record is None:
        raise UsageError(f"{run_dir}/{RECORD_MARKER} is not a record pbstk can read")
    if record.run_dir.rstrip("/") != where.rstrip("/"):
        raise UsageError(f"{run_dir}'s scripts run in {record.run_dir} (the directory they were rendered for): "
                         f"adopt that directory")
    record.transport = transport
    record.spec.ssh_host = transport or None
    if any(r.job_id == job_id and r.transport == transport for r in store.all()):
        raise UsageError(f"job {job_id} is already recorded: `pbstk status {job_id}`")
    try:
        store.add(record)
    except StoreError as exc:
        raise UsageError(exc.message) from None
    if not transport:
        log_run_dir(paths.user_state_dir(), record.run_dir)  # a lost store re-adopts it from here
    with contextlib.suppress(OSError):
        runner.write_bytes(f"{record.run_dir}/{JOB_ID_MARKER}", job_id.encode() + b"\n", 0o644)
    return record


def record_for_run_dir(store: JobStore, ref: str, runner: Runner) -> JobRecord | None:
    """The job of run directory ``ref`` (a path on this machine), adopted first when the job wrote its id there
    (``RUN_DIR/job_id``, or ``server.json`` once it runs); ``None`` when ``ref`` is not a directory."""
    if "/" not in ref or not os.path.isdir(os.path.expanduser(ref)):
        return None
    where = os.path.realpath(os.path.expanduser(ref))
    for record in store.all():
        if not record.transport and os.path.realpath(record.run_dir) == where:
            return record
    job_id = read_job_id_marker(where) or _job_id_from_server_json(where)
    if not job_id:
        raise UsageError(f"no job is recorded for {ref} and it holds no job id yet: after submitting it by hand, "
                         f"`pbstk adopt JOBID {ref}`")
    return adopt(store, job_id, where, runner)


def _job_id_from_server_json(run_dir: str) -> str | None:
    """The id the start script wrote into ``server.json`` (``PBSTK_JOB_ID``), once the job runs."""
    try:
        data = json.loads(Path(run_dir, "server.json").read_text())
    except (OSError, ValueError):
        return None
    job_id = data.get("job_id") if isinstance(data, dict) else None
    return job_id if isinstance(job_id, str) and JOB_ID_RE.match(job_id) else None
