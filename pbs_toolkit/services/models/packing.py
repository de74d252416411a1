"""Packing several models into as few jobs as fit (issue 31; docs/multi-model.md "The plan"): pure, no I/O.

Input: each model's size as ``auto`` measures it (jobs/plan.py ``model_size``) or the GPUs its named preset
asks for, and the profile's GPUs per node, GPU memory, nodes per job and job limit. Output: a
:class:`PackingPlan`, the same for the same input. Rules:

* a model gets the smallest tensor-parallel size ``auto`` would give it (settings/layout.py
  ``auto_by_memory``: weights at most ``WEIGHTS_SHARE`` of what vLLM may use, the rest KV cache);
* a model small enough shares a GPU: it is placed by what it needs, rounded up to ``SHARE_STEP`` and at least
  ``MIN_SHARE``: its weights at that rule, and at least its weights plus the KV cache of one request of its full
  length (``KV_MARGIN`` of it: vLLM refuses to start without that room) plus ``ACTIVATION_GB``; the needs on one
  GPU sum to at most ``SHARE_CAP`` (below vLLM's single-model default, leaving each extra process its CUDA
  context), and once every model is placed the GPU is given out whole: ``SHARE_CAP`` of it in proportion to
  each model's need (its ``--gpu-memory-utilization``), the rest being KV cache;
* models are placed largest first (GPUs, then share, then served name), each on the first GPUs free for it
  (job, node, GPU order), in a new job only when no job has room, never beyond the job limit;
* a model that fits no node at all is refused before anything else, naming it, its need and the largest
  GPU set;
* swapping (``Resources.max_awake`` K > 0, ``serve --max-awake K``): a model that fits nowhere awake joins the
  models of its GPU count on one GPU set where at most K are awake at once (vLLM's sleep mode), before a new job
  is planned: the K largest needs plus ``ASLEEP_GB`` for each sleeper fit in ``SHARE_CAP``; each model of such a
  set gets its need plus an equal part of what is left (``Placement.swap``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pbs_toolkit.errors import UsageError
from pbs_toolkit.settings.layout import DEFAULT_MEMORY_UTILIZATION, WEIGHTS_SHARE, auto_by_memory
from pbs_toolkit.settings.presets import auto_layout

#: the most the shares of the models on one GPU add up to (vLLM's single-model default is 0.95)
SHARE_CAP = 0.9
#: shares are rounded up to this step ...
SHARE_STEP = 0.05
#: ... and are at least this (activations and CUDA graphs of even the smallest model)
MIN_SHARE = 0.1
#: a packed model's share holds the KV cache of one full-length request this many times over ...
KV_MARGIN = 1.1
#: ... plus this much for vLLM's activations at its profiling run and its CUDA graphs (GB; 0.8 GiB measured for a
#: Qwen3-1.7B-shaped model on an H100 at vLLM 0.22.1's defaults, benchmarks/README.md "Many models")
ACTIVATION_GB = 1.5
#: GPU memory a sleeping vLLM still holds per GPU (its CUDA context and graphs): measured on 4x H100 with vLLM
#: 0.22.1, 2.06-2.23 GiB (2.2-2.4 GB) a model for Qwen3 1.7B/4B/8B-shaped models ("Sleep mode freed X GiB memory,
#: Y GiB memory is still in use": 2.23, 4.46, 6.19 GiB as one, two, three slept; benchmarks/README.md)
ASLEEP_GB = 2.5


@dataclass(frozen=True)
class ModelNeed:
    """What one model asks of the GPUs."""

    served: str
    model: str
    #: the preset the plan shows: ``auto`` (sized here) or a named one
    preset: str
    #: size in billions of parameters, ``None``: unknown; with ``bytes_per_param`` the weights' bytes
    params_b: float | None = None
    bytes_per_param: float = 2.0
    dtype_note: str = "bf16 assumed"
    #: whole GPUs a named preset takes (TP x PP x DP); ``None``: ``auto``, sized by weights
    gpus: int | None = None
    #: GB of KV cache one request of the model's full length takes; ``None``: unknown (weights alone size it)
    kv_gb: float | None = None

    @property
    def weights_gb(self) -> float | None:
        return None if self.params_b is None else self.params_b * self.bytes_per_param


@dataclass(frozen=True)
class Resources:
    """What the profile offers: GPUs per node (0: a CPU profile), GPU memory in GB (0: unknown), nodes per
    job, the most jobs (0: no limit) and the first port."""

    gpus_per_node: int
    gpu_memory_gb: int
    nodes_per_job: int = 1
    max_jobs: int = 0
    port: int = 8000
    utilization: float = DEFAULT_MEMORY_UTILIZATION
    #: swapping: at most this many models awake on one GPU set (0: no swapping; every model stays awake)
    max_awake: int = 0


@dataclass(frozen=True)
class Placement:
    """Where one model runs: job (from 1), node of the job (from 0), GPUs of that node, its share."""

    served: str
    model: str
    preset: str
    job: int
    node: int
    gpus: tuple[int, ...]
    #: ``--gpu-memory-utilization`` (``None`` on a CPU profile)
    share: float | None
    port: int
    weights_gb: float | None
    #: one of a swap set: several models on these GPUs, at most ``Resources.max_awake`` of them awake
    swap: bool = False
    #: what it needs of each of its GPUs, the share it was placed by (``share`` gives it more where a GPU is shared)
    need: float | None = None

    @property
    def tensor_parallel(self) -> int:
        return len(self.gpus)

    def memory_gb(self, gpu_memory_gb: int) -> float | None:
        """The GPU memory vLLM may use: its share of each of its GPUs (``None`` when unknown)."""
        if self.share is None or not gpu_memory_gb:
            return None
        return round(self.share * gpu_memory_gb * len(self.gpus), 1)


@dataclass(frozen=True)
class PackingPlan:
    jobs: int
    resources: Resources
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class _Fit:
    """A model's size in GPUs: ``tp`` whole GPUs, or one GPU shared at ``share`` (``shared``)."""

    need: ModelNeed
    tp: int
    share: float | None
    shared: bool
    #: what it needs of each of its GPUs (a share, rounded up), for a swap set; ``SHARE_CAP`` when unknown
    want: float = SHARE_CAP
    #: planned into a swap set (:func:`_swap_shares`)
    swap: bool = False
    #: the share it was placed by, once :func:`_fill` gave it more (``None``: ``share`` is still that)
    needed: float | None = None


