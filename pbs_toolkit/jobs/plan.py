"""Plan one launch from its resolved settings: the model, the concrete preset (``auto`` sized), the nodes and
engine, vLLM's arguments, the job's environment, port and run directory, all checked.

:func:`plan_launch` is the step between the settings (settings/launch_settings.py, resolved once) and the
scripts (render.py): it reads no profile or preset file but the preset it chooses, and computes no text.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.server.coldstart import container_command, container_note
from pbs_toolkit.server.phases import bash_assignments
from pbs_toolkit.settings.front_servers import front_preset
from pbs_toolkit.settings.launch_settings import LaunchSettings, NodesAsked, RenderRequest, settings_of
from pbs_toolkit.settings.layout import (
    DEFAULT_MEMORY_UTILIZATION,
    NodePlan,
    auto_by_memory,
    bytes_per_param,
    node_plan,
    nodes_needed,
)
from pbs_toolkit.settings.layout_flags import refuse_layout_flags
from pbs_toolkit.settings.model_size import UNKNOWN_SIZE_NOTE, hf_cache_config, hub_lookup, json_file, model_weights
from pbs_toolkit.settings.multimodal import multimodal_preset, text_only_setting
from pbs_toolkit.settings.presets import Preset, load_preset, params_from_config, params_from_name, resolve_auto
from pbs_toolkit.settings.profiles import Profile, walltime_seconds
from pbs_toolkit.settings.vllm_flags import check_env, check_flag, flag_name, is_automatic, version_tuple
from pbs_toolkit.settings.vllm_overrides import apply_overrides
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.weights.nodecopy import STAGE_SETTINGS

#: Hugging Face repository ids: ``org/name`` or ``name``
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
#: Hugging Face limits organisation and repository names to 96 characters each
_HF_PART_MAX = 96
_JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: run directories appear unquoted in job-script directives (output paths; ``:`` would read as host:path)
RUN_DIR_RE = re.compile(r"/[A-Za-z0-9_./@+~-]+")
#: flags pbstk sets itself; passing them through --vllm-arg would fight the start script
_OWNED_FLAGS = {"--host", "--port", "--model", "--api-key"}
#: the start script's settings header (a template next to the start script's static body)
START_HEADER = "start_vllm.sh.j2"
SERVER_DIR = Path(__file__).resolve().parent.parent / "server"
_SETTING = re.compile(r"^([A-Z_][A-Z0-9_]*)=", re.MULTILINE)
#: what a remote home stands for in a script rendered without connecting (its shell expands it)
HOME_VAR = "$HOME"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the scripts state about one launch, checked."""

    model: str
    #: what vLLM receives (a local directory made absolute)
    model_path: str
    preset: Preset
    #: the profile fitted to the preset (nodes, GPUs) with its paths expanded where the job runs
    profile: Profile
    nodes: NodePlan
    params_b: float | None
    job_name: str
    served_model_name: str
    walltime: str
    vllm_args: list[str]
    notes: list[str]
    env: dict[str, str]
    port: int
    fixed_port: bool
    run_dir: str
    #: the container command vLLM starts with (server/coldstart.py), ``None`` without a container
    container_command: list[str] | None = None
    #: the lease of ``pbstk run`` in seconds (the start script's ``LEASE_S``, server/start/lease.sh); 0: none
    lease_s: int = 0


