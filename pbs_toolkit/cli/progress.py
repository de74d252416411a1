"""What a waiting user sees: progress of ``launch --wait``, ``wait``, ``update-endpoint`` and ``tunnel``, and
how to get back to the job after Ctrl-C.

On a terminal (stderr is a tty) the wait is ONE line rewritten in place (``\\r``, padded over the previous text,
cut to the terminal's width so it never wraps) and ticking every second, so a long queue does not look hung;
off a terminal (a log file, CI, a pipe) it is one line per change, as grep and log readers want. No escape
sequence other than the optional colour of the state (``NO_COLOR`` turns it off), so any terminal copes.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import click

from pbs_toolkit.durations import short

#: seconds between redraws of the live line (the elapsed time ticks even when nothing changes)
TICK_S = 1.0
_COLOURS = {"PENDING": "yellow", "STARTING": "cyan", "READY": "green", "FAILED": "red", "LOST": "red",
            "CANCELLED": "magenta", "UNKNOWN": "yellow"}


def estimated_start(epoch: float, now: float | None = None) -> str:
    """``est. start 10:00 (in 45m)``: the scheduler's estimate in local time, and how far off it is."""
    now = time.time() if now is None else now
    when = time.strftime("%H:%M" if abs(epoch - now) < 20 * 3600 else "%a %d %b %H:%M", time.localtime(epoch))
    delta = epoch - now
    return f"est. start {when} ({'in ' + short(delta) if delta >= 0 else short(-delta) + ' ago'})"


def describe(st: Any, now: float | None = None) -> str:
    """The detail after the state: the scheduler's own state and comment while queued (plus its estimated start
    when it gives one), the startup phase while starting, the reason once ended."""
    detail = st.phase or st.comment or st.reason or ""
    if st.state.value == "PENDING":  # the scheduler's own state and explanation
        said = f"({st.record.scheduler.upper()} {st.scheduler_state or '?'})"
        detail = f"{said} {st.comment or st.reason or ''}".rstrip()
        if st.estimated_start is not None:
            detail = f"{detail}; {estimated_start(st.estimated_start, now)}"
    elif st.state.final:
        detail = st.reason or detail
    return detail


class Progress:
    """The ``on_progress`` callback of a wait. Used as a context manager on a terminal it draws the live line
    (and finishes it with a newline at the end, on errors and on Ctrl-C); otherwise it prints a line per change.
    """

    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream
        self.live = False
        self.latest: tuple[Any, float] | None = None  # the last status and the monotonic time the wait began
        self.width = 0  # visible characters of the line now on screen
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker: threading.Thread | None = None

    def _out(self) -> TextIO:
        return self.stream or sys.stderr

    def __enter__(self) -> Progress:
        out = self._out()
        self.live = not self.quiet and _is_tty(out) and os.environ.get("TERM") != "dumb"
        if self.live:
            self.ticker = threading.Thread(target=self._tick, name="pbstk-progress", daemon=True)
            self.ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.ticker is not None:
            self.ticker.join(timeout=2 * TICK_S)
        with self.lock:
            if self.live and self.width:
                self._out().write("\n")  # the last state stays on screen; what follows starts on a new line
                self._out().flush()
            self.width, self.live = 0, False

    def __call__(self, st: Any, elapsed: float) -> None:
        if self.quiet:
            return
        if not self.live:
            click.echo(f"[{elapsed:6.0f}s] {st.state.value:<8} {describe(st)}", err=True)
            return
        with self.lock:
            self.latest = (st, time.monotonic() - elapsed)
            self._draw()

    def _tick(self) -> None:
        while not self.stop.wait(TICK_S):
            with self.lock:
                if self.latest is not None and self.live:
                    self._draw()

    def _draw(self) -> None:
        """Rewrite the line in place (caller holds the lock)."""
        assert self.latest is not None
        st, began = self.latest
        state = st.state.value
        text = f"[{short(time.monotonic() - began):>6}] {state:<8} {describe(st)}"
        columns = shutil.get_terminal_size((80, 24)).columns
        text = text[: max(10, columns - 1)]  # a wrapped line cannot be rewritten with \r
        shown = text
        if state in _COLOURS and "NO_COLOR" not in os.environ and state in text:
            shown = text.replace(state, click.style(state, fg=_COLOURS[state]), 1)
        pad = " " * max(0, self.width - len(text))
        out = self._out()
        out.write(f"\r{shown}{pad}")
        out.flush()
        self.width = len(text)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def interrupt_hint(job_id: str, resume: str | None = None) -> Iterator[None]:
    """Ctrl-C while waiting stops the wait, never the job: say so, and how to come back to it (exit 130).

    ``resume``: the command that picks up where this one stopped (default ``pbstk wait JOB``)."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"pbstk: interrupted; job {job_id} was left as it is (nothing was cancelled). "
                   "Resume waiting, or stop it, with:", err=True)
        click.echo(f"  {resume or 'pbstk wait ' + job_id}", err=True)
        click.echo(f"  pbstk cancel {job_id}", err=True)
        raise click.exceptions.Exit(130) from None


def progress_printer(quiet: bool = False) -> Progress:
    """An ``on_progress`` callback for a wait; ``with`` it to get the live line on a terminal (cli/progress.py)."""
    return Progress(quiet)
