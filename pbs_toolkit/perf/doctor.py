"""``doctor``: find what makes a vLLM server slow or broken, with the evidence and a concrete fix.

Every rule is a small function ``(ctx) -> list[Finding]`` listed in :data:`RULES`; add a rule by writing one
and appending it. A finding that a new launch fixes says how as a :class:`Remedy` (data, not text), which
``perf/recommend.py`` turns into the job's own launch command with that change. Numbers quoted in fixes come
from docs/vllm.md "Measured performance" and benchmarks/README.md (2x H200 NVLink, vLLM 0.22.1,
Qwen3-1.7B-shaped model, 128 in / 256 out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.settings.vllm_flags import REMOVED_ENV, REMOVED_FLAGS, version_tuple
from pbs_toolkit.settings.vllm_overrides import int_flag
from pbs_toolkit.vllm.engine_log import EngineStats
from pbs_toolkit.vllm.prom import MetricsSnapshot
from pbs_toolkit.vllm.startup import find_fatal, startup_timings

SEVERITIES = ("high", "medium", "low", "info")
#: below this peak KV-cache usage (percent) the cache is considered mostly idle
LOW_KV_USAGE_PCT = 20.0
#: ``torch.compile`` totals above this (seconds) are worth caching
LONG_COMPILE_S = 15.0
SMALL_BATCHED_TOKENS = 4096
SMALL_MODEL_B = 7.0


@dataclass
class DoctorContext:
    """Everything ``diagnose`` looks at; any part may be empty when it is not known."""

    vllm_args: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    data_parallel: int = 1
    pipeline_parallel: int = 1
    gpus: int = 1
    model_params_b: float | None = None
    log_lines: list[str] = field(default_factory=list)
    snapshot: MetricsSnapshot | None = None
    engine_stats: list[EngineStats] = field(default_factory=list)
    vllm_version: str = ""
    vllm_cache_root_shared: bool | None = None
    #: environment the server runs with (only checked for removed variables)
    env: dict[str, str] = field(default_factory=dict)
    #: ``cpu`` for the CPU build of vLLM, which is eager by design (no CUDA graphs to turn on)
    device: str = "gpu"
    #: pbstk's start script restarted vLLM with --enforce-eager after a graph/compile failure
    eager_fallback: bool = False
    #: the job's state (``READY``: the server answers, so earlier attempts' fatal lines are history)
    state: ServerState | None = None
    #: ``status --json``'s start-up breakdown (jobs/startup_phases.py), when known
    startup: dict[str, Any] | None = None


@dataclass(frozen=True)
class Remedy:
    """What a new launch of the job changes to apply a finding's fix: ``drop`` these vLLM flags (any spelling)
    from its ``--vllm-arg``s; ``set`` these (``--flag=value``, or a bare ``--flag``/``--no-flag`` that is needed
    only against the preset's own spelling) in place of the user's; ``eager_off``: ``--no-eager`` when the preset
    (or ``--eager``) made it eager; ``layout``: (TP, DP) of the preset to use instead."""

    drop: tuple[str, ...] = ()
    set: tuple[str, ...] = ()
    eager_off: bool = False
    layout: tuple[int, int] | None = None


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    title: str
    evidence: str
    fix: str
    #: how a new launch applies the fix; ``None``: no launch does (the client's load, a failure's cause, ...)
    remedy: Remedy | None = None
    #: the ``pbstk launch`` command that relaunches the job with ``remedy`` applied (perf/recommend.py)
    relaunch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """One finding of a ``diagnosis`` (docs/json.md): the texts and ``relaunch``."""
        return {"code": self.code, "severity": self.severity, "title": self.title, "evidence": self.evidence,
                "fix": self.fix, "relaunch": self.relaunch}


def _has_flag(args: Sequence[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args)


def _log_line_with(lines: Sequence[str], text: str) -> str | None:
    return next((line.strip() for line in lines if text in line), None)


def _version(ctx: DoctorContext) -> tuple[int, ...] | None:
    try:
        return version_tuple(ctx.vllm_version) if ctx.vllm_version else None
    except ValueError:
        return None


def rule_eager(ctx: DoctorContext) -> list[Finding]:
    if ctx.device == "cpu":
        return []  # the CPU build runs eagerly by design: there are no CUDA graphs to turn on
    if ctx.eager_fallback:
        return rule_eager_fallback(ctx)
    line = _log_line_with(ctx.log_lines, "Cudagraph is disabled under eager mode")
    remedy = None
    if _has_flag(ctx.vllm_args, "--enforce-eager"):
        evidence = "the server runs with --enforce-eager"
        remedy = Remedy(drop=("--enforce-eager",), eager_off=True)
    elif line:
        evidence = f"log: {line!r}"  # eager from something else (a compilation config): no flag to take away
    else:
        return []
    return [
        Finding(
            "eager-mode",
            "high",
            "CUDA graphs and torch.compile are off (eager mode)",
            evidence,
            "Remove --enforce-eager. Measured with `pbstk tune` on 2x H200 (vLLM 0.22.1, 1.7B model, 128/256 "
            "tokens): 1 GPU with graphs 477 vs 85 output tok/s at concurrency 1 (5.6x), 18427 vs 4950 at 64 "
            "(3.7x), 24828 vs 15447 at 256 (1.6x). Start-up grows by 35-50 s (74 vs 38 s); a shared "
            "VLLM_CACHE_ROOT makes later starts faster.",
            remedy,
        )
    ]


def rule_eager_fallback(ctx: DoctorContext) -> list[Finding]:
    """Eager because pbstk's start script fell back to it: say so and why, never "remove --enforce-eager"."""
    import re

    from pbs_toolkit.vllm.startup import COMPILE_ERROR_RE

    restart = next((i for i, line in enumerate(ctx.log_lines)
                    if line.startswith("pbstk: ") and "with --enforce-eager" in line), len(ctx.log_lines))
    pattern = re.compile(COMPILE_ERROR_RE)
    cause = next((line.strip() for line in reversed(ctx.log_lines[:restart]) if pattern.search(line)), None)
    return [
        Finding(
            "eager-fallback",
            "medium",
            "pbstk restarted the server in eager mode after CUDA graph capture / torch.compile failed",
            f"log: {cause!r}" if cause else "the start script recorded an eager fallback (server.json)",
            "The server runs without CUDA graphs (slower: see eager-mode in docs/vllm.md) because the graph "
            "attempt failed; pbstk added --enforce-eager itself, so there is no flag to remove. Fix the cause "
            "above (a vLLM/PyTorch/driver mismatch, a full compile cache dir) and launch again to get graphs.",
        )
    ]


def rule_tp_small_model(ctx: DoctorContext) -> list[Finding]:
    if ctx.tensor_parallel <= 1 or ctx.model_params_b is None or ctx.model_params_b >= SMALL_MODEL_B:
        return []
    replicas = ctx.tensor_parallel * max(ctx.data_parallel, 1)
    version = _version(ctx)
    how = f"a DP{replicas} preset (vLLM's --tensor-parallel-size 1 --data-parallel-size {replicas})"
    if version is not None and version < (0, 14):
        how += (
            f"; on vLLM {ctx.vllm_version}, {replicas} separate servers behind a balancer are safer: "
            "DP ranks only run independently from about 0.14"
        )
    return [
        Finding(
            "tp-small-model",
            "medium",
            "Tensor parallelism on a model that fits one GPU",
            f"tensor_parallel={ctx.tensor_parallel} for a {ctx.model_params_b:g}B-parameter model "
            f"(~{2 * ctx.model_params_b:.0f} GB of 16-bit weights)",
            f"Use data parallelism instead: {how}. Measured with `pbstk tune` on 2x H200 NVLink (1.7B model): "
            "DP2 gave 21886 vs 20289 output tok/s for TP2 at concurrency 64 and 46068 vs 22682 (2.0x) at 256, "
            "while single-request speed was the same (474 vs 470); over PCIe the gap is larger.",
            Remedy(layout=(1, replicas)),
        )
    ]


def rule_custom_allreduce(ctx: DoctorContext) -> list[Finding]:
    line = _log_line_with(ctx.log_lines, "Custom allreduce is disabled")
    if line is None:
        return []
    return [
        Finding(
            "tp-over-pcie",
            "medium",
            "Tensor parallelism over PCIe without custom allreduce",
            f"log: {line!r}",
            "Every layer now all-reduces through NCCL over PCIe. Prefer data parallelism "
            "(--data-parallel-size) for models that fit one GPU, or keep TP at 2 on GPUs joined by NVLink "
            "(check `nvidia-smi topo -m`).",
        )
    ]


def _kv_observations(ctx: DoctorContext) -> tuple[float | None, int, int, str]:
    """(peak KV usage %, peak running per engine, peak waiting, where the numbers come from).

    The log's ``Engine NNN:`` lines give history; the ``/metrics`` snapshot gives the present. Peaks over
    both, so a queue that builds up now is seen even when the logged history was quiet.
    """
    kv: list[float] = []
    running: list[int] = []
    waiting: list[int] = []
    sources = []
    with_kv = [s for s in ctx.engine_stats if s.kv_cache_usage_pct is not None]
    if with_kv:
        kv.append(max(s.kv_cache_usage_pct or 0.0 for s in with_kv))
        running.append(max(s.running for s in ctx.engine_stats))
        waiting.append(max(s.waiting for s in ctx.engine_stats))
        sources.append(f"{len(ctx.engine_stats)} engine stats lines")
    snap = ctx.snapshot
    if snap is not None and snap.kv_cache_usage is not None:
        engines = max(len(snap.engines), 1)
        usage = snap.kv_cache_usage_max if snap.kv_cache_usage_max is not None else snap.kv_cache_usage
        kv.append(100.0 * usage)
        running.append(round((snap.running or 0.0) / engines))
        waiting.append(int(snap.waiting or 0.0))
        sources.append("/metrics")
    if not kv:
        return None, 0, 0, ""
    return max(kv), max(running), max(waiting), " and ".join(sources)


def rule_kv_underused(ctx: DoctorContext) -> list[Finding]:
    peak_kv, running, waiting, source = _kv_observations(ctx)
    if peak_kv is None or peak_kv >= LOW_KV_USAGE_PCT or running == 0:
        return []
    max_num_seqs = int_flag(ctx.vllm_args, "--max-num-seqs")
    evidence = f"peak KV cache usage {peak_kv:.1f}% with up to {running} running and {waiting} waiting " + (
        f"requests per engine ({source})"
    )
    seq_limited = waiting > 0 or (max_num_seqs is not None and running >= 0.9 * max_num_seqs)
    if seq_limited:
        limit = f"--max-num-seqs {max_num_seqs}" if max_num_seqs else "the default --max-num-seqs"
        factor = max(2, min(8, int(LOW_KV_USAGE_PCT * 4 / max(peak_kv, 1.0))))
        target = f" (e.g. {max_num_seqs * factor})" if max_num_seqs else " (e.g. 512 or 1024)"
        return [
            Finding(
                "kv-underused-seq-limit",
                "medium",
                "Requests wait while most of the KV cache is free",
                f"{evidence}; the batch is capped by {limit}",
                f"Raise --max-num-seqs{target}: the cache has room for several times more sequences. Watch "
                "for preemptions after the change.",
                Remedy(set=(f"--max-num-seqs={max_num_seqs * factor}",)) if max_num_seqs else None,
            )
        ]
    return [
        Finding(
            "kv-underused-load",
            "low",
            "The server is lightly loaded",
            evidence,
            "Raise the client's concurrency (a benchmark should sweep up to 128-256 concurrent requests: "
            "64 did not saturate one H200 with a small model) before changing server flags.",
        )
    ]


def rule_small_batched_tokens(ctx: DoctorContext) -> list[Finding]:
    value = int_flag(ctx.vllm_args, "--max-num-batched-tokens")
    if value is None or value >= SMALL_BATCHED_TOKENS:
        return []
    prefill_heavy = [
        s for s in ctx.engine_stats if s.prompt_throughput > s.generation_throughput and s.running
    ]
    evidence = f"--max-num-batched-tokens {value}"
    severity = "low"
    if prefill_heavy:
        peak = max(s.prompt_throughput for s in prefill_heavy)
        evidence += f" while prompts dominate (prompt throughput up to {peak:g} tokens/s)"
        severity = "medium"
    return [
        Finding(
            "small-batched-tokens",
            severity,
            "Small per-step token budget",
            evidence,
            "Long prompts are prefilled in chunks of this size, which slows time to first token and total "
            "throughput. Use 8192 (the default on H100/H200) or at least 4096, or drop the flag.",
            Remedy(set=("--max-num-batched-tokens=8192",)),
        )
    ]


def rule_prefix_caching_off(ctx: DoctorContext) -> list[Finding]:
    if not _has_flag(ctx.vllm_args, "--no-enable-prefix-caching"):
        return []
    return [
        Finding(
            "prefix-caching-off",
            "low",
            "Prefix caching is off",
            "the server runs with --no-enable-prefix-caching",
            "Drop the flag (prefix caching is on by default and cheap): shared system prompts and few-shot "
            "examples are then prefilled once. Keep it off only to measure cold-cache latency.",
            Remedy(set=("--enable-prefix-caching",)),
        )
    ]


def rule_compile_cache(ctx: DoctorContext) -> list[Finding]:
    timings = startup_timings(ctx.log_lines)
    seconds = timings["torch_compile_s"]
    if (
        seconds is None
        or seconds < LONG_COMPILE_S
        or ctx.vllm_cache_root_shared
        or timings["compile_cache_hit"]
    ):
        return []
    where = "is not shared" if ctx.vllm_cache_root_shared is False else "may not be shared"
    return [
        Finding(
            "compile-cache",
            "medium" if ctx.vllm_cache_root_shared is False else "low",
            "torch.compile runs from scratch at every start",
            f"log: torch.compile takes {seconds:g} s in total; VLLM_CACHE_ROOT {where}",
            "Set VLLM_CACHE_ROOT to a directory on a shared filesystem (not $HOME, whose quota "
            "~/.cache/vllm fills): a warm compile cache cut a start from 109 s to 72 s.",
        )
    ]


def rule_removed_flags(ctx: DoctorContext) -> list[Finding]:
    version = _version(ctx)
    findings = []
    env_names = set(ctx.env) | {arg.split("=", 1)[0] for arg in ctx.vllm_args if "=" in arg}
    used = [(flag, ".".join(map(str, since)), "flag")
            for flag, since in REMOVED_FLAGS.items() if _has_flag(ctx.vllm_args, flag)]
    used += [
        (name, ".".join(map(str, since)), "environment variable")
        for name, since in REMOVED_ENV.items() if name in env_names
    ]
    for name, since, kind in used:
        remedy = Remedy(drop=(name,)) if kind == "flag" else None
        if version is None:
            findings.append(
                Finding(
                    f"removed-{kind.split()[0]}",
                    "low",
                    f"{name} is gone in newer vLLM",
                    f"{kind} {name} is set and the vLLM version is unknown",
                    f"Remove {name}: vLLM {since} and newer "
                    + ("exit with 'unrecognized arguments'." if kind == "flag" else "ignore it."),
                    remedy,
                )
            )
        elif version >= version_tuple(since):
            findings.append(
                Finding(
                    f"removed-{kind.split()[0]}",
                    "high" if kind == "flag" else "low",
                    f"{name} was removed in vLLM {since}",
                    f"{kind} {name} with vLLM {ctx.vllm_version}",
                    f"Remove {name}"
                    + (
                        ": the server exits with 'unrecognized arguments'."
                        if kind == "flag"
                        else ": it is ignored."
                    ),
                    remedy,
                )
            )
    return findings


def rule_preemptions(ctx: DoctorContext) -> list[Finding]:
    from_log = max((s.preemptions or 0 for s in ctx.engine_stats), default=0)
    from_metrics = int(ctx.snapshot.preemptions or 0) if ctx.snapshot is not None else 0
    if from_log <= 0 and from_metrics <= 0:
        return []
    parts = []
    if from_metrics:
        parts.append(f"vllm:num_preemptions_total = {from_metrics}")
    if from_log:
        parts.append(f"engine stats line shows Preemptions: {from_log}")
    return [
        Finding(
            "preemptions",
            "medium",
            "Requests were preempted: the KV cache ran out",
            "; ".join(parts),
            "Preempted requests are recomputed, wasting GPU time. Give the cache more memory "
            "(--gpu-memory-utilization 0.92-0.95, a shorter --max-model-len), lower --max-num-seqs, "
            "or spread the model over more GPUs.",
        )
    ]


_KV_SHORT_FIX = ("One request of the full --max-model-len does not fit in the KV cache: raise --gpu-memory-utilization"
                 " or lower --max-model-len")
_FATAL_FIXES = (
    (
        "CUDA out of memory",
        "Lower --gpu-memory-utilization or --max-model-len / --max-num-seqs, or use more GPUs.",
    ),
    (
        "No available memory for the cache blocks",
        "The weights leave no room for the KV cache: raise --gpu-memory-utilization or use more GPUs (TP).",
    ),
    # one request of the full length does not fit: vLLM 0.22.1's words, then older releases' ("The model's max seq
    # len (N) is larger than the maximum number of tokens that can be stored in KV cache (M)")
    ("larger than the available KV cache memory", _KV_SHORT_FIX + " (at most the estimated length in this line)."),
    ("that can be stored in KV cache", _KV_SHORT_FIX + "."),
    (
        "is less than desired GPU memory utilization",
        "Another process holds GPU memory (check nvidia-smi); lower --gpu-memory-utilization or get the GPUs "
        "to yourself.",
    ),
    (
        "unrecognized arguments",
        "Remove the flags vLLM does not know for this version (see removed-flag findings).",
    ),
)


def rule_fatal(ctx: DoctorContext) -> list[Finding]:
    if ctx.state is ServerState.READY:
        return []  # it answers: a fatal line is from an attempt before a restart (eager fallback), not now
    fatal = find_fatal(ctx.log_lines)
    if fatal is None:
        return []
    fix = next(
        (text for marker, text in _FATAL_FIXES if marker in fatal[0]), "Read the log around this line."
    )
    return [Finding("server-failed", "high", "The server failed", "log: " + " | ".join(fatal), fix)]


def rule_slow_start(ctx: DoctorContext) -> list[Finding]:
    from pbs_toolkit.perf.startup_advice import slow_start

    said = slow_start(ctx.startup, ctx.log_lines)
    return [Finding("slow-start", "low", *said)] if said else []


def rule_container(ctx: DoctorContext) -> list[Finding]:
    from pbs_toolkit.perf.startup_advice import container_command

    command = container_command(ctx.log_lines)
    if command is None:
        return []
    return [Finding("container", "info", "vLLM runs in a container", f"log: {command}",
                    "Nothing to fix: this is the exact command (profile keys container / container_runtime). "
                    "Every directory vLLM needs must be among its --bind paths.")]


Rule = Callable[[DoctorContext], list[Finding]]
RULES: tuple[Rule, ...] = (
    rule_fatal,
    rule_removed_flags,
    rule_eager,
    rule_tp_small_model,
    rule_custom_allreduce,
    rule_kv_underused,
    rule_preemptions,
    rule_small_batched_tokens,
    rule_compile_cache,
    rule_prefix_caching_off,
    rule_slow_start,
    rule_container,
)


def diagnose(ctx: DoctorContext) -> list[Finding]:
    """Run every rule; findings sorted by severity (high first), then in rule order."""
    findings = [finding for rule in RULES for finding in rule(ctx)]
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
