"""The lease of ``pbstk run`` (docs/campaigns.md "The lease"): the server a run launched ends itself soon after
the run is gone.

A run's job is rendered with ``LEASE_S`` (``--lease``, default 5m; ``PBSTK_RUN_LEASE``); from the launch until its
end (the wait, COMMAND, the drain, the cancel) the run rewrites the job's ``RUN_DIR/lease`` through its runner (this
machine, or the login node over SSH: the shared filesystem carries it to the node) every ``lease / 5`` seconds
(between 0.5 s and 60 s), a new content each time. The job's watcher (server/start/lease.sh) compares that
content by its own clock, so no two machines' clocks are compared; once it has not changed for the lease's
length (``kill -9`` of the run, a laptop that sleeps, an SSH connection that dropped) the job drains and ends,
and ``status`` says so (jobs/lease.py). A service's lease (``--replicas N``) is a ``lease`` file in its
directory on this machine, which its keeper watches instead (services/lease.py). ``--keep`` and ``--reuse`` have
no lease.
"""

from __future__ import annotations

import math
import os
import posixpath
import threading
import time
from collections.abc import Callable, Sequence

from pbs_toolkit.durations import parse
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.jobs.lease import LEASE_FILE
from pbs_toolkit.transports.base import Runner

#: the lease when neither ``--lease`` nor ``PBSTK_RUN_LEASE`` says one
DEFAULT_LEASE = "5m"
ENV = "PBSTK_RUN_LEASE"


def lease_seconds(text: str | None) -> int:
    """``--lease`` (else ``PBSTK_RUN_LEASE``, else 5m) in whole seconds, rounded up; 0: ``off``. A bad one is one
    ``UsageError`` naming where it came from."""
    what = "--lease" if text is not None else ENV
    raw = text if text is not None else (os.environ.get(ENV) or DEFAULT_LEASE)
    return int(math.ceil(parse(raw, what, off=True)))


def run_lease(text: str | None, *, keep: bool) -> int:
    """The lease of the job or service a run launches, in seconds (:func:`lease_seconds`): none for a ``--keep``
    server, which is meant to outlive the run (``--keep --lease D`` is one ``UsageError``). A service's lease is
    its keeper's to watch (services/lease.py), its replicas get none of their own (services/manage.py)."""
    if keep:
        if text is not None and lease_seconds(text):
            raise UsageError("--lease is not for a --keep server: it stays up")
        return 0
    return lease_seconds(text)


def renewal_interval(lease_s: float) -> float:
    """Seconds between two renewals: five in every lease, at least 0.5 s apart and at most 60 s."""
    return min(60.0, max(0.5, lease_s / 5))


class Renewal:
    """Rewrites ``RUN_DIR/lease`` of each ``(runner, run_dir)`` from :meth:`start` until :meth:`stop`, in a daemon
    thread. A failed write is one notice (the first of a series) and is tried again next time: the job only ends
    when renewals fail for the whole lease."""

    def __init__(self, notice: Callable[[str], None] = lambda _m: None) -> None:
        self._notice = notice
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.renewals = 0

    def start(self, targets: Sequence[tuple[Runner, str]], lease_s: int) -> None:
        """Renew now, then every :func:`renewal_interval` seconds; nothing with no target or ``lease_s`` 0."""
        if not targets or lease_s <= 0:
            return
        items = list(targets)
        self.renew(items)
        self._thread = threading.Thread(target=self._loop, args=(items, renewal_interval(lease_s)),
                                        name="pbstk-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more renewals (the run has ended; its end cancels the job itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self, targets: list[tuple[Runner, str]], interval: float) -> None:
        while not self._stop.wait(interval):
            self.renew(targets)

    def renew(self, targets: Sequence[tuple[Runner, str]]) -> None:
        """One renewal of every target: a content no earlier renewal wrote (a counter and this clock)."""
        self.renewals += 1
        data = f"{self.renewals} {time.time():.3f} pid {os.getpid()}\n".encode()
        for runner, run_dir in targets:
            try:
                runner.write_bytes(posixpath.join(run_dir, LEASE_FILE), data)
            except (OSError, PbstkError) as exc:
                if not self._failing:
                    self._notice(f"warning: the lease in {run_dir} was not renewed ({exc}); retrying; the job ends "
                                 "itself if renewals fail for the whole lease")
                self._failing = True
                continue
            self._failing = False
