"""The restart policy of a service's replicas: a replica whose job ends (vLLM crash, OOM, node failure, a killed
job, its walltime without keep-alive) is replaced, after a backoff, at most ``max_restarts`` times in a window;
then its slot is no longer restarted and the service says why (DEGRADED, or DOWN with none left).

Pure: the keeper (services/keeper/slots.py ``_replace``) asks ``judge`` once per tick for a slot whose job ended and
launches the replacement itself; ``status`` reads what the slot keeps (``restarts``, ``last_failure``,
``gave_up``). A scale-down retirement and a keep-alive handover never come here: they are no failure.
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pbs_toolkit.durations import parse, short
from pbs_toolkit.errors import UsageError

if TYPE_CHECKING:
    from pbs_toolkit.jobs.status_types import JobStatus
    from pbs_toolkit.services.record import ServiceRecord, Slot

#: ``--max-restarts``, profile key ``max_restarts``: replacements of one replica within the window
DEFAULT_MAX_RESTARTS = 3
#: ``--restart-window``, profile key ``restart_window``
DEFAULT_WINDOW = "30m"
#: ``--restart-backoff``, profile key ``restart_backoff``: the wait before a slot's first restart in the window,
#: doubled for each restart already in it
DEFAULT_BACKOFF = "10s"
#: the longest wait between two restarts, however many came before
MAX_BACKOFF_S = 300.0
#: a failure's cause is kept (and shown) in at most this many characters
CAUSE_CHARS = 300

RESTART = "restart"
WAIT = "wait"
STOP = "stop"
#: the first words of the start script's failure when another process holds the GPU memory a replica needs
#: (server/start/gpu_free.sh GPU_HELD_WORDS): no fault of the replica, so no restart is spent on it; the slot
#: tries again after its backoff, and its last failure names the holder (pid, command, memory)
GPU_HELD = "GPU memory is held by another process"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS
    window_s: float = 1800.0
    backoff_s: float = 10.0

    def delay(self, recent: int) -> float:
        """Seconds to wait before a restart when ``recent`` restarts are already in the window."""
        return min(max(MAX_BACKOFF_S, self.backoff_s), self.backoff_s * 2 ** min(recent, 30))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RestartPolicy:
        """The record's policy; an older record (none kept) gets the defaults."""
        return cls(**data) if data else cls()

    @property
    def text(self) -> str:
        """``3 restarts in 30m00s, backoff 10s doubling``"""
        return f"{self.max_restarts} restarts in {short(self.window_s)}, backoff {short(self.backoff_s)} doubling"


def policy(max_restarts: object, window: object, backoff: object) -> RestartPolicy:
    """A policy from the options' or the profile's values (``window`` and ``backoff``: durations like ``30m``);
    one ``UsageError`` naming the option for a bad value."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= 1000:
        raise UsageError(f"--max-restarts {max_restarts!r}: a whole number from 0 (never restart) to 1000")
    return RestartPolicy(max_restarts, parse(window, "--restart-window"), parse(backoff, "--restart-backoff"))


def failure_cause(job: str, st: JobStatus | None) -> str:
    """One line: the failed job, its state and why (the status's reason, with its log's last line unless either
    holds the other, else its exit status), at most ``CAUSE_CHARS``, cut at a word ("...") so that no number is
    cut short into another."""
    if st is None:
        return f"{job} is not in the job store (lost)"
    why = st.reason or ""
    excerpt = [line.strip() for line in st.log_excerpt if line.strip()]
    if excerpt and excerpt[-1] not in why and not (why and why in excerpt[-1]):
        why = f"{why}; log: {excerpt[-1]}" if why else excerpt[-1]
    if not why and st.exit_status is not None:
        why = f"exit status {st.exit_status}"
    text = f"{job} {st.state.value}: {why or 'no reason recorded'}"
    return textwrap.shorten(text, CAUSE_CHARS, placeholder="...")


def judge(pol: RestartPolicy, slot: Slot, job: str, cause: str, now: float | None = None) -> str:
    """What the slot whose job ``job`` ended does now: ``RESTART``, ``WAIT`` (its backoff: ``slot.retry_at``) or
    ``STOP`` (``slot.gave_up`` says why). The failure is noted once, on the first look that saw it ended."""
    now = time.time() if now is None else now
    if slot.gave_up:
        return STOP
    if slot.failed_job != job:  # first seen: note it, then wait out the backoff (or give up)
        slot.failed_job, slot.last_failure = job, cause
        if GPU_HELD in cause:  # the GPU is another process's: wait for it, spending no restart
            slot.retry_at = now + min(MAX_BACKOFF_S, pol.backoff_s * 2 ** min(slot.held_waits, 30))
            return WAIT
        slot.restart_times = [t for t in slot.restart_times if now - t < pol.window_s]
        if len(slot.restart_times) >= pol.max_restarts:
            slot.retry_at = None
            slot.gave_up = (f"not restarted after {len(slot.restart_times)} restart(s) in {short(pol.window_s)} "
                            f"(--max-restarts {pol.max_restarts}); last failure: {cause}")
            return STOP
        slot.retry_at = now + pol.delay(len(slot.restart_times))
    return RESTART if slot.retry_at is None or now >= slot.retry_at else WAIT


def restarted(slot: Slot, now: float | None = None) -> None:
    """The replacement was launched: one more restart in the window (a replacement that only waited for GPU
    memory another process held: one more such wait, no restart)."""
    if GPU_HELD in slot.last_failure:
        slot.held_waits += 1
        slot.retry_at = None
        return
    slot.held_waits = 0
    slot.restarts += 1
    slot.restart_times.append(time.time() if now is None else now)
    slot.retry_at = None


def next_due(rec: ServiceRecord) -> float | None:
    """When the first replacement waiting out its backoff may start (``None``: none waits)."""
    due = [s.retry_at for s in rec.slots
           if s.retry_at is not None and s.current == s.failed_job and not s.gave_up and not s.retiring]
    return min(due) if due else None


def stopped_slots(rec: ServiceRecord) -> list[Slot]:
    """The slots (not being retired) that are no longer restarted."""
    return [s for s in rec.slots if s.gave_up and not s.retiring]


def may_heal(rec: ServiceRecord) -> bool:
    """Whether some slot (not being retired) may still get a replacement."""
    return any(not s.gave_up for s in rec.slots if not s.retiring)


def reason(rec: ServiceRecord) -> str | None:
    """Why the service is short of replicas for good, in one line (``None``: nothing stopped)."""
    stopped = stopped_slots(rec)
    if not stopped:
        return None
    first = stopped[0]
    more = f" (and {len(stopped) - 1} more replica(s))" if len(stopped) > 1 else ""
    return f"replica r{first.index} {first.gave_up}{more}"


def slot_text(slot: Slot) -> str:
    """``restarts 2, last: JOB FAILED: ...`` for ``status NAME``'s restarts line (``""``: nothing to say)."""
    if not slot.restarts and not slot.last_failure:
        return ""
    parts = [f"r{slot.index}: {slot.restarts} restart(s)"]
    if slot.gave_up:
        parts.append("no more (limit reached)")
    elif slot.retry_at:
        parts.append(f"next at {time.strftime('%H:%M:%S', time.localtime(slot.retry_at))}")
    if slot.last_failure:
        parts.append(f"last failure: {slot.last_failure}")
    return ", ".join(parts)
