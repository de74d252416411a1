"""How a layout spreads over nodes: the node count, the vLLM engine that spans them, and ``auto`` sizing by weights.

A preset states TP x PP x DP; the profile states GPUs per node, the vLLM version and the preferred multi-node
engine. :func:`node_plan` turns both into a :class:`NodePlan` (what the start script header renders), or a
``UsageError`` naming the problem before anything is submitted: a layout that needs a newer vLLM would otherwise
fail on the nodes, an hour later in the queue. Contract: issue 14, ``docs/vllm.md`` "Several nodes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.settings.profiles import MAX_NODES
from pbs_toolkit.settings.vllm_flags import version_tuple

#: first vLLM with each multi-node engine (FACTS "Scale": from vLLM's sources)
MIN_NATIVE_DP = (0, 9, 0)  # --headless, --data-parallel-size-local/-address/-rpc-port/-start-rank
MIN_RAY_DP = (0, 9, 1)  # --data-parallel-backend ray
MIN_NNODES = (0, 11, 1)  # --nnodes, --node-rank, --master-addr, --master-port
ENGINES = ("single", "dp", "nnodes", "ray")
#: weights may take this share of the memory vLLM is allowed to use; the rest is KV cache and activations
WEIGHTS_SHARE = 0.7
DEFAULT_MEMORY_UTILIZATION = 0.95


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


@dataclass(frozen=True)
class NodePlan:
    """One launch's spread over nodes, as the start script header states it (``NNODES``, ``NODE_ENGINE``, ...)."""

    nnodes: int
    engine: str  # one of ENGINES
    tp: int
    pp: int
    dp: int
    #: data-parallel ranks per node (engine ``dp``); ``dp`` on one node
    dp_local: int
    launcher: str
    nccl_ifname: str = ""
    gloo_ifname: str = ""

    def spread(self) -> str:
        """`` on 2 nodes x 2 GPUs`` for a layout over several nodes (what the first line of ``launch``,
        ``--dry-run`` and ``render`` adds, so a preset widened by ``--gpus-per-node`` is never a surprise);
        empty on one node."""
        if self.nnodes <= 1:
            return ""
        return f" on {self.nnodes} nodes x {self.tp * self.pp * self.dp // self.nnodes} GPUs"

    def parallel_args(self) -> list[str]:
        """The layout's vLLM flags that are the same on every node (rank-specific ones are the start script's).

        single: ``--tensor-parallel-size``/``--pipeline-parallel-size``/``--data-parallel-size`` when > 1 (as
        before multi-node); dp: those plus ``--data-parallel-size-local``; nnodes: TP/PP when > 1; ray: TP/PP
        when > 1 and ``--distributed-executor-backend ray``, or for DP ``--data-parallel-size``
        ``--data-parallel-backend ray``."""
        args: list[str] = []
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.pp > 1:
            args += ["--pipeline-parallel-size", str(self.pp)]
        if self.dp > 1:
            args += ["--data-parallel-size", str(self.dp)]
        if self.engine == "dp":
            args += ["--data-parallel-size-local", str(self.dp_local)]
        elif self.engine == "ray":
            args += ["--data-parallel-backend", "ray"] if self.dp > 1 else ["--distributed-executor-backend", "ray"]
        return args

    def to_dict(self) -> dict[str, Any]:
        return {"nnodes": self.nnodes, "engine": self.engine, "tensor_parallel": self.tp,
                "pipeline_parallel": self.pp, "data_parallel": self.dp, "data_parallel_local": self.dp_local,
                "launcher": self.launcher}


def nodes_needed(name: str, layout: str, gpus: int, gpus_per_node: int, nodes_asked: int | None,
                 asked_as: str, *, widen: bool = True) -> int:
    """Nodes for a preset of ``gpus`` GPUs on nodes of ``gpus_per_node``; ``nodes_asked`` (``--nodes``, config or
    profile) must agree. A preset smaller than one node stays on one node. ``widen=False`` (the local scheduler,
    whose "nodes" are stand-ins on one host): several nodes only when asked for; else one, and the caller's GPU
    count check refuses the preset as before."""
    if gpus <= gpus_per_node or gpus_per_node == 0 or not widen and nodes_asked is None:
        needed = 1
    elif gpus % gpus_per_node:
        raise UsageError(f"preset {name} ({layout}) needs {gpus} GPUs, not a whole number of nodes of "
                         f"{gpus_per_node} GPUs; pick a preset that fills its nodes or pass --gpus-per-node")
    else:
        needed = gpus // gpus_per_node
    if nodes_asked is not None and nodes_asked != needed and (needed > 1 or nodes_asked > 1):
        raise UsageError(f"preset {name} ({layout}) needs {gpus} GPUs = {needed} node(s) of {gpus_per_node} GPUs; "
                         f"{asked_as} {nodes_asked} gives {nodes_asked * gpus_per_node}")
    return needed