@dataclass
class _Gpu:
    used: float = 0.0
    whole: bool = False
    tenants: list[str] = field(default_factory=list)


def pack(needs: Sequence[ModelNeed], res: Resources) -> PackingPlan:
    """The plan for ``needs`` on ``res``; ``UsageError`` for a model that fits nowhere or beyond the job limit."""
    if not needs:
        raise UsageError("no model to plan")
    if res.gpus_per_node < 1:  # a CPU profile: every model in one job, on the node's CPUs
        rows = [Placement(n.served, n.model, n.preset, 1, 0, (), None, res.port + k, n.weights_gb)
                for k, n in enumerate(sorted(needs, key=lambda n: n.served))]
        return PackingPlan(1, res, tuple(rows))
    fits = sorted((_fit(n, res) for n in needs), key=lambda f: (-f.tp, -(f.share or 0.0), f.need.served))
    jobs: list[list[list[_Gpu]]] = []
    placed: list[tuple[_Fit, int, int, tuple[int, ...]]] = []
    for fit in fits:
        spot = _find(jobs, fit) or _find_swap(placed, fit, res)
        if spot is None:
            if res.max_jobs and len(jobs) >= res.max_jobs:
                raise UsageError(f"model {fit.need.served}: no room left in {len(jobs)} job(s), the profile's "
                                 f"max_running_jobs; serve fewer models or raise it")
            jobs.append([[_Gpu() for _ in range(res.gpus_per_node)] for _ in range(res.nodes_per_job)])
            spot = _find(jobs, fit)
            assert spot is not None  # _fit refused what no empty node holds
        job, node, gpus = spot
        for g in gpus:
            cell = jobs[job][node][g]
            cell.used += fit.share if fit.shared and fit.share is not None else 1.0
            cell.whole = cell.whole or not fit.shared or cell.used > SHARE_CAP + 1e-9  # a swap set: no more tenants
            cell.tenants.append(fit.need.served)
        placed.append((fit, job, node, gpus))
    return PackingPlan(len(jobs), res, _with_ports(_fill(_swap_shares(placed, res)), res))


