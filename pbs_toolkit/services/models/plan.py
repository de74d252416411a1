"""The plan of a multi-model service (issue 31; docs/multi-model.md): each model sized as ``auto`` sizes one
(offline, from what is readable here), then packed into jobs by services/models/packing.py. What ``pbstk serve M1 M2
--dry-run`` prints; it writes, submits and records nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.plan import model_size, plan_layout, resolve_model
from pbs_toolkit.schema import stamp
from pbs_toolkit.services.models.packing import ModelNeed, PackingPlan, Placement, Resources, pack
from pbs_toolkit.services.models.spec import ModelSpec
from pbs_toolkit.services.record import check_name
from pbs_toolkit.settings.launch_settings import LaunchSettings, RenderRequest, resolve_launch_settings
from pbs_toolkit.settings.layout import DEFAULT_MEMORY_UTILIZATION, bytes_per_param
from pbs_toolkit.settings.layout_flags import refuse_layout_flags
from pbs_toolkit.settings.model_size import model_weights
from pbs_toolkit.settings.presets import context_length, kv_bytes_per_token, load_preset
from pbs_toolkit.settings.vllm_overrides import flag_value, int_flag

#: the table ``serve --dry-run`` prints, one row per model (and ``SWAP`` when models swap: ``serve --max-awake``)
HEADERS = ["MODEL", "JOB", "NODE/GPUS", "MEMORY", "PORT", "PRESET"]


@dataclass(frozen=True)
class ModelPlan:
    """Where each model of service ``name`` would run."""

    name: str
    profile: str
    packing: PackingPlan

    def to_dict(self) -> dict[str, Any]:
        res = self.packing.resources
        models = [{"served_model_name": p.served, "model": p.model, "preset": p.preset, "job": p.job,
                   "node": p.node, "gpus": list(p.gpus), "tensor_parallel": p.tensor_parallel,
                   "gpu_memory_utilization": p.share, "gpu_memory_needed": p.need,
                   "memory_gb": p.memory_gb(res.gpu_memory_gb),
                   "weights_gb": None if p.weights_gb is None else round(p.weights_gb, 2), "port": p.port,
                   "swap": p.swap}
                  for p in self.packing.placements]
        return stamp("model_plan", {"name": self.name, "profile": self.profile, "dry_run": True,
                                    "jobs": self.packing.jobs, "nodes_per_job": res.nodes_per_job,
                                    "gpus_per_node": res.gpus_per_node, "gpu_memory_gb": res.gpu_memory_gb or None,
                                    "max_awake": res.max_awake or None, "models": models})

    @property
    def swaps(self) -> bool:
        return any(p.swap for p in self.packing.placements)

    def headers(self) -> list[str]:
        return [*HEADERS, "SWAP"] if self.swaps else list(HEADERS)

    def rows(self) -> list[list[str]]:
        """The table's rows (:data:`HEADERS`)."""
        res = self.packing.resources
        out = []
        for p in self.packing.placements:
            shown = p.served if p.served == p.model else f"{p.served} ({p.model})"
            where = f"n{p.node}:" + (",".join(str(g) for g in p.gpus) if p.gpus else "cpu")
            memory = "-" if p.share is None else f"{p.share:.2f}"
            if (gb := p.memory_gb(res.gpu_memory_gb)) is not None:
                memory += f" ({gb:g} GB)"
            # what runs: an `auto` model of a packed job takes the layout of its own GPUs (jobs/render.py)
            preset = f"auto (TP{p.tensor_parallel})" if p.preset == "auto" and p.gpus else p.preset
            row = [shown, f"job{p.job}", where, memory, str(p.port), preset]
            if self.swaps:
                row.append(f"<= {res.max_awake} awake" if p.swap else "-")
            out.append(row)
        return out