def node_plan(name: str, tp: int, pp: int, dp: int, nnodes: int, profile: Any) -> NodePlan:
    """The engine that runs TP x PP x DP over ``nnodes`` nodes of ``profile``, checked against its vLLM version."""
    backend = backend_class(profile.scheduler)
    launcher = backend.fixed_node_launcher or profile.node_launcher or backend.default_node_launcher
    common = {"tp": tp, "pp": pp, "dp": dp, "launcher": launcher, "nccl_ifname": profile.nccl_socket_ifname,
              "gloo_ifname": profile.gloo_socket_ifname}
    if nnodes <= 1:
        return NodePlan(nnodes=1, engine="single", dp_local=dp, **common)
    version = version_tuple(profile.vllm_version)
    per_node = profile.gpus_per_node
    replica_fits_node = tp * pp <= per_node and dp % nnodes == 0
    if replica_fits_node:
        engine, minimum, what = "dp", MIN_NATIVE_DP, "data parallelism"
    elif dp > 1:
        raise UsageError(f"preset {name} spans {nnodes} nodes with replicas of TP{tp} x PP{pp} = {tp * pp} GPUs on "
                         f"nodes of {per_node}: data parallelism over multi-node replicas is not supported; "
                         "pick a preset with one replica, or replicas that fit one node")
    else:
        engine, minimum, what = "nnodes", MIN_NNODES, "tensor/pipeline parallelism"
    if profile.multinode_engine == "ray":
        engine, minimum = "ray", MIN_RAY_DP if engine == "dp" else (0, 0, 0)
        if version < minimum:
            raise UsageError(f"preset {name} spans {nnodes} nodes with {what} over Ray, which needs vLLM >= "
                             f"{_version_text(minimum)} (profile says {profile.vllm_version}); set vllm_version")
    elif version < minimum:
        ray_ok = version >= (MIN_RAY_DP if engine == "dp" else (0, 0, 0))
        raise UsageError(f"preset {name} spans {nnodes} nodes with {what}, which needs vLLM >= "
                         f"{_version_text(minimum)} (profile says {profile.vllm_version}); set vllm_version"
                         + (", or multinode_engine: ray" if ray_ok else ""))
    return NodePlan(nnodes=nnodes, engine=engine, dp_local=dp // nnodes if dp >= nnodes else 1, **common)


# --- auto by weights ----------------------------------------------------------------------------------


def bytes_per_param(config: dict[str, Any] | None) -> tuple[float, str]:
    """(bytes per weight, where that came from) from ``config.json``: fp8 quantization 1, ``torch_dtype``
    float32 4, bfloat16/float16 2, float8 1; unknown 2 (the usual bf16 checkpoint)."""
    if not config:
        return 2.0, "bf16 assumed"
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return 1.0, "fp8"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "").lower()
    for prefix, size in (("float32", 4.0), ("bfloat16", 2.0), ("float16", 2.0), ("float8", 1.0)):
        if dtype.startswith(prefix):
            return size, dtype
    return 2.0, "bf16 assumed"


def _tp_choices(gpus_per_node: int) -> list[int]:
    sizes = [1 << k for k in range(8) if (1 << k) <= gpus_per_node and gpus_per_node % (1 << k) == 0]
    return sizes if gpus_per_node in sizes else [*sizes, gpus_per_node]


@dataclass(frozen=True)
class AutoSize:
    """``auto`` sized by weights: the layout and the sentence with the numbers (``presets show``)."""

    tp: int
    pp: int
    dp: int
    nnodes: int
    why: str


def auto_by_memory(params_b: float, bytes_each: float, dtype_note: str, gpu_memory_gb: int, utilization: float,
                   gpus_per_node: int, nodes_asked: int | None) -> AutoSize:
    """The smallest TP (1, 2, 4, ... up to a node) whose weights stay within ``WEIGHTS_SHARE`` of the usable
    memory; if a whole node is too small, TP = the node x PP over the nodes needed; DP over the GPUs left."""
    if gpus_per_node < 1:
        raise UsageError("preset auto needs GPUs; use --preset cpu on a machine without GPUs")
    weights = params_b * bytes_each
    usable = gpu_memory_gb * utilization
    node = gpus_per_node * usable
    head = (f"{params_b:.1f}B x {bytes_each:g} bytes ({dtype_note}) = {weights:.0f} GB; a node holds "
            f"{gpus_per_node} x {gpu_memory_gb} GB x {utilization:g} = {node:.0f} GB; weights must stay <= "
            f"{WEIGHTS_SHARE:.0%}")
    for tp in _tp_choices(gpus_per_node):
        if weights <= WEIGHTS_SHARE * usable * tp:
            nodes = nodes_asked or 1
            dp = nodes * gpus_per_node // tp
            layout = f"TP{tp} x DP{dp}" if tp > 1 else f"DP{dp}"
            where = f" over {nodes} nodes" if nodes > 1 else ""
            room = f"TP{tp} holds {WEIGHTS_SHARE:.0%} x {tp} x {usable:.0f} = {WEIGHTS_SHARE * usable * tp:.0f} GB"
            return AutoSize(tp, 1, dp, nodes, f"{head}; {room} -> {layout}{where}")
    pp = math.ceil(weights / (WEIGHTS_SHARE * node))
    if pp > MAX_NODES:
        raise UsageError(f"preset auto: {head}, so one replica would need {pp} nodes; that is not a model to serve "
                         "here (check the model's size)")
    if nodes_asked is not None and nodes_asked != pp:
        problem = "is too few" if nodes_asked < pp else "would need DP over multi-node replicas (not supported)"
        raise UsageError(f"preset auto: {head}, so one replica needs TP{gpus_per_node} x PP{pp} over {pp} nodes; "
                         f"--nodes {nodes_asked} {problem}; pass --nodes {pp}")
    return AutoSize(gpus_per_node, pp, 1, pp, f"{head} -> TP{gpus_per_node} x PP{pp} over {pp} nodes")
