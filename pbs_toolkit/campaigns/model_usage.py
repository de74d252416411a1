"""``pbstk usage`` per model of a multi-model service (docs/multi-model.md "Per model"): each job's GPU time
split among the models placed on each of its GPUs.

The rule (``split``, pure): on each GPU, each moment's GPU time goes to the models **awake** on it, in
proportion to their memory share (``gpu_memory_utilization``); when none is awake, evenly to the models placed
there (they still hold it). A model is awake from its ``awake`` event to its ``asleep`` one in
``RUN_DIR/models.events.jsonl`` (one JSON object a line: ``{"t": <unix time>, "model": <served name>,
"event": "awake" | "asleep"}``, written by the job when a model first listens and at each change, with vLLM's
sleep mode); before its first event it is not awake yet. Without that file every model is awake for the whole
job. Models without GPUs (a CPU profile) share the node as one device.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.transports import Runner

#: the file a multi-model job writes its models' awake/asleep changes to (docs/multi-model.md)
EVENTS_FILE = "models.events.jsonl"
#: more than this is not read (a runaway writer must not make ``usage`` read gigabytes over SFTP)
MAX_EVENTS_BYTES = 16 * 1024 * 1024
_CPU = -1  # the one device of models without GPUs


class UsageRow(Protocol):
    """What is read of a job's usage row (campaigns/usage.py ``UsageRow``)."""

    name: str
    ended: bool
    walltime_s: float | None

    @property
    def node_hours(self) -> float | None: ...
    @property
    def gpu_hours(self) -> float | None: ...


@dataclass(frozen=True)
class Event:
    t: float
    model: str
    awake: bool


@dataclass(frozen=True)
class Split:
    """One model's part of one job: ``fraction`` of the job's device time, ``awake_s`` seconds awake."""

    fraction: float
    awake_s: float


def parse_events(text: str) -> list[Event]:
    """The lines of ``models.events.jsonl``, oldest first; a line that is not such an object is skipped (a
    half-written last line too)."""
    out = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        t, model, event = data.get("t"), data.get("model"), data.get("event")
        if (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and isinstance(model, str)
                and event in ("awake", "asleep")):
            out.append(Event(float(t), model, event == "awake"))
    return sorted(out, key=lambda e: e.t)


def split(placements: Mapping[str, tuple[Sequence[int], float | None]], events: Sequence[Event] | None,
          start: float, end: float) -> dict[str, Split]:
    """Each model's part of a job's device time over ``[start, end]``: ``placements`` is served name -> (GPUs,
    memory share); ``events`` the awake/asleep changes (``None``: no file, every model awake throughout). The
    fractions add up to 1 (every device's time goes to someone); ``awake_s`` is 0 without events."""
    devices: dict[int, list[str]] = {}
    for model, (gpus, _) in placements.items():
        for g in gpus or (_CPU,):
            devices.setdefault(g, []).append(model)
    awake = {m: events is None for m in placements}
    parts = dict.fromkeys(placements, 0.0)
    awake_s = dict.fromkeys(placements, 0.0)
    changes = [e for e in events or () if e.model in placements]
    for e in changes:
        if e.t <= start:
            awake[e.model] = e.awake
    span = max(end - start, 0.0)
    marks = [start, *sorted({e.t for e in changes if start < e.t < end}), max(end, start)]
    for a, b in zip(marks, marks[1:]):
        for e in changes:
            if e.t == a and a > start:
                awake[e.model] = e.awake
        _share_out(devices, placements, awake, b - a, parts)
        if events is not None:
            for m in placements:
                awake_s[m] += (b - a) if awake[m] else 0.0
    if span == 0.0:  # no time: the state at the end, as a fraction
        _share_out(devices, placements, awake, 1.0, parts)
        span = 1.0
    total = span * max(len(devices), 1)
    return {m: Split(parts[m] / total, awake_s[m]) for m in placements}


def _share_out(devices: Mapping[int, list[str]], placements: Mapping[str, tuple[Sequence[int], float | None]],
               awake: Mapping[str, bool], seconds: float, parts: dict[str, float]) -> None:
    """``seconds`` of each device to its awake models by memory share, else evenly to all placed there."""
    for models in devices.values():
        up = [m for m in models if awake[m]]
        weights = {m: float(placements[m][1] or 0.0) for m in up}
        total = sum(weights.values())
        if not up or total <= 0:
            who = up or models
            weights, total = dict.fromkeys(who, 1.0), float(len(who))
        for m, w in weights.items():
            parts[m] += seconds * w / total


def read_events(runner: Runner, run_dir: str) -> list[Event] | None:
    """``RUN_DIR/models.events.jsonl`` through the job's runner (this machine or the login node over SSH);
    ``None`` when the job wrote none."""
    path = f"{run_dir}/{EVENTS_FILE}"
    try:
        size = runner.size(path)
        if size is None:
            return None
        raw = runner.read_bytes(path, 0, min(size, MAX_EVENTS_BYTES))
    except OSError:
        return None
    return parse_events(raw.decode("utf-8", "replace"))


def _slot_of(svc: ServiceRecord, name: str) -> int | None:
    found = re.fullmatch(rf"{re.escape(svc.name)}-r(\d+)(-g\d+)?", name)
    return int(found.group(1)) if found else None


def _window(row: UsageRow, record: JobRecord, events: list[Event] | None, now: float) -> tuple[float, float]:
    """The job's span: ending now while it runs; an ended job's from its first event on (its wall time long)."""
    wall = row.walltime_s or 0.0
    if not (row.ended or record.final_state) or not events:
        return now - wall, now
    return events[0].t, events[0].t + wall


def per_model(svc: ServiceRecord, jobs: Sequence[tuple[UsageRow, JobRecord]], runner_of: Any,
              now: float | None = None) -> list[dict[str, Any]]:
    """The ``models`` of a multi-model service's usage: per model, its GPU- and node-hours (its part of each
    job it ran in) and, where its jobs wrote events, its seconds awake."""
    now = time.time() if now is None else now
    out = {m["served_model_name"]: {"model": m["served_model_name"], "gpus": list(m["gpus"]),
                                    "gpu_memory_utilization": m["gpu_memory_utilization"], "jobs": 0,
                                    "node_hours": None, "gpu_hours": None, "awake_s": None}
           for m in svc.models}
    for row, record in jobs:
        slot = _slot_of(svc, row.name)
        placed = {m["served_model_name"]: (m["gpus"], m["gpu_memory_utilization"]) for m in svc.models
                  if slot is not None and m["job"] == slot + 1}
        if not placed:
            continue
        events = read_events(runner_of(record.transport), record.run_dir)
        start, end = _window(row, record, events, now)
        for model, part in split(placed, events, start, end).items():
            entry = out[model]
            entry["jobs"] += 1
            for key, hours in (("node_hours", row.node_hours), ("gpu_hours", row.gpu_hours)):
                if hours is not None:
                    entry[key] = (entry[key] or 0.0) + hours * part.fraction
            if events is not None:
                entry["awake_s"] = (entry["awake_s"] or 0.0) + part.awake_s
    for entry in out.values():
        for key, digits in (("node_hours", 4), ("gpu_hours", 4), ("awake_s", 1)):
            if entry[key] is not None:
                entry[key] = round(entry[key], digits)
    return list(out.values())