def _fit(need: ModelNeed, res: Resources) -> _Fit:
    """The model's GPUs and share, or the one-line refusal of a model no node holds."""
    largest = f"one node of {res.gpus_per_node} GPU(s)" + (f" x {res.gpu_memory_gb} GB" if res.gpu_memory_gb else "")
    alone = f"serve it on its own (pbstk serve {need.model})"
    if need.gpus is not None:
        if need.gpus > res.gpus_per_node:
            raise UsageError(f"model {need.served}: preset {need.preset} needs {need.gpus} GPUs, more than the "
                             f"largest GPU set here, {largest}; {alone}")
        return _Fit(need, need.gpus, res.utilization, shared=False, want=_want(need, need.gpus, res))
    weights = need.weights_gb
    if need.params_b is None or weights is None:
        raise UsageError(f"model {need.served}: size unknown (no config.json or weights index readable here, no "
                         f"size in its name), so it cannot be packed; give it a preset ({need.model}:preset=tp2)")
    if not res.gpu_memory_gb:  # memory unknown: the parameter-count rule, whole GPUs
        try:
            tp, _, _ = auto_layout(need.params_b, res.gpus_per_node)
        except UsageError:
            raise UsageError(f"model {need.served}: {need.params_b:.1f}B needs more GPUs than the largest GPU set "
                             f"here, {largest}; {alone}") from None
        return _Fit(need, tp, res.utilization, shared=False)
    want = _per_gpu_gb(need, 1) / res.gpu_memory_gb  # the utilization that leaves its KV cache room
    if want <= SHARE_CAP:
        share = round(min(_rounded(want), SHARE_CAP), 2)
        return _Fit(need, 1, share, shared=True, want=share)
    too_big = UsageError(f"model {need.served}: {weights:.0f} GB of weights need {weights / WEIGHTS_SHARE:.0f} GB "
                         f"of GPU memory (weights at most {WEIGHTS_SHARE:.0%}), more than the largest GPU set "
                         f"here, {largest}; {alone}")
    try:
        size = auto_by_memory(need.params_b, need.bytes_per_param, need.dtype_note, res.gpu_memory_gb,
                              res.utilization, res.gpus_per_node, 1)
    except UsageError:
        raise too_big from None
    if size.pp > 1 or size.nnodes > 1:
        raise too_big
    return _Fit(need, size.tp, res.utilization, shared=False, want=_want(need, size.tp, res))


def _rounded(want: float) -> float:
    """A share: ``want`` rounded up to ``SHARE_STEP``, at least ``MIN_SHARE``."""
    return max(MIN_SHARE, math.ceil(round(want / SHARE_STEP, 6)) * SHARE_STEP)


def _want(need: ModelNeed, tp: int, res: Resources) -> float:
    """What a model of ``tp`` GPUs needs of each (:func:`_per_gpu_gb`) as a share, for a swap set;
    ``SHARE_CAP`` (a set of its own) when its size or the GPUs' memory is unknown."""
    if need.weights_gb is None or not res.gpu_memory_gb:
        return SHARE_CAP
    return round(min(_rounded(_per_gpu_gb(need, tp) / res.gpu_memory_gb), SHARE_CAP), 2)


def _per_gpu_gb(need: ModelNeed, tp: int) -> float:
    """GB a model of known weights needs of each of its ``tp`` GPUs: its weights at most ``WEIGHTS_SHARE``, and
    at least room for its weights, one full-length request's KV cache (``KV_MARGIN`` of it) and activations."""
    weights = need.weights_gb or 0.0
    by_share = weights / tp / WEIGHTS_SHARE
    if need.kv_gb is None:
        return by_share
    return max(by_share, (weights + need.kv_gb * KV_MARGIN) / tp + ACTIVATION_GB)


def _swap_fits(wants: list[float], res: Resources) -> bool:
    """Whether models needing ``wants`` share one GPU set with at most ``res.max_awake`` awake: the largest
    ones awake, the others asleep (``ASLEEP_GB`` each)."""
    awake = sorted(wants, reverse=True)[: res.max_awake]
    asleep = (len(wants) - len(awake)) * ASLEEP_GB / res.gpu_memory_gb
    return sum(awake) + asleep <= SHARE_CAP + 1e-9


def _find_swap(placed: list[tuple[_Fit, int, int, tuple[int, ...]]], fit: _Fit,
               res: Resources) -> tuple[int, int, tuple[int, ...]] | None:
    """With swapping: the first GPU set (job, node, GPUs) of ``fit``'s size whose models and ``fit`` swap there."""
    if not res.max_awake or not res.gpu_memory_gb:
        return None
    sets: dict[tuple[int, int, tuple[int, ...]], list[float]] = {}
    for other, job, node, gpus in placed:
        sets.setdefault((job, node, gpus), []).append(other.want)
    for spot in sorted(sets):
        if len(spot[2]) == fit.tp and _swap_fits([*sets[spot], fit.want], res):
            return spot
    return None


