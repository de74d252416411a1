"""Idle reclaim as status sees it: a job whose start script stopped vLLM for lack of requests (``--idle-cancel``).

The watcher lives in the job (server/start/idle.sh ``pbstk_idle_watch``: the head reads its own ``/metrics``), so
it needs no process on the login node and keeps working when the terminal that launched it is closed. When it
stops the server it logs one line, ``pbstk: HH:MM:SS ended idle: no request for 1800s; ...``, and the job ends
with code 0. ``status`` reads that line from the log it already tails and reports FINISHED with the reason
``ended idle after 30m00s without a request`` (``ended: "idle"`` in JSON) instead of "exited normally"; the job's
registry entries go with it the way every ended job's do (at the next ``status``, ``wait``, ``clean`` or keeper
pass: the registry lives where pbstk runs, which the job cannot reach).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pbs_toolkit.durations import short

#: the start script's log line (``pbstk_idle_watch``)
_LINE = re.compile(r"^pbstk: \S+ ended idle: no request for (\d+)s")
#: how a reason written by :func:`idle_reason` begins (also in a final state recorded in the store)
REASON_PREFIX = "ended idle"


def idle_seconds(lines: Sequence[str]) -> int | None:
    """The idle time the job's log says it was stopped after, or ``None``: not stopped idle."""
    for line in reversed(lines[-50:]):
        match = _LINE.match(line)
        if match:
            return int(match.group(1))
    return None


def idle_reason(state: str, lines: Sequence[str]) -> str | None:
    """The reason of a FINISHED job stopped by its idle watcher (jobs/judge.py puts it in the status), else
    ``None``."""
    seconds = idle_seconds(lines) if state == "FINISHED" else None
    return None if seconds is None else f"{REASON_PREFIX} after {short(seconds)} without a request"


def watch_seconds(idle_cancel: str) -> int:
    """A profile's ``idle_cancel`` (flag, env, config.yaml or profile) in whole seconds, the start script's
    ``IDLE_CANCEL_S``; 0: off. A bad one is one ``UsageError``."""
    from pbs_toolkit.durations import parse

    return int(round(parse(idle_cancel, "--idle-cancel", off=True)))


def ended_how(state: str, reason: str | None) -> str | None:
    """``idle`` for a job that ended idle (``status --json``'s ``ended``), else ``None``."""
    return "idle" if state == "FINISHED" and (reason or "").startswith(REASON_PREFIX) else None
