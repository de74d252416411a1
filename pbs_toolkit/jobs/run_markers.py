"""What a launch leaves in its run directory (``job_id``, ``pbstk-job.json``, ``.submitting``) read back, and
``run_dirs.log``, the list of local run directories a lost job store is rebuilt from."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from pbs_toolkit.errors import StoreError
from pbs_toolkit.jobs.records import (
    COLUMNS,
    INTENT_GRACE_S,
    JOB_ID_MARKER,
    JOB_ID_RE,
    RECORD_MARKER,
    SUBMITTING_MARKER,
    Intent,
    JobRecord,
    row_to_record,
)


def read_job_id_marker(run_dir: str) -> str | None:
    """The job id the submission left in ``RUN_DIR/job_id`` (local paths only), if it is a valid id."""
    try:
        text = Path(run_dir, JOB_ID_MARKER).read_text(errors="replace").strip()
    except OSError:
        return None
    return text if JOB_ID_RE.match(text) else None


def nothing_submitted_here(intent: Intent) -> bool:
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
        record, _ = row_to_record({k: data.get(k) for k in COLUMNS})
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


def logged_run_dirs(state_dir: Path) -> list[str]:
    try:
        text = (state_dir / "run_dirs.log").read_bytes().decode("utf-8", "replace")
    except OSError:
        return []
    return list(dict.fromkeys(line for line in text.splitlines() if line.startswith("/")))
