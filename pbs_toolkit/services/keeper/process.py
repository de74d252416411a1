"""The detached keeper process of a service: its directory, starting it, whether it runs, stopping it, and
the heartbeat it leaves for ``status`` (the keeper's ticks themselves: services/keeper/loop.py)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.services import record as records

#: the keeper's heartbeat in its service directory (``heartbeat``)
TICK_FILE = "keeper-tick.json"


def service_dir(name: str) -> Path:
    """``$XDG_STATE_HOME/pbstk/services/NAME``: the keeper's lock, pid file and log, a local router's files."""
    return paths.user_state_dir() / "services" / name


def poll_seconds() -> float:
    """``PBSTK_SERVICE_POLL_S``: seconds between two looks of the keeper (default 15)."""
    return env_float("PBSTK_SERVICE_POLL_S", 15.0, lambda v: 0.1 <= v <= 3600)


def spawn_keeper(name: str, wait_s: float = 10.0) -> int:
    """``python -m pbs_toolkit _keeper NAME`` in its own session, logging to the service dir; its pid once it
    holds its lock (so ``status`` right after never says it is not running)."""
    import subprocess

    directory = service_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(directory / "keeper.log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "_keeper", name],  # noqa: S603
                                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                                close_fds=True)
    finally:
        os.close(fd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if keeper_alive(name):
            return proc.pid
        if proc.poll() is not None:
            raise PbstkError(f"the keeper of service {name} exited at once; see {directory / 'keeper.log'}")
        time.sleep(0.05)
    raise PbstkError(f"the keeper of service {name} did not start; see {directory / 'keeper.log'}")


#: the keeper holds this file of its service's directory locked while it runs: one keeper per service
KEEPER_LOCK = "keeper.lock"


def _try_lock(path: Path, create: bool) -> int | None:
    """An exclusive ``flock`` on ``path`` without waiting: the open descriptor holding it (closing it drops the
    lock), or ``None`` when another process holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600) if create else os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def hold_keeper_lock(name: str) -> int | None:
    """Take the service's keeper lock for this process's life: its descriptor, or ``None`` (another keeper)."""
    directory = service_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return _try_lock(directory / KEEPER_LOCK, create=True)


def keeper_alive(name: str) -> bool:
    """Whether a keeper holds the service's lock (a lock, not a pid: a reused pid can never look alive)."""
    path = service_dir(name) / KEEPER_LOCK
    if not path.exists():
        return False
    fd = _try_lock(path, create=False)
    if fd is None:
        return True
    os.close(fd)  # closing drops the lock taken here
    return False


def stop_keeper(name: str, timeout: float) -> None:
    """Wait for the keeper to see the service ended; then SIGTERM it (only the process holding our token)."""
    import json

    from pbs_toolkit.jobs.store import launcher_alive

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not keeper_alive(name):
            return
        time.sleep(0.1)
    try:
        info = json.loads((service_dir(name) / "keeper.json").read_text())
        if int(info["pid"]) != os.getpid() and launcher_alive(info["token"]):  # the keeper's own teardown: idle
            os.kill(int(info["pid"]), signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pass


def heartbeat(name: str, error: str | None) -> None:
    """``keeper-tick.json``: when the last tick succeeded, and the last failure since (``status`` shows a keeper
    that runs but makes no progress). Written atomically; a full disk only costs the note."""
    path = service_dir(name) / TICK_FILE
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    now = time.time()
    body = {"ok_at": now, "error": None, "error_at": None, "failures": 0} if error is None else {
        "ok_at": old.get("ok_at"), "error": error, "error_at": now, "failures": int(old.get("failures") or 0) + 1}
    tmp = path.with_name(f".{TICK_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
    except OSError:
        pass


def last_tick(name: str) -> dict[str, Any]:
    """What the keeper's ``heartbeat`` last wrote (``ok_at``, ``error``, ``error_at``, ``failures``); ``{}``
    before its first tick."""
    try:
        data = json.loads((service_dir(name) / TICK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resume(store: Any, name: str) -> int:
    """Start the service's keeper again (after a reboot, a kill); its pid, 0 when one runs already."""
    rec = records.find(store, name)
    if rec.ended is not None:
        hint = f"`pbstk cancel {name}` finishes stopping it" if rec.active else "start a new one with `pbstk serve`"
        raise UsageError(f"service {name} has ended ({rec.state}); {hint}")
    if keeper_alive(name):
        return 0
    return spawn_keeper(name)


def keeper_log(message: str) -> None:
    """One timestamped line of the keeper's log (its stderr is ``keeper.log`` in the service's directory)."""
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    sys.stderr.flush()