def _swap_shares(placed: list[tuple[_Fit, int, int, tuple[int, ...]]],
                 res: Resources) -> list[tuple[_Fit, int, int, tuple[int, ...]]]:
    """The shares of the models that joined a GPU set by :func:`_find_swap` (several whole-GPU models, or more
    than fit awake): each its need plus an equal part of what the awake ones (at most ``res.max_awake``) and
    the sleepers (``ASLEEP_GB`` each) leave, rounded down to 0.01; ``swap`` where more than K share the set."""
    sets: dict[tuple[int, int, tuple[int, ...]], list[_Fit]] = {}
    for fit, job, node, gpus in placed:
        sets.setdefault((job, node, gpus), []).append(fit)
    out = []
    for fit, job, node, gpus in placed:
        members = sets[(job, node, gpus)]
        joined = len(members) > 1 and (any(not m.shared for m in members)
                                       or sum(m.share or 0.0 for m in members) > SHARE_CAP + 1e-9)
        if not res.max_awake or not joined:
            out.append((fit, job, node, gpus))
            continue
        wants = sorted((m.want for m in members), reverse=True)
        k = min(res.max_awake, len(wants))
        slack = (SHARE_CAP - sum(wants[:k]) - (len(wants) - k) * ASLEEP_GB / res.gpu_memory_gb) / k
        share = math.floor(round((fit.want + max(0.0, slack)) * 100, 6)) / 100
        out.append((replace(fit, share=share, shared=True, swap=len(wants) > k), job, node, gpus))
    return out


def _fill(placed: list[tuple[_Fit, int, int, tuple[int, ...]]]) -> list[tuple[_Fit, int, int, tuple[int, ...]]]:
    """Each shared GPU given out whole: the models on it (not a swap set, whose shares :func:`_swap_shares`
    set) get ``SHARE_CAP`` of it between them, each in proportion to what it needs (its weights and one request's
    KV cache: the rest is KV cache, more for the larger need), rounded down to 0.01. On one H200 a 0.6B and a
    1.7B got 0.10 each and 0.8 of the GPU stayed unused: KV cache neither could use."""
    tenants: dict[tuple[int, int, tuple[int, ...]], list[_Fit]] = {}
    for fit, job, node, gpus in placed:
        if fit.shared and not fit.swap and fit.share is not None:
            tenants.setdefault((job, node, gpus), []).append(fit)
    given: dict[str, float] = {}
    for on in tenants.values():
        given.update(_proportional([f.need.served for f in on], [f.share or 0.0 for f in on], SHARE_CAP))
    return [(replace(fit, share=given[fit.need.served], needed=fit.share) if fit.need.served in given else fit,
             job, node, gpus) for fit, job, node, gpus in placed]


def _proportional(names: list[str], weights: list[float], total: float) -> dict[str, float]:
    """``total`` split in proportion to ``weights``, in hundredths that add up to it exactly (each rounded down,
    the hundredths left over to the largest remainders)."""
    exact = [total * w / sum(weights) * 100 for w in weights]
    cents = [math.floor(round(x, 6)) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: cents[i] - exact[i])[:round(total * 100) - sum(cents)]:
        cents[i] += 1
    return {name: c / 100 for name, c in zip(names, cents)}


def _find(jobs: list[list[list[_Gpu]]], fit: _Fit) -> tuple[int, int, tuple[int, ...]] | None:
    """The first (job, node, GPUs) with room for ``fit``, in job, node, GPU order."""
    for j, nodes in enumerate(jobs):
        for n, gpus in enumerate(nodes):
            if fit.shared:
                share = fit.share or 0.0
                for g, cell in enumerate(gpus):
                    if not cell.whole and cell.used + share <= SHARE_CAP + 1e-9:
                        return j, n, (g,)
                continue
            free = [g for g, cell in enumerate(gpus) if not cell.tenants]
            if len(free) >= fit.tp:
                return j, n, tuple(free[: fit.tp])
    return None


def _with_ports(placed: list[tuple[_Fit, int, int, tuple[int, ...]]], res: Resources) -> tuple[Placement, ...]:
    """The placements in (job, node, first GPU, served name) order, each job's models on ports from
    ``res.port`` up."""
    order = sorted(placed, key=lambda p: (p[1], p[2], p[3], p[0].need.served))
    rows: list[Placement] = []
    next_port: dict[int, int] = {}
    for fit, job, node, gpus in order:
        port = next_port.get(job, res.port)
        next_port[job] = port + 1
        n = fit.need
        rows.append(Placement(n.served, n.model, n.preset, job + 1, node, gpus, fit.share, port, n.weights_gb,
                              swap=fit.swap, need=fit.share if fit.needed is None else fit.needed))
    return tuple(rows)