def plan_launch(settings: LaunchSettings, runner: Runner | None = None) -> LaunchPlan:
    """The plan for ``settings``, through ``runner`` (``None``: connecting nowhere). Raises ``UsageError``/
    ``ConfigError`` on bad input, always the first problem in a fixed order (profile, walltime, model, preset,
    names, flags, env, port, run directory)."""
    req = settings.request
    profile = settings.launchable()
    walltime = normalised_walltime(profile)
    model_path, config = resolve_model(req.model, runner, remote_offline=runner is None and bool(profile.ssh_host),
                                       hf_home=profile.hf_home)
    preset, params = _choose_preset(req, profile, settings.preset_name, config, settings.nodes_asked,
                                    model_weights(req.model, model_path, runner))
    profile = _fit_profile_to_preset(profile, preset, settings.gpus_given, settings.nodes_asked)
    nodes = node_plan(preset.name, preset.tensor_parallel, preset.pipeline_parallel, preset.data_parallel,
                      profile.nodes, profile)
    version = version_tuple(profile.vllm_version)
    text_only = text_only_setting(profile.text_only, settings.sources["text_only"], preset)
    preset, mm_notes = multimodal_preset(preset, req.model, config, version, text_only)  # settings/multimodal.py
    preset, front_notes = front_preset(preset, req.vllm_args, preset.name.startswith("auto ("))
    mm_notes += front_notes
    job_name = _job_name(req)
    served = served_model_name(req.model, req.served_model_name, job_name)
    args, notes = _vllm_args(req, preset, profile, served, version, nodes)
    notes = mm_notes + notes
    if params is None and preset.name.startswith("auto ("):
        notes.insert(0, UNKNOWN_SIZE_NOTE)
    env = _job_env(req, profile, preset, version)
    port, fixed_port = _port(req, profile)
    run_dir = _run_dir(req, profile, job_name, runner)
    profile = _expand_profile_paths(profile, runner)
    container = container_command(profile, run_dir, model_path, args)  # docs/coldstart.md
    notes += container_note(container)
    return LaunchPlan(model=req.model, model_path=model_path, preset=preset,
                      profile=profile, nodes=nodes, params_b=params,
                      job_name=job_name, served_model_name=served, walltime=walltime, vllm_args=args, notes=notes,
                      env=env, port=port, fixed_port=fixed_port, run_dir=run_dir, container_command=container,
                      lease_s=_lease(req.lease_s))


def plan_layout(request: LaunchSettings | RenderRequest) -> tuple[Preset, NodePlan, float | None]:
    """(preset, node plan, model size in billions) that :func:`plan_launch` would choose, offline and without
    the account check: ``presets show auto --model M --profile P`` explains a choice before a launch."""
    settings = settings_of(request)
    req, profile = settings.request, settings.written
    path, config = resolve_model(req.model, None, remote_offline=bool(profile.ssh_host), hf_home=profile.hf_home)
    weights = model_weights(req.model, path, None)
    preset, params = _choose_preset(req, profile, settings.preset_name, config, settings.nodes_asked, weights)
    profile = _fit_profile_to_preset(profile, preset, settings.gpus_given, settings.nodes_asked)
    plan = node_plan(preset.name, preset.tensor_parallel, preset.pipeline_parallel, preset.data_parallel,
                     profile.nodes, profile)
    return preset, plan, params


# -- the model --------------------------------------------------------------------------------------------------


def home_relative(path: str) -> str:
    """``~/x`` -> ``$HOME/x``: the expansion used when rendering for a remote host without connecting (render,
    launch --dry-run). This machine's home is never the remote one; the remote shell expands ``$HOME``."""
    if path == "~" or path.startswith("~/"):
        return HOME_VAR + path[1:]
    return path


