"""The lease of ``pbstk run`` as status sees it: a job that ended itself because the run stopped renewing it.

``pbstk run`` launches its server with a lease (``--lease``, docs/campaigns.md "The lease") and rewrites
``RUN_DIR/lease`` while COMMAND runs (campaigns/lease.py). The job's watcher (server/start/lease.sh) ends the
job once no renewal came for the lease's length (the run was killed, its machine slept, its SSH connection
dropped): it logs one line, ``pbstk: HH:MM:SS lease lapsed: no renewal from pbstk run for 300s; ...``, drains and
stops vLLM, and the job ends with code 0. ``status`` reads that line from the log it already tails and reports
FINISHED with the reason ``the lease of pbstk run lapsed ...`` (``ended: "lease"`` in JSON).

A run that died without a word (``kill -9``) leaves its COMMAND to the watch beside it (campaigns/command_watch.py),
which ends COMMAND's process group and writes a note on this machine, under the job's id (a service's: its name);
``status`` adds the note to the job's reason (``command_note``), and a service's lapsed lease to its end reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence

from pbs_toolkit.durations import short
from pbs_toolkit.paths import user_state_dir

#: the file the run rewrites and the job watches, in the run directory
LEASE_FILE = "lease"
#: the start script's log line (``pbstk_lease_watch``)
_LINE = re.compile(r"^pbstk: \S+ lease lapsed: no renewal from pbstk run for (\d+)s")
#: how a reason written by :func:`lease_reason` begins
REASON_PREFIX = "the lease of pbstk run lapsed"


def lapsed_after(lines: Sequence[str]) -> int | None:
    """The lease the job's log says lapsed, in seconds, or ``None``: it did not lapse."""
    for line in reversed(lines[-50:]):
        match = _LINE.match(line)
        if match:
            return int(match.group(1))
    return None


def lease_reason(state: str, lines: Sequence[str]) -> str | None:
    """The reason of a FINISHED job ended by its lease (jobs/judge.py puts it in the status), else ``None``."""
    seconds = lapsed_after(lines) if state == "FINISHED" else None
    if seconds is None:
        return None
    return lapsed_reason(seconds, "the job")


def lapsed_reason(seconds: float, who: str) -> str:
    """The reason a lapsed lease gives (``who``: ``the job``, ``the service``): status shows it as it is."""
    return f"{REASON_PREFIX} (no renewal for {short(seconds)}: the run was killed or lost): {who} ended itself"


def ended_how(state: str, reason: str | None) -> str | None:
    """``lease`` for a job ended by its lease (``status --json``'s ``ended``), else ``None``."""
    return "lease" if state == "FINISHED" and (reason or "").startswith(REASON_PREFIX) else None


def command_note_path(key: str) -> str:
    """Where the watch over a run's COMMAND notes that it ended COMMAND because the run was gone: ``key`` is the
    run's job id, or ``service-NAME``."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)
    return str(user_state_dir() / "commands" / f"{safe}.ended")


def fresh_command_note(key: str) -> str:
    """:func:`command_note_path` of ``key`` with an earlier run's note removed; "" (no note) for no key."""
    if not key:
        return ""
    path = command_note_path(key)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return path


def command_note(key: str) -> str | None:
    """The note of the watch over ``key``'s run (``pbstk run (pid N) was gone: its COMMAND ... was ended at
    HH:MM:SS``), or ``None``."""
    try:
        with open(command_note_path(key), encoding="utf-8") as fh:
            when, _, text = fh.read().strip().partition(" ")
        at = time.strftime("%H:%M:%S", time.localtime(float(when)))
    except (OSError, ValueError):
        return None
    return f"{text} at {at}" if text else None
