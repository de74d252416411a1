"""Startup phases, timings and fatal errors read from a vLLM server log.

vLLM starts in a fixed order: load weights, ``torch.compile`` (skipped with ``--enforce-eager``), profile
memory and allocate the KV cache, capture CUDA graphs (skipped in eager mode), then start the HTTP server.
Each step leaves a marker line (docs/vllm.md "Startup phases"); this module maps the newest marker seen to a phase.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from pbs_toolkit.server.phases import Phase
from pbs_toolkit.vllm.logline import split_log_line

#: A start that died with one of these before it was ready is restarted once with --enforce-eager. The start
#: script greps with it (POSIX ERE, the same text) and ``wait`` uses it to know a restart is coming.
COMPILE_ERROR_RE = (
    r"(Error|Exception|[Ff]ailed).*([Dd]ynamo|[Ii]nductor|[Cc]ompil|[Gg]raph|[Cc]apturing|[Tt]riton)"
    r"|([Dd]ynamo|[Ii]nductor|[Cc]ompil|[Cc]uda[Gg]raph|CUDA graph|[Tt]riton).*(Error|Exception|[Ff]ailed)"
)
#: vLLM lost the race for its port: the start script picks another free port in its window
PORT_IN_USE_RE = r"(Address already in use|Errno 98)"


def is_compile_failure(lines: Iterable[str]) -> bool:
    """Whether ``lines`` show a graph/compile failure that an eager restart avoids."""
    pattern = re.compile(COMPILE_ERROR_RE)
    return any(pattern.search(line) for line in lines)


#: the phases the start script also writes to server.json share its strings (server/phases.py)
STARTING = Phase.STARTING.value
LOADING_WEIGHTS = "loading weights"
COMPILING = "compiling"
INITIALIZING_ENGINE = "initializing engine"
CAPTURING_GRAPHS = "capturing CUDA graphs"
STARTING_API_SERVER = "starting API server"
READY = Phase.READY.value
FAILED = Phase.FAILED.value

#: every value :func:`current_phase` returns, in startup order (``failed`` may follow any of them)
PHASES = (
    STARTING,
    LOADING_WEIGHTS,
    COMPILING,
    INITIALIZING_ENGINE,
    CAPTURING_GRAPHS,
    STARTING_API_SERVER,
    READY,
    FAILED,
)

# (substring of the message, phase entered when it appears); first match wins for a line
_PHASE_MARKERS: tuple[tuple[str, str], ...] = (
    ("Application startup complete", READY),
    ("Starting vLLM server on http", READY),
    ("Starting vLLM API server", READY),
    ("init engine (profile, create kv cache, warmup model) took", STARTING_API_SERVER),
    ("Graph capturing finished", INITIALIZING_ENGINE),
    ("Capturing CUDA graph", CAPTURING_GRAPHS),
    ("Capturing cudagraphs", CAPTURING_GRAPHS),
    ("torch.compile takes", INITIALIZING_ENGINE),
    ("torch.compile took", INITIALIZING_ENGINE),  # vLLM >= 0.2x words it in the past tense
    ("Available KV cache memory", INITIALIZING_ENGINE),
    ("KV cache size:", INITIALIZING_ENGINE),
    ("Maximum concurrency for", INITIALIZING_ENGINE),
    ("Memory profiling takes", INITIALIZING_ENGINE),
    ("Compiling a graph", COMPILING),
    ("Dynamo bytecode transform time", COMPILING),
    ("Directly load the compiled graph", COMPILING),
    ("for vLLM's torch.compile", COMPILING),
    ("Model loading took", INITIALIZING_ENGINE),
    ("Loading weights took", INITIALIZING_ENGINE),
    ("Loading model weights took", INITIALIZING_ENGINE),
    ("Starting to load model", LOADING_WEIGHTS),
    ("Loading safetensors checkpoint shards", LOADING_WEIGHTS),
    ("Loading weights", LOADING_WEIGHTS),
    ("Loading model", LOADING_WEIGHTS),
)

# root causes, most specific first; each is searched in the whole log
_FATAL_MARKERS = (
    "CUDA out of memory",
    "No available memory for the cache blocks",
    "is less than desired GPU memory utilization",
    "unrecognized arguments",
    "EngineDeadError",
    "Engine core initialization failed",
)
#: lines that only say the engine died, pointing at a cause logged before them (vLLM's API server prints
#: "RuntimeError: Engine core initialization failed. See root cause above." after the engine core's traceback).
#: This and EXCEPTION_RE are POSIX ERE that Python reads the same way: the start script names a model's cause with
#: them (models.sh pbstk_root_cause), the message being what LOG_PREFIX_RE leaves of a line.
FATAL_WRAPPER_RE = r"EngineDeadError|Engine core initialization failed|See root cause above"
#: a message that is an exception (``ValueError: ...``, ``torch.OutOfMemoryError: ...``)
EXCEPTION_RE = r"^([A-Za-z0-9_.]+\.)?[A-Za-z0-9_]*(Error|Exception):|^Error:"
#: the engine core's own line before the traceback of a death after the server was ready (v1 core.py)
_ENGINE_DIED = "EngineCore encountered a fatal error"
_EXCEPTION = re.compile(EXCEPTION_RE)
_WRAPPER = re.compile(FATAL_WRAPPER_RE)
_NUMBER = r"(\d+(?:\.\d+)?)"
_TIMINGS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("weights_load_s", re.compile(r"Loading weights took " + _NUMBER + r"\s*s")),
    ("model_load_s", re.compile(r"Model loading took .*?" + _NUMBER + r"\s*s(?:ec|econds)?\b")),
    ("compile_graph_s", re.compile(r"Compiling a graph for .*? takes " + _NUMBER + r"\s*s")),
    ("compile_cache_load_s", re.compile(r"Directly load the compiled graph.*?took " + _NUMBER + r"\s*s")),
    ("torch_compile_s", re.compile(r"torch\.compile (?:takes|took) " + _NUMBER + r"\s*s in total")),
    ("graph_capture_s", re.compile(r"Graph capturing finished in " + _NUMBER + r"\s*sec")),
    ("init_engine_s", re.compile(r"init engine \(profile, create kv cache, warmup model\) took " + _NUMBER)),
)
_MAX_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request:\s*" + _NUMBER + "x")
_KV_TOKENS = re.compile(r"KV cache size:\s*([\d,]+) tokens")
_SERVER_URL = re.compile(r"Starting vLLM (?:API )?server(?: \d+)? on (http\S+)")
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _messages(lines: Iterable[str]) -> list[str]:
    return [split_log_line(line).message for line in lines]


def _first_ready_index(messages: Sequence[str]) -> int | None:
    for index, message in enumerate(messages):
        if any(marker in message for marker, phase in _PHASE_MARKERS if phase == READY):
            return index
    return None


def current_phase(lines: Iterable[str]) -> str:
    """The phase the server is in according to ``lines`` (one of :data:`PHASES`).

    ``failed`` wins over everything once :func:`find_fatal` finds a fatal error.
    """
    lines = list(lines)
    if find_fatal(lines) is not None:
        return FAILED
    phase = STARTING
    for message in _messages(lines):
        for marker, marker_phase in _PHASE_MARKERS:
            if marker in message:
                phase = marker_phase
                break
    return phase


def _is_wrapper(message: str) -> bool:
    return _WRAPPER.search(message) is not None


def _root_cause(messages: Sequence[str], index: int, ready: int | None) -> int:
    """The last specific exception line (``XxxError: ...``, not itself a wrapper) before the wrapper at ``index``,
    else ``index``. After the server was ready only the engine core's fatal-error traceback counts: request errors
    logged while it served are not why it died."""
    start = 0
    if ready is not None and ready < index:
        died = [i for i in range(ready, index) if _ENGINE_DIED in messages[i]]
        if not died:
            return index
        start = died[-1]
    for i in range(index - 1, start - 1, -1):
        if _EXCEPTION.match(messages[i]) and not _is_wrapper(messages[i]):
            return i
    return index


def _fatal_index(messages: Sequence[str]) -> int | None:
    ready = _first_ready_index(messages)
    for marker in _FATAL_MARKERS:
        for index, message in enumerate(messages):
            if marker in message:
                return _root_cause(messages, index, ready) if _is_wrapper(message) else index
    # A traceback only counts before the server became ready: afterwards vLLM logs request errors with
    # tracebacks and keeps serving.
    end = len(messages) if ready is None else ready
    for index in range(end):
        if messages[index].startswith("Traceback (most recent call last)"):
            for later in range(index + 1, end):
                if _EXCEPTION.match(messages[later]):
                    return later
            return index
    for index in range(end):
        if _EXCEPTION.match(messages[index]):
            return index
    return None


def find_fatal(lines: Iterable[str], context: int = 2) -> list[str] | None:
    """The error that stopped the server, or ``None``.

    The first element is the fatal message (the root cause, e.g. the ``CUDA out of memory`` line, or the engine
    core's ``ValueError: ...`` before an ``Engine core initialization failed. See root cause above.``, rather than
    that wrapper, which is kept only when no specific exception precedes it); the rest are up to ``context`` lines
    before and after it, in log order, without log metadata.
    """
    messages = _messages(lines)
    index = _fatal_index(messages)
    if index is None:
        return None
    around = [
        messages[i]
        for i in range(max(0, index - context), min(len(messages), index + context + 1))
        if i != index and messages[i]
    ]
    return [messages[index], *around]


def _log_datetime(time_text: str | None) -> datetime | None:
    # vLLM prints no year; any fixed leap year keeps Feb 29 valid and differences right within a year
    if not time_text:
        return None
    try:
        return datetime.strptime("2000-" + time_text.split(".")[0], _TIME_FORMAT)
    except ValueError:
        return None


def startup_timings(lines: Iterable[str]) -> dict[str, Any]:
    """Durations and facts from the startup markers, JSON-ready.

    Keys (absent durations are ``None``): ``weights_load_s``, ``model_load_s``, ``compile_graph_s``,
    ``compile_cache_load_s``, ``torch_compile_s``, ``graph_capture_s``, ``init_engine_s``,
    ``ready_after_s`` (first to ready line, from log timestamps), ``max_concurrency`` (the ``X.XXx``),
    ``max_concurrency_tokens``, ``kv_cache_tokens``, ``compile_cache_hit``, ``eager``,
    ``custom_allreduce_disabled``, ``server_url``, ``phase``, ``fatal`` (first fatal message or ``None``).
    """
    raw = list(lines)
    parsed = [split_log_line(line) for line in raw]
    messages = [p.message for p in parsed]
    result: dict[str, Any] = {key: None for key, _ in _TIMINGS}
    result.update(
        ready_after_s=None,
        max_concurrency=None,
        max_concurrency_tokens=None,
        kv_cache_tokens=None,
        compile_cache_hit=False,
        eager=False,
        custom_allreduce_disabled=False,
        server_url=None,
    )
    for message in messages:
        for key, pattern in _TIMINGS:
            match = pattern.search(message)
            if match and result[key] is None:
                result[key] = float(match.group(1))
        if (match := _MAX_CONCURRENCY.search(message)) and result["max_concurrency"] is None:
            result["max_concurrency_tokens"] = int(match.group(1).replace(",", ""))
            result["max_concurrency"] = float(match.group(2))
        if (match := _KV_TOKENS.search(message)) and result["kv_cache_tokens"] is None:
            result["kv_cache_tokens"] = int(match.group(1).replace(",", ""))
        if (match := _SERVER_URL.search(message)) and result["server_url"] is None:
            result["server_url"] = match.group(1).rstrip(".,")
        if "Directly load the compiled graph" in message:
            result["compile_cache_hit"] = True
        if "Cudagraph is disabled under eager mode" in message or "enforce_eager=True" in message:
            result["eager"] = True
        if "Custom allreduce is disabled" in message:
            result["custom_allreduce_disabled"] = True
    ready = _first_ready_index(messages)
    if ready is not None:
        start = next((_log_datetime(p.time) for p in parsed if p.time), None)
        end = _log_datetime(parsed[ready].time)
        if start is not None and end is not None and end >= start:
            result["ready_after_s"] = (end - start).total_seconds()
    fatal = find_fatal(raw)
    result["fatal"] = fatal[0] if fatal else None
    result["phase"] = current_phase(raw)
    return result


#: vLLM profiles a multimodal model's encoder at start, with the most items of the largest size a batch may hold
#: (v1 gpu_model_runner ``profile_run``; the time counts in the ``graphs`` start-up phase, before the KV cache)
_ENCODER_PROFILED = re.compile(r"Encoder cache will be initialized with a budget of ([\d,]+) tokens, and profiled "
                               r"with (\d+) (\w+) items")


def encoder_profiling(lines: Iterable[str]) -> tuple[int, int, str] | None:
    """(encoder budget in tokens, items, modality) of the newest encoder profiling line in ``lines``: vLLM ran the
    vision (or audio) encoder on dummy inputs during its start; ``None`` for a text-only start."""
    for message in reversed(_messages(lines)):
        match = _ENCODER_PROFILED.search(message)
        if match:
            return int(match.group(1).replace(",", "")), int(match.group(2)), match.group(3)
    return None
