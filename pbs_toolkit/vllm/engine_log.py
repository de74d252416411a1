"""Parse vLLM's periodic engine stats line.

While there is traffic, every engine logs about every 10 s::

    Engine 000: Avg prompt throughput: 515.5 tokens/s, Avg generation throughput: 256.0 tokens/s,
    Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.6%, Prefix cache hit rate: 72.0%

Known variants, all accepted: no ``Engine NNN:`` tag and ``Swapped``/``Pending`` fields (V0 engine),
``Preemptions: N``, a device name before ``KV cache usage`` (``GPU``, ``CPU``, from 0.30 ``H100`` or
several words), a missing prefix-cache field (prefix caching off), extra fields of newer versions (ignored),
and any log metadata prefix (see :mod:`pbs_toolkit.vllm.logline`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from pbs_toolkit.vllm.logline import split_log_line

_MARKER = "Avg prompt throughput:"
_ENGINE = re.compile(r"Engine\s+(\d+)\s*:\s*$")
# "Name: 12.5 unit" fields separated by commas; the name is anything without ':' or ','
_FIELD = re.compile(r"(?:^|,)\s*([^:,]+?)\s*:\s*(-?\d+(?:\.\d+)?)")
_KV_SUFFIX = "kv cache usage"


@dataclass(frozen=True)
class EngineStats:
    """One stats line. Throughputs in tokens/s, percentages 0..100; ``None`` where the line lacks a field."""

    prompt_throughput: float
    generation_throughput: float
    running: int
    waiting: int
    kv_cache_usage_pct: float | None = None
    #: the word(s) before "KV cache usage": "GPU", "CPU", "H100", ...
    kv_cache_device: str | None = None
    prefix_cache_hit_rate_pct: float | None = None
    preemptions: int | None = None
    swapped: int | None = None
    #: engine index from "Engine 001:", ``None`` on engines that do not tag their lines
    engine: int | None = None
    #: "MM-DD HH:MM:SS" from the log prefix, when present
    log_time: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_engine_line(line: str) -> EngineStats | None:
    """Parse one log line; ``None`` when it is not an engine stats line."""
    parsed = split_log_line(line)
    message = parsed.message
    start = message.find(_MARKER)
    if start < 0:
        return None
    engine_match = _ENGINE.search(message[:start])
    fields: dict[str, float] = {}
    device: str | None = None
    kv_pct: float | None = None
    for name, value in _FIELD.findall(message[start:]):
        key = name.strip().lower()
        if key.endswith(_KV_SUFFIX):
            # V0 lines carry "GPU KV cache usage" then "CPU KV cache usage" (swap space): the first is the
            # device the engine runs on.
            if kv_pct is None:
                kv_pct = float(value)
                device = name.strip()[: -len(_KV_SUFFIX)].strip() or None
            continue
        fields.setdefault(key, float(value))
    if "avg prompt throughput" not in fields or "avg generation throughput" not in fields:
        return None
    waiting = fields.get("waiting", fields.get("pending", 0.0))

    def optional_int(key: str) -> int | None:
        return int(fields[key]) if key in fields else None

    return EngineStats(
        prompt_throughput=fields["avg prompt throughput"],
        generation_throughput=fields["avg generation throughput"],
        running=int(fields.get("running", 0.0)),
        waiting=int(waiting),
        kv_cache_usage_pct=kv_pct,
        kv_cache_device=device,
        prefix_cache_hit_rate_pct=fields.get("prefix cache hit rate"),
        preemptions=optional_int("preemptions"),
        swapped=optional_int("swapped"),
        engine=int(engine_match.group(1)) if engine_match else None,
        log_time=parsed.time,
    )


def iter_engine_stats(lines: Iterable[str]) -> Iterator[EngineStats]:
    """Yield the stats of every engine stats line among ``lines``, in order."""
    for line in lines:
        stats = parse_engine_line(line)
        if stats is not None:
            yield stats
