"""COMMAND's processes under ``pbstk run``: each in its own process group, at most ``parallel`` at once, the
signals pbstk receives passed on to every running group, and whatever a command leaves in its group reaped
(docs/campaigns.md "Signals"). One command (``run``) and one per model (``run --each``) go through here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pbs_toolkit.signal_scope import handled_by

#: signals passed on to COMMAND (and, before it runs, turned into a cancel of what was launched)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: how often the supervisor looks at its children (and passes on a signal received meanwhile)
POLL_S = 0.1
#: what is left in a group after its command ended gets SIGTERM, then SIGKILL this much later
REAP_S = 2.0
#: the watch beside each command (a script run by its path: it imports nothing of pbstk)
WATCH = Path(__file__).with_name("command_watch.py")


@dataclass
class Child:
    """One command to run: its argv and environment; ``log``: its stdout and stderr go to this file (and its
    stdin is ``/dev/null``), else it shares pbstk's terminal. ``code``, ``started``, ``ended`` once it ran
    (``code``: the exit status, ``128 + N`` when signal N ended it; ``None``: never started)."""

    argv: list[str]
    env: dict[str, str] = field(repr=False)
    log: Path | None = None
    code: int | None = None
    started: float | None = None
    ended: float | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    #: why it never started (its gate's words), "" when it ran
    why: str = ""
    #: where the watch over it (command_watch.py) writes its note when the run is gone, and what it says ("": none)
    note_file: str = ""
    note: str = ""
    watcher: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    watch_fd: int | None = field(default=None, repr=False)

    @property
    def seconds(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started


#: what a gate says of a child that may not start yet (``run_children``'s ``gate``)
WAIT = "wait"


def run_children(children: Sequence[Child], notice: Callable[[str], None], parallel: int = 1,
                 grace_s: float = 10.0, on_start: Callable[[Child], None] = lambda _c: None,
                 on_end: Callable[[Child], None] = lambda _c: None,
                 gate: Callable[[Child], str | None] = lambda _c: None) -> list[int]:
    """Run ``children`` in order, at most ``parallel`` at once, each in its own process group; returns the
    signals received meanwhile (empty: none). A signal (SIGINT, SIGTERM, SIGHUP) is passed on to every running
    group and starts no further child; ``grace_s`` after the first, the groups still running are killed.

    ``gate``, asked before a child starts (and again on each look while it says :data:`WAIT`): ``None``, it
    starts; ``WAIT``, it waits (in order with ``parallel`` 1; beside it the others may start); any other text, it
    never starts and ends with code 1 (``Child.why`` holds the text)."""
    waiting, running = list(children), list[Child]()
    received: list[int] = []
    leftovers: dict[int, float] = {}  # process groups whose command ended: the deadline of their SIGKILL
    sent, killed, first_at = 0, False, 0.0
    with handled_by(lambda signum, _frame: received.append(signum), SIGNALS), ExitStack() as logs:
        while (waiting and not received) or running or leftovers:
            for signum in received[sent:]:  # pass on what arrived since the last look, to every group
                first_at = first_at or time.monotonic()
                for child in running:
                    _signal_group(child, signum)
            sent = len(received)
            if not received:
                _start_ready(waiting, running, parallel, gate, lambda c: _spawn(c, logs, notice, grace_s), on_start,
                             on_end)
            for child in [c for c in running if c.proc is not None and c.proc.poll() is not None]:
                assert child.proc is not None and child.proc.returncode is not None
                rc, child.ended = child.proc.returncode, time.monotonic()
                child.code = 128 - rc if rc < 0 else rc
                running.remove(child)
                _unwatch(child)
                if _signal_group(child, signal.SIGTERM):  # what it left in its group: TERM now, KILL later
                    leftovers[child.proc.pid] = time.monotonic() + REAP_S
                on_end(child)
            if received and running and not killed and time.monotonic() - first_at > grace_s:
                notice(f"COMMAND did not end {grace_s:g} s after {signal.Signals(received[0]).name}: killing it")
                for child in running:
                    _signal_group(child, signal.SIGKILL)
                killed = True
            _reap(leftovers)
            if (waiting and not received) or running or leftovers:
                time.sleep(POLL_S)
    return received


def _start_ready(waiting: list[Child], running: list[Child], parallel: int, gate: Callable[[Child], str | None],
                 spawn: Callable[[Child], bool], on_start: Callable[[Child], None],
                 on_end: Callable[[Child], None]) -> None:
    """Start waiting children while fewer than ``parallel`` run, each once its gate lets it (``run_children``)."""
    for child in list(waiting):
        if len(running) >= parallel:
            return
        said = gate(child)
        if said == WAIT:
            if parallel == 1:
                return  # one at a time: in order
            continue
        waiting.remove(child)
        if said is not None:  # it never will: ended, with the gate's words
            child.code, child.why, child.started = 1, said, time.monotonic()
            child.ended = child.started
            on_end(child)
            continue
        on_start(child)
        if spawn(child):
            running.append(child)
        else:
            on_end(child)


def _spawn(child: Child, logs: ExitStack, notice: Callable[[str], None], grace_s: float) -> bool:
    """Start the child; ``False`` when it could not start (its ``code`` is then 126, as a shell says of a file
    it cannot execute: a script without ``#!``, a binary of another machine), so that the others still run."""
    out: Any = None
    child.started = time.monotonic()
    try:
        if child.log is not None:
            child.log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            out = logs.enter_context(open(os.open(child.log, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb"))
        child.proc = subprocess.Popen(child.argv, env=child.env, process_group=0,  # noqa: S603 - argv, no shell
                                      stdin=subprocess.DEVNULL if out is not None else None, stdout=out,
                                      stderr=subprocess.STDOUT if out is not None else None)
    except OSError as exc:
        notice(f"warning: {child.argv[0]} could not be started: {exc.strerror or exc}")
        child.code, child.ended = 126, time.monotonic()
        return False
    _watch(child, grace_s)
    return True


def _watch(child: Child, grace_s: float) -> None:
    """Start the watch over the child (command_watch.py) in its process group: should this process die without
    a word (kill -9, the OOM killer), the watch ends the group. The write end of its pipe is this process's alone
    (not inheritable): the kernel closes it when this process ends, however it ends."""
    assert child.proc is not None
    read_end, write_end = os.pipe()
    try:
        child.watcher = subprocess.Popen(  # noqa: S603 - argv, no shell
            [sys.executable, str(WATCH), f"{grace_s:g}", child.note_file, child.note], stdin=read_end,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=child.proc.pid)
    except (OSError, subprocess.SubprocessError):  # COMMAND already ended (its group is gone): nothing to watch
        os.close(write_end)
        return
    finally:
        os.close(read_end)
    child.watch_fd = write_end


def _unwatch(child: Child) -> None:
    """COMMAND ended: its watch leaves without a word."""
    if child.watch_fd is not None:
        with suppress(OSError):
            os.write(child.watch_fd, b"x")
        os.close(child.watch_fd)
        child.watch_fd = None
    if child.watcher is not None:
        with suppress(subprocess.TimeoutExpired):
            child.watcher.wait(5)


def _signal_group(child: Child, signum: int) -> bool:
    """Send ``signum`` to the child's process group; ``False`` when the group is gone."""
    if child.proc is None:
        return False
    try:
        os.killpg(child.proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _reap(leftovers: dict[int, float]) -> None:
    """Forget the groups that are empty now; SIGKILL those still there past their deadline."""
    for pgid, deadline in list(leftovers.items()):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            del leftovers[pgid]
            continue
        if time.monotonic() >= deadline:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            del leftovers[pgid]


def run_command(command: Sequence[str], env: dict[str, str], notice: Callable[[str], None],
                grace_s: float = 10.0, watch: tuple[str, str] = ("", "")) -> int:
    """Run ``command`` in its own process group and return its exit status (``128 + N`` for signal N).
    Signals meanwhile are passed on to the group; ``grace_s`` after the first, the group is killed. Whatever
    the command left running in its group when it ended is stopped too, and so is the group should this process
    die without a word (``watch``: the watch's note file and text)."""
    child = Child(list(command), env, note_file=watch[0], note=watch[1])
    run_children([child], notice, 1, grace_s)
    assert child.code is not None
    return child.code
