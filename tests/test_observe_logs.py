"""Engine stats lines and startup logs (tests/data/observe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pbs_toolkit.vllm.engine_log import iter_engine_stats, parse_engine_line
from pbs_toolkit.vllm.startup import PHASES, current_phase, find_fatal, startup_timings

DATA = Path(__file__).parent / "data" / "observe"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def test_plain_line():
    stats = parse_engine_line(
        "Engine 000: Avg prompt throughput: 515.5 tokens/s, Avg generation throughput: 256.0 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.6%, Prefix cache hit rate: 72.0%"
    )
    assert stats is not None
    assert (stats.engine, stats.prompt_throughput, stats.generation_throughput) == (0, 515.5, 256.0)
    assert (stats.running, stats.waiting, stats.kv_cache_usage_pct) == (0, 0, 1.6)
    assert stats.kv_cache_device == "GPU" and stats.prefix_cache_hit_rate_pct == 72.0
    assert stats.log_time is None and stats.preemptions is None


def test_all_variants():
    stats = list(iter_engine_stats(lines("engine-lines.log")))
    assert len(stats) == 10  # the access-log line is skipped
    multi = stats[2]
    assert (multi.engine, multi.running, multi.waiting, multi.preemptions) == (1, 250, 97, 0)
    v0 = stats[3]  # no engine tag, Swapped/Pending, GPU then CPU (swap) cache
    assert v0.engine is None and v0.swapped == 0 and v0.waiting == 1
    assert v0.kv_cache_device == "GPU" and v0.kv_cache_usage_pct == 0.4
    assert v0.prefix_cache_hit_rate_pct is None
    assert stats[4].kv_cache_device == "CPU" and stats[4].kv_cache_usage_pct == 0.3
    h100 = stats[5]
    assert h100.kv_cache_device == "H100" and h100.preemptions == 3 and h100.kv_cache_usage_pct == 42.5
    assert h100.log_time == "01-15 08:00:00"
    assert stats[6].kv_cache_device == "Ascend 910B" and stats[6].engine == 2
    assert stats[7].prefix_cache_hit_rate_pct == 0.0  # extra "MM cache hit rate" ignored
    coloured = stats[9]
    assert (coloured.engine, coloured.running, coloured.waiting) == (0, 2, 3)
    assert all(s.to_dict()["prompt_throughput"] >= 0 for s in stats)


@pytest.mark.parametrize(
    "line",
    [
        "",
        'INFO 11-22 02:40:21 [api_server.py:1000] 127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK',
        "Avg prompt throughput: garbage",
    ],
)
def test_not_stats(line):
    assert parse_engine_line(line) is None


def test_startup_with_graphs():
    log = lines("startup-graphs.log")
    assert current_phase(log) == "ready"
    assert find_fatal(log) is None
    timings = startup_timings(log)
    assert timings["weights_load_s"] == 3.87
    assert timings["torch_compile_s"] == 35.39 and timings["compile_graph_s"] == 28.48
    assert timings["graph_capture_s"] == 15.0 and timings["init_engine_s"] == 60.72
    assert timings["max_concurrency"] == 26.63 and timings["max_concurrency_tokens"] == 40960
    assert timings["kv_cache_tokens"] == 1090720
    assert timings["eager"] is False and timings["compile_cache_hit"] is False
    assert timings["server_url"] == "http://0.0.0.0:8000"
    assert timings["ready_after_s"] == 102.0


def test_phases_progress_in_order():
    log = lines("startup-graphs.log")
    seen = [current_phase(log[:i]) for i in range(len(log) + 1)]
    assert seen[0] == "starting" and seen[-1] == "ready"
    assert {"loading weights", "compiling", "capturing CUDA graphs", "starting API server"} <= set(seen)
    assert set(seen) <= set(PHASES)
    first = {phase: seen.index(phase) for phase in set(seen)}
    assert first["loading weights"] < first["compiling"] < first["capturing CUDA graphs"] < first["ready"]


def test_startup_eager():
    log = lines("startup-eager.log")
    timings = startup_timings(log)
    assert timings["eager"] is True and timings["custom_allreduce_disabled"] is True
    assert timings["torch_compile_s"] is None and timings["graph_capture_s"] is None
    assert current_phase(log) == "ready"


def test_fatal_oom_names_the_root_cause():
    log = lines("startup-oom.log")
    fatal = find_fatal(log)
    assert fatal is not None
    assert "CUDA out of memory" in fatal[0] and not fatal[0].startswith("(")
    assert len(fatal) > 1
    assert current_phase(log) == "failed"
    assert startup_timings(log)["fatal"] == fatal[0]


def test_fatal_generic_traceback_and_argparse():
    log = [
        "INFO 11-22 02:38:28 [api_server.py:1] vLLM API server version 0.22.1",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: max_model_len (65536) is greater than the derived max_model_len (40960).",
    ]
    assert find_fatal(log)[0].startswith("ValueError: max_model_len")
    usage = [
        "usage: vllm serve [model_tag] [options]",
        "vllm serve: error: unrecognized arguments: --swap-space 4",
    ]
    assert "unrecognized arguments" in find_fatal(usage)[0]


def test_tracebacks_after_ready_are_not_fatal_but_engine_death_is():
    ready = lines("startup-graphs.log")
    request_error = [
        "ERROR 11-22 03:00:00 [serving.py:1] Traceback (most recent call last):",
        "KeyError: 'x'",
    ]
    assert find_fatal(ready + request_error) is None
    died = ready + ["ERROR 11-22 03:00:01 [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: dead"]
    assert "EngineDeadError" in find_fatal(died)[0]
    assert current_phase(died) == "failed"


KV_SHORT = ("ValueError: To serve at least one request with the model's max seq len (40960), (4.38 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (3.98 GiB).")
WRAPPER = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def test_fatal_names_the_engine_cores_error_before_the_wrapper():
    """vLLM 0.22.1 on an H100 (a co-model's log, trimmed): the engine core's ValueError (printed with its ERROR
    prefixes, then again bare) and last the API server's "See root cause above" wrapper.
    Before: the wrapper was the fatal line (its marker was searched before any exception)."""
    log = lines("startup-0.22.1-kv-short.log")
    fatal = find_fatal(log)
    assert fatal is not None and fatal[0].startswith(KV_SHORT), fatal
    assert "raise ValueError(" in fatal[1:]  # the context is the cause's, not the wrapper's
    assert startup_timings(log)["fatal"] == fatal[0] and current_phase(log) == "failed"
    # the same log with vLLM's ERROR prefix on the only copy of the cause
    prefixed = [line for line in log if not line.startswith("(EngineCore pid=20552) ValueError")]
    assert find_fatal(prefixed)[0].startswith(KV_SHORT)


def test_fatal_keeps_the_wrapper_when_nothing_better_precedes_it():
    log = lines("startup-0.22.1-kv-short.log")
    alone = [line for line in log if "ValueError: To serve" not in line]
    assert find_fatal(alone)[0] == WRAPPER
    # a wrapper never stands for another wrapper, and an engine death after ready is not a request's error
    dead = ["ERROR 11-22 03:00:00 [core.py:1] vllm.v1.engine.exceptions.EngineDeadError: dead", WRAPPER]
    assert "EngineDeadError" in find_fatal(dead)[0]
    ready = lines("startup-graphs.log") + ["ERROR 11-22 03:00:00 [serving.py:1] KeyError: 'x'"]
    died = ready + [
        "(EngineCore_DP0 pid=7) ERROR 11-22 03:00:01 [core.py:1] EngineCore encountered a fatal error.",
        "(EngineCore_DP0 pid=7) ERROR 11-22 03:00:01 [core.py:1] torch.AcceleratorError: CUDA error: an illegal "
        "memory access was encountered",
        "(APIServer pid=6) ERROR 11-22 03:00:01 [async_llm.py:1] vllm.v1.engine.exceptions.EngineDeadError: dead",
    ]
    assert find_fatal(died)[0].startswith("torch.AcceleratorError: CUDA error: an illegal memory access")
    assert "EngineDeadError" in find_fatal(ready + died[-1:])[0]
