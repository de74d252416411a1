"""Where a start's seconds went: queued, setup, stage-copy, compile wait, imports, weights, compile, graphs, API up,
verified READY (docs/coldstart.md "Start-up phases").

Three clocks meet here. The store knows when pbstk submitted the job; the start script appends ``EVENT EPOCH
MM-DD HH:MM:SS`` lines to ``RUN_DIR/startup.log`` (``job``, ``setup``, ``stage``/``staged``,
``compile-wait``/``compile-wait-end``, ``vllm`` at each attempt, ``api`` once the port accepts); vLLM's own log
lines carry the node's local time without a year or zone, which the marks' local time next to their epoch places.
At ``api`` the script copies the attempt's start-up lines into the same file (``log LINE``), so the breakdown
survives the log tail moving on. Pure functions: :mod:`pbs_toolkit.jobs.status` reads the file and calls them.

A phase the evidence does not show is ``None`` and its time counts in the next phase that is shown (an eager start
has no compile; a log without timestamps leaves imports..graphs to ``api_up``).
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.vllm.logline import split_log_line

#: the phases in start-up order (keys of ``startup["phases"]``)
PHASES = ("queued", "setup", "stage_copy", "compile_wait", "imports", "weights", "compile", "graphs", "api_up",
          "verified_ready")
#: record.extra keys: when pbstk first proved the server is the job's own, and the breakdown frozen then
READY_AT_KEY = "ready_verified_at"
STARTUP_KEY = "startup"
#: vLLM log points outside the attempt's marks by more than this (seconds) are some other clock's: ignored
_SLACK_S = 5.0
_EPOCH = re.compile(r"\d{1,12}(?:\.\d{1,9})?")
_WEIGHTS_END = ("Model loading took", "Loading weights took", "Loading model weights took")
_WEIGHTS_START = ("Starting to load model", "Loading safetensors checkpoint shards", "Loading model", "Loading weights")
_COMPILE_END = ("torch.compile takes", "torch.compile took")  # 0.11 / 0.22 wording
_GRAPHS_END = ("init engine (profile, create kv cache, warmup model) took", "Graph capturing finished")


@dataclass
class Timeline:
    """``startup.log`` parsed: the first ``job`` mark, the last of every other event, the copied vLLM lines."""

    marks: dict[str, float] = field(default_factory=dict)
    #: epoch seconds minus the node's local wall time read as UTC (the node's zone offset); ``None``: no mark
    offset: float | None = None
    year: int | None = None
    log_lines: list[str] = field(default_factory=list)


def parse_timeline(text: str) -> Timeline:
    """``startup.log`` -> :class:`Timeline`; malformed lines are skipped (the file is the job's, not trusted)."""
    tl = Timeline()
    for line in text.splitlines():
        if line.startswith("log "):
            tl.log_lines.append(line[4:])
            continue
        parts = line.split()
        if len(parts) != 4 or not _EPOCH.fullmatch(parts[1]):
            continue
        event, epoch = parts[0], float(parts[1])
        if event != "job" or "job" not in tl.marks:
            tl.marks[event] = epoch
        if tl.offset is None:
            year = time.gmtime(epoch).tm_year
            local = _local_seconds(f"{parts[2]} {parts[3]}", year)
            if local is not None:
                # zones are whole quarter hours: the rounding drops the mark's sub-second part and clock jitter
                tl.offset, tl.year = round((epoch - local) / 900) * 900.0, year
    return tl


def _local_seconds(stamp: str, year: int) -> float | None:
    """``MM-DD HH:MM:SS[.fff]`` of ``year`` as if it were UTC, in epoch seconds."""
    try:
        parsed = time.strptime(f"{year}-{stamp.split('.')[0]}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return float(calendar.timegm(parsed))


def _log_points(lines: Iterable[str], tl: Timeline) -> dict[str, float]:
    """Epoch times of the first weights line and the last weights-loaded, compiled and engine-ready lines."""
    points: dict[str, float] = {}
    if tl.offset is None or tl.year is None:
        return points
    for line in lines:
        parsed = split_log_line(line)
        if not parsed.time:
            continue
        local = _local_seconds(parsed.time, tl.year)
        if local is None:
            continue
        at = local + tl.offset
        message = parsed.message
        if any(m in message for m in _WEIGHTS_END):
            points["weights_end"] = at
        elif any(m in message for m in _WEIGHTS_START):
            points.setdefault("weights_start", at)
        elif any(m in message for m in _COMPILE_END):
            points["compile_end"] = at
        elif any(m in message for m in _GRAPHS_END):
            points["graphs_end"] = at
    return points


def _vllm_chain(points: dict[str, float], vllm: float, end: float, eager: bool) -> list[tuple[str, float]]:
    """(phase, start) pairs from vLLM's start to its last line seen: imports, weights, compile, graphs, api_up.

    The phase after the weights is ``compile`` only when a compile line follows (or, still under way, when the
    start is not eager); otherwise memory profiling, KV cache and graphs are ``graphs``."""
    chain = [("imports", vllm)]
    compiled = "compile_end" in points
    for key, name in (("weights_start", "weights"), ("weights_end", "compile" if compiled else "graphs"),
                      ("compile_end", "graphs"), ("graphs_end", "api_up")):
        at = points.get(key)
        if at is not None and vllm - _SLACK_S <= at <= end + _SLACK_S and at >= chain[-1][1]:
            chain.append((name, at))
    if chain[-1][0] == "graphs" and not compiled and not eager and "graphs_end" not in points:
        chain[-1] = ("compile", chain[-1][1])  # weights loaded, nothing after yet: a compile is coming
    return chain


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(max(0.0, seconds), 1)


def breakdown(submitted: float | None, tl: Timeline, log_lines: Sequence[str] = (), *, verified_at: float | None = None,
              now: float | None = None, eager: bool = False, pending: bool = False) -> dict[str, Any]:
    """The ``startup`` object of ``status --json``: ``phases`` (seconds or ``None``, in :data:`PHASES` order),
    ``current`` (the phase under way and ``current_s`` so far; ``None`` once verified READY), ``longest`` and
    ``longest_s`` (of the finished phases), ``total_s`` (submit to verified READY, or so far).

    ``log_lines``: the live log's current attempt, used while the script has not copied its lines yet;
    ``pending``: the scheduler still queues the job."""
    now = time.time() if now is None else now
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    marks = tl.marks
    current: str | None = None
    since: float | None = None
    job = marks.get("job")
    if pending or job is None:
        return _finish(phases, "queued" if submitted is not None else None, submitted, now, submitted, None)
    if submitted is not None:
        phases["queued"] = job - submitted
    for start, end, name in (("stage", "staged", "stage_copy"), ("compile-wait", "compile-wait-end", "compile_wait")):
        if start in marks:
            phases[name] = (marks[end] - marks[start]) if end in marks else None
            if end not in marks:
                current, since = name, marks[start]
    vllm = marks.get("vllm")
    if vllm is not None:
        phases["setup"] = vllm - job - (phases["stage_copy"] or 0) - (phases["compile_wait"] or 0)
        points = _log_points(tl.log_lines or log_lines, tl)
        chain = _vllm_chain(points, vllm, marks.get("api") or now, eager)
        for (name, start_at), (_, end_at) in zip(chain, chain[1:]):
            phases[name] = end_at - start_at
        last_name, last_at = chain[-1]
        if "api" in marks:
            # without any vLLM line to split it, the whole vLLM start is "api_up"
            phases["api_up" if len(chain) == 1 else last_name] = marks["api"] - last_at
            if verified_at is not None:
                phases["verified_ready"] = verified_at - marks["api"]
            else:
                current, since = "verified_ready", marks["api"]
        elif current is None:
            current, since = last_name, last_at
    elif current is None:
        current, since = "setup", job
    return _finish(phases, current, since, now, submitted, verified_at)


def _finish(phases: dict[str, float | None], current: str | None, since: float | None, now: float,
            submitted: float | None, verified_at: float | None) -> dict[str, Any]:
    rounded = {name: _round(value) for name, value in phases.items()}
    done = [(value, name) for name, value in rounded.items() if value is not None and name != current]
    longest = max(done) if done else None
    end = verified_at if current is None and verified_at is not None else now
    return {
        "phases": rounded,
        "current": current,
        "current_s": _round(now - since) if current is not None and since is not None else None,
        "longest": longest[1] if longest else None,
        "longest_s": longest[0] if longest else None,
        "total_s": _round(end - submitted) if submitted is not None else None,
    }


def startup_text(startup: dict[str, Any] | None) -> str | None:
    """The human status' words while STARTING: ``weights 41 s so far`` and, when a finished phase took
    longer, ``; longest: compile 62 s``."""
    if not startup or not startup.get("current"):
        return None
    current, so_far = str(startup["current"]).replace("_", " "), startup.get("current_s")
    text = f"{current} {so_far:.0f} s so far" if so_far is not None else current
    longest, longest_s = startup.get("longest"), startup.get("longest_s")
    if longest and longest_s is not None and (so_far is None or longest_s > so_far):
        text += f"; longest: {str(longest).replace('_', ' ')} {longest_s:.0f} s"
    return text


def ready_seconds(startup: dict[str, Any] | None) -> float | None:
    """Seconds from the job's start (queue time excluded) to verified READY, for ``tune``'s ready-s column."""
    if not startup or startup.get("current") is not None:
        return None
    phases = startup.get("phases") or {}
    values = [v for k, v in phases.items() if k != "queued" and isinstance(v, (int, float))]
    return round(sum(values), 1) if values else None


def job_startup(record: Any, state: ServerState, text: str | None, attempt_lines: Sequence[str], *, eager: bool = False,
                now: float | None = None) -> dict[str, Any] | None:
    """The breakdown ``status`` shows for a job in ``state``: frozen in the record once
    READY was verified, live while PENDING or STARTING, ``None`` when nothing tells (a script without marks).

    ``text``: ``startup.log`` (``None`` when absent); ``attempt_lines``: the live log's current attempt."""
    frozen = record.extra.get(STARTUP_KEY)
    if isinstance(frozen, dict):
        return frozen
    now = time.time() if now is None else now
    if state is ServerState.PENDING:
        return breakdown(record.created, Timeline(), now=now, pending=True)
    if text is None or state not in (ServerState.STARTING, ServerState.READY):
        return None
    tl = parse_timeline(text)
    if "job" not in tl.marks:
        return None
    verified_at = None
    if state is ServerState.READY:
        verified_at = float(record.extra.get(READY_AT_KEY) or now)
        tl.marks.setdefault("api", verified_at)  # the script notices the port up to a second after pbstk
    return breakdown(record.created, tl, attempt_lines, verified_at=verified_at, now=now, eager=eager)


def to_freeze(state: ServerState, startup: dict[str, Any] | None, record: Any) -> dict[str, Any]:
    """The record.extra values to save now: the breakdown of a job just verified READY (once)."""
    if (state is not ServerState.READY or not startup or startup.get("current") is not None
            or STARTUP_KEY in record.extra):
        return {}
    return {STARTUP_KEY: startup, READY_AT_KEY: record.extra.get(READY_AT_KEY) or time.time()}
