"""The watch over one COMMAND of ``pbstk run``: COMMAND does not outlive the run (docs/campaigns.md "Signals").

``pbstk run`` passes its signals on to COMMAND's process group; a ``kill -9`` of the run, or an OOM kill, leaves
no one to do that. So beside each COMMAND the run starts this small process, in COMMAND's own process group, with
the read end of a pipe whose write end only the run holds. When COMMAND ends, the run writes one byte and this
process leaves without a word. When the run is gone, however it went, the kernel closes the write end: this
process reads end-of-file, sends SIGTERM to the whole group, SIGKILL to what is left after the grace, and writes
a note that ``pbstk status`` shows (jobs/lease.py ``command_note``).

Standard library only, run by its path (``python command_watch.py GRACE NOTE_FILE NOTE_TEXT``): it imports no
part of pbstk, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def others(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` but this one (a zombie is gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(entry))
    return found


def end_group(grace: float) -> None:
    """SIGTERM to every other process of this group, SIGKILL to those left ``grace`` seconds later."""
    pgid = os.getpgrp()
    for pid in others(pgid):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    until = time.monotonic() + grace
    while others(pgid) and time.monotonic() < until:
        time.sleep(0.2)
    for pid in others(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    grace, note_file, note = float(argv[1]), argv[2], argv[3]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the group's signals are COMMAND's, not ours
        signal.signal(signum, signal.SIG_IGN)
    try:
        said = os.read(0, 1)
    except OSError:
        said = b""
    if said:  # the run says COMMAND ended: nothing to do
        return 0
    end_group(grace)
    if note_file:
        try:
            os.makedirs(os.path.dirname(note_file), mode=0o700, exist_ok=True)
            with open(note_file + ".tmp", "w") as fh:
                fh.write(f"{time.time():.0f} {note}\n")
            os.replace(note_file + ".tmp", note_file)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
