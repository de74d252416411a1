"""What the start script's cold start part (``server/start/coldstart.sh``) needs from a render, and the container
command it will run, spelled out for ``render`` and ``doctor`` (docs/coldstart.md).

The compile cache's key is finished in the job (torch and vLLM versions come from the job's own Python); the
parts only the render knows (model, layout) are rendered into the settings header here.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from typing import Any

#: container runtimes pbstk knows (the same ``exec --nv --bind`` syntax)
CONTAINER_RUNTIMES = ("apptainer", "singularity")


def model_key(model: str) -> str:
    """``Qwen/Qwen3-1.7B`` -> ``qwen3-1.7b-<8 hex>``: readable, and two models of one name in different places
    (two paths, or a path and a hub id) never share a cache."""
    base = re.sub(r"[^a-z0-9_.-]+", "-", model.rstrip("/").split("/")[-1].lower()).strip("-.") or "model"
    digest = hashlib.sha256(model.encode("utf-8")).hexdigest()[:8]
    return f"{base[:48]}-{digest}"


def layout_key(layout: str, nnodes: int, variant: str = "") -> str:
    """``TP2xDP2`` (one node), ``TP8xPP2-2n``, ``DP2-text-only``: a different layout compiles different graphs, and
    so does a vision-language model served text-only (``variant``): vLLM 0.22.1's cache key leaves its multimodal
    limits out, and a text-only start that loaded the graphs an image-enabled start saved died in its first forward
    pass (``'NoneType' object has no attribute 'size'``: the deepstack input that text-only leaves out)."""
    key = layout if nnodes <= 1 else f"{layout}-{nnodes}n"
    return f"{key}-{variant}" if variant else key


def stage_dir(profile: Any) -> str:
    """The node-local weight copy's directory (the ``stage_to`` profile key; empty when absent). In the job it is
    ``STAGE_TO``, set by server/stage_copy.sh's settings when the key is."""
    return str(profile.stage_to or "")


def coldstart_context(model: str, layout: str, nnodes: int, profile: Any, variant: str = "") -> dict[str, Any]:
    """The template variables of the header's cold-start lines (``variant``: see :func:`layout_key`)."""
    return {
        "cache_key_model": model_key(model), "cache_key_layout": layout_key(layout, nnodes, variant),
        "container_image": profile.container or "", "container_runtime": profile.container_runtime,
    }


def container_prefix(profile: Any, run_dir: str, model_path: str) -> list[str]:
    """``apptainer exec --nv --bind DIR ... IMAGE``, as ``pbstk_container_prefix`` builds it in the job (a model
    directory is bound when it exists there; an absolute model path stands for one here)."""
    binds: list[str] = []
    for directory in (run_dir, profile.hf_home, profile.vllm_cache_root, stage_dir(profile)):
        if directory:
            binds += ["--bind", directory]
    if model_path.startswith("/"):
        binds += ["--bind", model_path]
    return [profile.container_runtime, "exec", "--nv", *binds, profile.container]


def container_command(profile: Any, run_dir: str, model_path: str, vllm_args: list[str]) -> list[str] | None:
    """The command the job starts vLLM with (before ``--host``/``--port``, which it picks at start), or ``None``
    without a container."""
    if not getattr(profile, "container", None):
        return None
    if profile.vllm_entrypoint == "api_server":
        vllm = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    else:
        vllm = ["vllm", "serve", model_path]
    return [*container_prefix(profile, run_dir, model_path), *vllm, *vllm_args]


def container_note(command: list[str] | None) -> list[str]:
    """A render note quoting the container command exactly (every value shell-quoted)."""
    if not command:
        return []
    return ["vLLM starts in a container: " + shlex.join(command) + " --host ... --port ... (picked at start)"]