def plan_service(specs: Sequence[ModelSpec], request: RenderRequest, name: str, max_awake: int = 0,
                 replicas: int = 1) -> ModelPlan:
    """Size ``specs`` (each with the settings ``request`` resolves for it) and pack them on its profile; with
    ``max_awake`` K, models that fit nowhere awake swap on shared GPUs, at most K awake (services/models/packing.py).
    One model is served as ``replicas`` copies of its own launch: the plan is then that launch's, each copy a job
    of the preset's GPUs and memory share (:func:`plan_replicas`)."""
    check_name(name)
    if len(specs) == 1 and not max_awake:
        return plan_replicas(specs[0], request, name, replicas)
    needs, profile = [], None
    for spec in specs:
        settings = resolve_launch_settings(replace(request, model=spec.model, preset=spec.preset or request.preset))
        profile = profile or settings.written
        needs.append(_need(spec, settings))
    assert profile is not None
    port = int(request.port) if isinstance(request.port, (int, str)) and str(request.port).isdigit() else profile.port
    if max_awake and not profile.gpus_per_node:
        raise UsageError(f"--max-awake: profile {profile.name} has no GPUs; models swap on GPUs only (vLLM's sleep "
                         "mode is not supported on CPU)")
    if max_awake and not profile.gpu_memory_gb:
        raise UsageError(f"--max-awake: profile {profile.name} has no gpu_memory_gb; pbstk needs the GPUs' memory "
                         "to plan which models swap (add gpu_memory_gb: N to the profile)")
    res = Resources(gpus_per_node=profile.gpus_per_node, gpu_memory_gb=profile.gpu_memory_gb,
                    nodes_per_job=profile.nodes, max_jobs=profile.max_running_jobs, port=port, max_awake=max_awake)
    return ModelPlan(name=name, profile=profile.name, packing=pack(needs, res))


def plan_replicas(spec: ModelSpec, request: RenderRequest, name: str, replicas: int) -> ModelPlan:
    """The plan of one model served alone: each of its ``replicas`` is one job of exactly what its launch runs
    (the preset ``auto`` sizes for the profile's nodes: ``auto (DP4)`` on GPUs 0-3 at 0.95 each), not the share
    a packed model would get (``serve M --dry-run`` once showed one GPU at 0.15, then ran DP4 at 0.95)."""
    settings = resolve_launch_settings(replace(request, model=spec.model, preset=spec.preset or request.preset))
    profile = settings.written
    preset, nodes, params = plan_layout(settings)
    refuse_layout_flags(settings.request.vllm_args, preset)
    per_node = preset.gpus // max(1, nodes.nnodes) if preset.device == "gpu" else 0
    util = preset.vllm_args.get("--gpu-memory-utilization", DEFAULT_MEMORY_UTILIZATION)
    share = float(util) if per_node and isinstance(util, (int, float, str)) and not isinstance(util, bool) else None
    port = int(request.port) if isinstance(request.port, (int, str)) and str(request.port).isdigit() else profile.port
    weights = None if params is None else params * bytes_per_param(None)[0]
    rows = tuple(Placement(spec.served_model_name, spec.model, preset.name, job, 0, tuple(range(per_node)), share,
                           port, weights, need=share) for job in range(1, max(1, replicas) + 1))
    res = Resources(gpus_per_node=per_node, gpu_memory_gb=profile.gpu_memory_gb, nodes_per_job=nodes.nnodes,
                    max_jobs=profile.max_running_jobs, port=port)
    return ModelPlan(name=name, profile=profile.name, packing=PackingPlan(len(rows), res, rows))


def _need(spec: ModelSpec, settings: LaunchSettings) -> ModelNeed:
    """What one model asks: a named preset's GPUs, or ``auto``'s size from its weights, config.json or name."""
    profile = settings.written
    preset = load_preset(settings.preset_name)
    refuse_layout_flags(settings.request.vllm_args, preset)  # the plan packs the preset's GPUs, not the flag's
    if (preset.device == "cpu") != (profile.gpus_per_node == 0):
        has = f"{profile.gpus_per_node} GPU(s) per node" if profile.gpus_per_node else "no GPUs"
        raise UsageError(f"model {spec.served_model_name}: preset {preset.name} runs on {preset.device.upper()} "
                         f"but profile {profile.name} has {has}")
    if not preset.auto:
        return ModelNeed(spec.served_model_name, spec.model, preset.name,
                         gpus=preset.gpus if preset.device == "gpu" else None)
    path, config = resolve_model(spec.model, None, remote_offline=bool(profile.ssh_host), hf_home=profile.hf_home)
    params, config = model_size(spec.model, config, model_weights(spec.model, path, None))
    size, note = bytes_per_param(config)
    return ModelNeed(spec.served_model_name, spec.model, "auto", params_b=params, bytes_per_param=size,
                     dtype_note=note, kv_gb=_one_request_kv_gb(config, settings.request.vllm_args))


def _one_request_kv_gb(config: dict[str, Any] | None, vllm_args: Sequence[str]) -> float | None:
    """GB of KV cache one request of the model's full length takes (``--max-model-len`` when given, else the
    config's): vLLM refuses to start without room for it, so a packed model's share must hold it."""
    fp8 = (flag_value(vllm_args, "--kv-cache-dtype") or "").startswith("fp8")
    per_token = kv_bytes_per_token(config, 1 if fp8 else 2) if config else None
    length = int_flag(vllm_args, "--max-model-len") or (context_length(config) if config else None)
    return None if per_token is None or length is None else round(per_token * length / 1e9, 3)