def resolve_model(model: str, runner: Runner | None, remote_offline: bool = False,
                  hf_home: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """Return (what vLLM receives, config.json when readable). Local directories become absolute paths.

    ``remote_offline``: the job runs on a remote host that is not asked (render, launch --dry-run): a model
    directory is taken as written there (``~`` for the remote shell), unread."""
    if not model or "\n" in model or "\0" in model:
        raise UsageError("model name is empty or contains a newline")
    looks_like_path = model.startswith(("/", "./", "../", "~")) or os.sep in model and not _HF_ID.match(model)
    if remote_offline and looks_like_path:  # an absolute path also here (a shared filesystem): sized from it
        return home_relative(model), json_file(Path(model, "config.json")) if model.startswith("/") else None
    local = Path(os.path.expanduser(model))
    remote = remote_offline or runner is not None and runner.name != "local"
    if not remote and (_is_dir(local, model) or looks_like_path):
        if not local.is_dir():
            raise UsageError(f"model directory {model} does not exist")
        config = local / "config.json"
        if not config.is_file():
            raise UsageError(f"model directory {model} has no config.json")
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{config}: not valid JSON: {exc}") from exc
        return str(local.resolve()), data if isinstance(data, dict) else None
    if remote and looks_like_path:
        assert runner is not None
        path = runner.expanduser(model)
        try:
            data = json.loads(runner.read_bytes(path.rstrip("/") + "/config.json"))
        except FileNotFoundError:
            raise UsageError(f"model directory {model} (on {runner.name}) has no config.json") from None
        except ValueError as exc:
            raise UsageError(f"{model}/config.json: not valid JSON: {exc}") from exc
        return path, data if isinstance(data, dict) else None
    if not _HF_ID.match(model):
        raise UsageError(
            f"model {model!r} is neither a Hugging Face id (org/name) nor an existing directory"
        )
    longest = max(len(part) for part in model.split("/"))
    if longest > _HF_PART_MAX:  # no such repository; its cache directory name would exceed 255 bytes on the node
        raise UsageError(f"model {model[:40]!r}... ({len(model)} characters): a Hugging Face id has at most "
                         f"{_HF_PART_MAX} characters per part")
    return model, hf_cache_config(model, hf_home)


def _is_dir(path: Path, model: str) -> bool:
    """``path.is_dir()``, but a name the filesystem cannot even look up (> 255 bytes: ENAMETOOLONG, ELOOP, ...)
    is bad input, not a traceback."""
    try:
        return path.is_dir()
    except OSError as exc:
        shown = model if len(model) <= 80 else model[:77] + "..."
        raise UsageError(f"model {shown!r} ({len(model)} characters) cannot be used: "
                         f"{exc.strerror or exc}") from None


# -- the preset and the nodes -----------------------------------------------------------------------------------


def normalised_walltime(profile: Profile) -> str:
    """The profile's walltime written out as ``HH:MM:SS``, the one form the job script directive uses."""
    secs = walltime_seconds(profile.walltime)
    return f"{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"


def _choose_preset(
    req: RenderRequest, profile: Profile, preset_name: str, config: dict[str, Any] | None,
    nodes_asked: NodesAsked, weights: int | None = None,
) -> tuple[Preset, float | None]:
    """The preset to launch with (``auto`` resolved by model size, ``--eager`` applied) and the size in billions:
    the weights on disk (``weights`` bytes over the dtype's bytes) first, then config.json, then the name."""
    preset = load_preset(preset_name)
    params, config = model_size(req.model, config, weights, ask_hub=preset.auto)
    if preset.auto:
        preset = _resolve_auto(preset, params, profile, config, nodes_asked)
    if req.eager is not None:
        preset = replace(preset, eager=req.eager)
    return preset, params


def model_size(model: str, config: dict[str, Any] | None, weights: int | None, *,
               ask_hub: bool = True) -> tuple[float | None, dict[str, Any] | None]:
    """(size in billions, ``config.json``) as ``auto`` sizes ``model``: its weights' bytes over the dtype's bytes
    first, then ``config.json``'s dimensions, then the name; ``ask_hub``: a Hub id in no cache here is looked up
    on the Hub (``model_size.hub_lookup``), whose ``config.json`` is handed back with the size."""
    if ask_hub and weights is None and config is None and _HF_ID.match(model) and "/" in model:
        config, weights = hub_lookup(model)  # in no cache here: the Hub's own files, where it can be reached
    params = round(weights / bytes_per_param(config)[0] / 1e9, 3) if weights else None
    if params is None:
        params = params_from_config(config) if config else None
    if params is None:
        params = params_from_name(model)
    return params, config


def _resolve_auto(preset: Preset, params: float | None, profile: Profile, config: dict[str, Any] | None,
                  nodes_asked: NodesAsked) -> Preset:
    """``auto``: by weights against the profile's GPU memory when both are known (several nodes when one is too
    small), else by parameter count over the GPUs requested (``presets.auto_layout``)."""
    if params is None or not profile.gpu_memory_gb or profile.gpus_per_node < 1:
        return resolve_auto(preset, params, profile.gpus)
    size, note = bytes_per_param(config)
    util = preset.vllm_args.get("--gpu-memory-utilization", DEFAULT_MEMORY_UTILIZATION)
    utilization = float(util) if isinstance(util, (int, float, str)) and not isinstance(util, bool) else 0.95
    fit = auto_by_memory(params, size, note, profile.gpu_memory_gb, utilization, profile.gpus_per_node,
                         nodes_asked.count)
    layout = "x".join(f"{k}{v}" for k, v in (("TP", fit.tp), ("PP", fit.pp), ("DP", fit.dp)) if v > 1) or "DP1"
    return replace(preset, name=f"auto ({layout.replace('x', ' x ')})", tensor_parallel=fit.tp,
                   pipeline_parallel=fit.pp, data_parallel=fit.dp, auto=False, summary=f"{preset.summary} -> {fit.why}")


def _fit_profile_to_preset(profile: Profile, preset: Preset, gpus_given: bool, nodes_asked: NodesAsked) -> Profile:
    """``profile`` requesting exactly the GPUs ``preset`` uses, or a ``UsageError`` when the two disagree.

    A preset larger than one node spreads over ``GPUs / gpus_per_node`` nodes (``--nodes`` must agree; on a
    scheduler of stand-in nodes only when asked); one smaller than the node shrinks the request unless the user
    asked for a GPU count themselves.
    """
    stand_ins = backend_class(profile.scheduler).runs_on_submit_host
    if preset.device == "gpu" and profile.gpus_per_node:
        nodes = nodes_needed(preset.name, preset.layout(), preset.gpus, profile.gpus_per_node, nodes_asked.count,
                             nodes_asked.named, widen=not stand_ins)
        profile = replace(profile, nodes=nodes)
    if preset.device == "cpu" and profile.nodes > 1:
        raise UsageError(f"preset {preset.name} runs on CPU (0 GPUs) on one node; {nodes_asked.named} "
                         f"{profile.nodes} asks for several: pass --nodes 1 or pick a GPU preset")
    if preset.device == "cpu" and profile.gpus:
        raise UsageError(
            f"preset {preset.name} runs on CPU (0 GPUs) but profile {profile.name} requests {profile.gpus} GPU(s) "
            f"({profile.nodes} node(s) x {profile.gpus_per_node}); pass --gpus-per-node 0 or pick a GPU preset"
        )
    if preset.device == "gpu" and not gpus_given and preset.gpus < profile.gpus and profile.nodes == 1:
        # A preset smaller than the node: request only the GPUs it uses (the user did not ask for more).
        profile = replace(profile, gpus_per_node=preset.gpus)
    if preset.device == "gpu" and preset.gpus != profile.gpus:
        hint = _stand_in_nodes_hint(profile, preset) if stand_ins else ""
        raise UsageError(
            f"preset {preset.name} ({preset.layout()}) needs {preset.gpus} GPU(s) but profile {profile.name} "
            f"requests {profile.gpus} ({profile.nodes} node(s) x {profile.gpus_per_node}); "
            f"pass --gpus-per-node {preset.gpus}{hint} or pick another preset"
        )
    return profile


def _stand_in_nodes_hint(profile: Profile, preset: Preset) -> str:
    """Stand-in nodes on the one host are opt-in: say how to ask for them."""
    per_node = profile.gpus_per_node
    if not per_node or preset.gpus <= per_node or preset.gpus % per_node:
        return ""
    return f", --nodes {preset.gpus // per_node} (stand-in nodes of {per_node} GPU(s) on this host)"


# -- names, vLLM's arguments, the environment, port and run directory ------------------------------------------


def slug(text: str) -> str:
    """``Qwen/Qwen3-VL-2B-Instruct`` -> ``qwen3-vl-2b-instruct`` (usable as job name and alias)."""
    base = text.rstrip("/").split("/")[-1].lower()
    base = re.sub(r"[^a-z0-9_.-]+", "-", base).strip("-.") or "model"
    if not base[0].isalpha():
        base = "m-" + base
    return base[:60]


def served_model_name(model: str, served: str | None, job_name: str) -> str:
    """The name clients ask for: ``served``, else a Hugging Face id ``org/name`` as it is, else ``job_name``."""
    return served or (model if _HF_ID.match(model) and "/" in model else job_name)


def _job_name(req: RenderRequest) -> str:
    """``--name`` or the model's slug, checked to be a name every scheduler accepts."""
    job_name = req.name or slug(req.model)
    if not _JOB_NAME.fullmatch(job_name):  # fullmatch: ``$`` would let a trailing newline through
        raise UsageError(
            f"bad name {job_name!r}: start with a letter, then letters, digits, _ . - (at most 63 characters)"
        )
    return job_name


def check_vllm_args(args: list[str], version: tuple[int, ...]) -> None:
    for arg in args:
        if "\n" in arg:
            raise UsageError(f"--vllm-arg {arg!r} contains a newline")
        if not arg.strip():  # vLLM would get an empty positional argument and fail on the node, an hour later
            raise UsageError(f"--vllm-arg {arg!r} is empty; pass --vllm-arg=--flag or --vllm-arg=--flag=value")
        if not arg.startswith("-"):
            continue
        name = flag_name(arg)
        if name in _OWNED_FLAGS:
            raise UsageError(f"--vllm-arg {name} is set by pbstk itself; use --port / --name / the API key options")
        problem = check_flag(arg, version)
        if problem:
            raise UsageError(f"--vllm-arg {name}: {problem} (the profile targets vLLM {version[0]}.{version[1]})")


def _vllm_args(
    req: RenderRequest, preset: Preset, profile: Profile, served: str, version: tuple[int, ...], plan: NodePlan
) -> tuple[list[str], list[str]]:
    """vLLM's command-line arguments (name, parallel layout, preset flags, ``--vllm-arg``s) and notes on what
    was dropped (the profile's vLLM refuses it or does it itself, a ``--vllm-arg`` replaces it). The same on
    every node: the start script adds each node's rank-specific flags (``NodePlan.parallel_args`` says which)."""
    notes: list[str] = []
    check_vllm_args(req.vllm_args, version)
    refuse_layout_flags(req.vllm_args, preset)
    kept, overridden = apply_overrides(_preset_flags(preset, profile, version, notes), req.vllm_args, preset.name)
    return ["--served-model-name", served, *plan.parallel_args(), *kept, *req.vllm_args], notes + overridden


def _preset_flags(preset: Preset, profile: Profile, version: tuple[int, ...], notes: list[str]) -> list[str]:
    """The preset's own flags that the profile's vLLM version accepts; each one left out gets a line in ``notes``."""
    kept: list[str] = []
    preset_args = preset.flag_args()
    i = 0
    while i < len(preset_args):
        flag = preset_args[i]
        has_value = i + 1 < len(preset_args) and not preset_args[i + 1].startswith("--")
        chunk = preset_args[i : i + (2 if has_value else 1)]
        i += len(chunk)
        problem = check_flag(flag, version)
        if problem:
            notes.append(f"dropped {flag} from preset {preset.name}: {problem}")
        elif is_automatic(flag, version):
            notes.append(f"dropped {flag}: automatic in vLLM {profile.vllm_version}")
        else:
            kept += chunk
    return kept


def _job_env(req: RenderRequest, profile: Profile, preset: Preset, version: tuple[int, ...]) -> dict[str, str]:
    """The job's environment (profile, then preset, then ``--env``), each name checked."""
    env = dict(profile.env)
    env.update(preset.env)
    env.update(req.env)
    for key in env:
        _check_env_name(key, version)
    return env


def _check_env_name(key: str, version: tuple[int, ...]) -> None:
    """Refuse a variable name bash cannot export, one pbstk sets itself, or one this vLLM version rejects."""
    if not _ENV_NAME.fullmatch(key):
        raise UsageError(f"bad environment variable name {key!r}")
    if key == "VLLM_API_KEY":
        raise UsageError("VLLM_API_KEY is set by pbstk from the job's key file; use --api-key-env or --no-api-key")
    if key in start_script_settings() or key in STAGE_SETTINGS:  # the header's, and stage_to's block's
        raise UsageError(f"environment variable {key} would overwrite the start script's own setting {key}; "
                         "pick another name")
    problem = check_env(key, version)
    if problem:
        raise UsageError(problem)


@functools.lru_cache(maxsize=1)
def start_script_settings() -> frozenset[str]:
    """Names the settings header assigns: an exported ``--env`` of one of them would change what the body does."""
    text = (SERVER_DIR / START_HEADER).read_text(encoding="utf-8")
    return frozenset(_SETTING.findall(text)) | {line.split("=")[0] for line in bash_assignments()}


def _lease(seconds: object) -> int:
    """The request's ``lease_s`` as the start script's ``LEASE_S``: a whole number of seconds, 0 (none) or more."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
        raise UsageError(f"lease_s must be a whole number of seconds, 0 or more (got {seconds!r})")
    return seconds


def _port(req: RenderRequest, profile: Profile) -> tuple[int, bool]:
    """(port, fixed): a number given by the user is fixed; otherwise the profile's port, auto-advanced on the node."""
    fixed_port = isinstance(req.port, int) or (isinstance(req.port, str) and req.port.isdigit())
    port = int(req.port) if fixed_port and req.port is not None else profile.port
    if not 1 <= port <= 65535:
        raise UsageError(f"bad port {port}: must be between 1 and 65535")
    return port, fixed_port


def _expander(profile: Profile, runner: Runner | None) -> Callable[[str], str]:
    """How ``~`` in the profile's paths becomes a path on the machine the job runs on."""
    if runner is not None:
        return runner.expanduser
    return home_relative if profile.ssh_host else os.path.expanduser


def _run_dir(req: RenderRequest, profile: Profile, job_name: str, runner: Runner | None) -> str:
    """The run directory: given, or a fresh one under the runs root; checked to be safe unquoted in directives.

    Rendered for a remote host without connecting, it may start with ``$HOME/`` (the job script then writes
    no ``-o``/``-e`` directive: schedulers do not expand variables there)."""
    expand = _expander(profile, runner)
    run_dir = expand(req.run_dir) if req.run_dir else default_run_dir(profile, job_name, expand)
    checked = run_dir[len(HOME_VAR):] if run_dir.startswith(HOME_VAR + "/") else run_dir
    if not RUN_DIR_RE.fullmatch(checked):
        raise UsageError(
            f"run directory {run_dir!r} must be an absolute path of letters, digits and _ . / @ + ~ - "
            "(job script directives read it unquoted)"
        )
    return run_dir


def default_run_dir(profile: Profile, job_name: str, expand: Callable[[str], str]) -> str:
    """A fresh run directory under the profile's runs root: ``ROOT/NAME-YYYYmmdd-HHMMSS-XXXX``."""
    root = expand(profile.runs_root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{root.rstrip('/')}/{job_name}-{stamp}-{os.urandom(2).hex()}"


def _expand_profile_paths(profile: Profile, runner: Runner | None) -> Profile:
    """Paths in the profile may start with ``~`` or ``$HOME``: expand them for the machine the job runs on."""
    expand = _expander(profile, runner)
    return replace(
        profile,
        venv=expand(profile.venv) if profile.venv else None,
        hf_home=expand(profile.hf_home) if profile.hf_home else None,
        vllm_cache_root=expand(profile.vllm_cache_root) if profile.vllm_cache_root else None,
        container=expand(profile.container) if profile.container.startswith("~") else profile.container,
    )
