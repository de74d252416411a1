"""Who launched: a token that tells a live launcher process from a dead one whose pid was reused (the job
store's intents and the service keeper carry one)."""

from __future__ import annotations

import os
from pathlib import Path


def _host() -> str:
    """This machine's name: ``_host()`` is this same uname field, and the socket module is not
    loaded by every command that opens the job store (`pbstk logs -n`)."""
    return os.uname().nodename


def launcher_token(pid: int | None = None) -> str:
    """``host:pid:starttime`` of a process: tells a live launcher from a dead one whose pid was reused."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}:{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def launcher_alive(token: str) -> bool:
    """Whether the process that wrote an intent still runs (unknowable for another host: assume so)."""
    host, _, rest = token.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != _host():
        return True
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return start in ("?", _start_time(pid))
