"""What ``doctor`` says about a slow start (the ``startup`` breakdown, docs/coldstart.md) and about a server that runs
in a container. Plain tuples: :mod:`pbs_toolkit.perf.doctor` wraps them in findings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pbs_toolkit.vllm.startup import encoder_profiling

#: a start (without the queue) above this many seconds is worth a finding; 60-130 s cold and 30-70 s warm measured
SLOW_START_S = 90.0
#: the marker the start script logs before it starts vLLM in a container (server/start/coldstart.sh)
CONTAINER_LINE = "vLLM runs in a container: "

_FIXES = {
    "queued": "The scheduler held the job: a smaller or shorter job, another queue, or a keep-alive successor "
              "submitted ahead (`serve --keep-alive`) starts sooner; nothing in the server is slow.",
    "setup": "The profile's setup lines (modules, conda) and the venv on a shared filesystem take this long: "
             "a venv or container image on node-local disk starts faster.",
    "stage_copy": "Copying the weights to node-local disk: worth it when reads from the shared filesystem are "
                  "slower (compare the weights phase of a start without stage_to).",
    "compile_wait": "This engine waited for another one to fill the shared compile cache (torch < 2.10 must not "
                    "share it while it is written); torch >= 2.10 in the job's environment compiles concurrently.",
    "imports": "Python imports (torch, vLLM, CUDA init) from a shared filesystem: a venv or container image on "
               "node-local disk, or a warm page cache on the node, shortens this.",
    "weights": "Reading the weights: put them on node-local disk (profile key stage_to / `pbstk stage`) or a "
               "faster filesystem; safetensors shards load in parallel only with several ranks.",
    "compile": "torch.compile from scratch: set vllm_cache_root to a shared directory (keyed per torch/vLLM/"
               "model/layout by pbstk): a warm compile cache cut a start from 109 s to 72 s.",
    "graphs": "Memory profiling, KV cache allocation and CUDA graph capture: fewer capture sizes "
              "(-cc '{\"cudagraph_capture_sizes\": [...]}') shorten it; --enforce-eager skips it at a large "
              "throughput cost (4-8x measured).",
    "api_up": "API server processes starting after the engine: expected a few seconds; more with many "
              "--api-server-count processes.",
    "verified_ready": "pbstk saw the server up only this long after it was: a poll interval, not the server.",
}


def _encoder_note(log_lines: Sequence[str]) -> tuple[str, str] | None:
    """(evidence, fix) when vLLM profiled a vision-language model's encoder during this start (its ``graphs``
    phase), else ``None``."""
    profiled = encoder_profiling(log_lines)
    if profiled is None:
        return None
    budget, items, modality = profiled
    evidence = (f"log: the graphs phase includes profiling the {modality} encoder with {items} {modality}(s) of the "
                f"largest size (encoder cache budget {budget} tokens): a vision-language model")
    fix = ("Part of it is the vision encoder's profiling, which every start of a vision-language model pays. A "
           "workload without images: --text-only (profile or preset key text_only) skips it and gives its memory "
           "to the KV cache.")
    return evidence, fix


def slow_start(startup: dict[str, Any] | None, log_lines: Sequence[str] = ()) -> tuple[str, str, str] | None:
    """(title, evidence, fix) when a finished start took over :data:`SLOW_START_S` without its queue. A
    vision-language model's encoder profiling (seen in ``log_lines``, vLLM's log) is named in the evidence, and
    in the fix when the ``graphs`` phase that holds it was the longest."""
    if not startup or startup.get("current") is not None:
        return None
    phases = {k: v for k, v in (startup.get("phases") or {}).items() if isinstance(v, (int, float))}
    started = sum(v for k, v in phases.items() if k != "queued")
    if started < SLOW_START_S:
        return None
    longest = max((k for k in phases if k != "queued"), key=lambda k: phases[k], default=None)
    if longest is None:
        return None
    shown = ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in phases.items())
    name = longest.replace("_", " ")
    title = f"Start-up took {started:.0f} s; the longest phase was {name} ({phases[longest]:.0f} s)"
    evidence, fix = f"status --json startup: {shown}", _FIXES.get(longest, "See docs/coldstart.md.")
    encoder = _encoder_note(log_lines)
    if encoder is not None:
        evidence += "; " + encoder[0]
        if longest == "graphs":
            fix = f"{encoder[1]} {fix}"
    return title, evidence, fix


def container_command(lines: Sequence[str]) -> str | None:
    """The container command the start script logged (the newest), or ``None``."""
    for line in reversed(lines):
        at = line.find(CONTAINER_LINE)
        if at >= 0:
            return line[at + len(CONTAINER_LINE):].strip()
    return None
