"""Turn *model + preset + profile + options* into the job script and ``start_vllm.sh``.

This module only computes text; writing files, submitting and recording live in ``launch.py``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pbs_toolkit import __version__
from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.server.phases import bash_assignments
from pbs_toolkit.settings.config import flag_name as setting_flag
from pbs_toolkit.settings.config import resolve_settings
from pbs_toolkit.settings.layout import (
    DEFAULT_MEMORY_UTILIZATION,
    NodePlan,
    auto_by_memory,
    bytes_per_param,
    node_plan,
    nodes_needed,
)
from pbs_toolkit.settings.model_size import UNKNOWN_SIZE_NOTE, hf_cache_config, hub_lookup, json_file, model_weights
from pbs_toolkit.settings.placeholders import fill_profile
from pbs_toolkit.settings.presets import Preset, load_preset, params_from_config, params_from_name, resolve_auto
from pbs_toolkit.settings.profiles import Profile, load_profile, walltime_seconds
from pbs_toolkit.settings.vllm_flags import check_env, check_flag, flag_name, is_automatic, version_tuple
from pbs_toolkit.settings.vllm_overrides import apply_overrides
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.vllm.startup import COMPILE_ERROR_RE, PORT_IN_USE_RE

#: Hugging Face repository ids: ``org/name`` or ``name``
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
#: Hugging Face limits organisation and repository names to 96 characters each
_HF_PART_MAX = 96
_JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: run directories appear unquoted in job-script directives (output paths; ``:`` would read as host:path)
_RUN_DIR = re.compile(r"/[A-Za-z0-9_./@+~-]+")
#: flags pbstk sets itself; passing them through --vllm-arg would fight the start script
_OWNED_FLAGS = {"--host", "--port", "--model", "--api-key"}
PORT_SPAN = 100
_T = TypeVar("_T")


@dataclass
class RenderRequest:
    """Everything ``render`` needs. ``None`` means "take it from env / user config / profile / preset"."""

    model: str
    preset: str | None = None
    profile: str | None = None
    name: str | None = None
    served_model_name: str | None = None
    port: int | str | None = None  # a number, "auto", or None (profile's port, auto-advance)
    queue: str | None = None
    account: str | None = None
    walltime: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    venv: str | None = None
    runs_root: str | None = None
    vllm_version: str | None = None
    hf_home: str | None = None
    vllm_cache_root: str | None = None
    scheduler: str | None = None
    ssh_host: str | None = None
    eager: bool | None = None
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    run_dir: str | None = None
    #: ``--idle-cancel``: stop the server after this long without a request (``30m``; ``off``); None: profile's
    idle_cancel: str | None = None


@dataclass
class RenderedJob:
    job_script: str
    start_script: str
    run_dir: str
    job_name: str
    model: str
    served_model_name: str
    preset: Preset
    profile: Profile
    port: int
    fixed_port: bool
    vllm_args: list[str]
    notes: list[str]
    params_b: float | None = None
    plan: NodePlan | None = None

    @property
    def script_name(self) -> str:
        """The job script's file name in the run directory: the profile's backend decides it."""
        return backend_class(self.profile.scheduler).script_name

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model, "served_model_name": self.served_model_name, "job_name": self.job_name,
            "preset": self.preset.name, "layout": self.preset.layout(), "profile": self.profile.name,
            "scheduler": self.profile.scheduler, "run_dir": self.run_dir, "port": self.port,
            "vllm_args": self.vllm_args, "notes": self.notes,
            "nodes": self.plan.nnodes if self.plan else 1, "node_engine": self.plan.engine if self.plan else "single",
        }

    def to_dict(self, *, dry_run: bool = False, scripts: bool = True) -> dict[str, Any]:
        """A ``render`` object (``render --json``, ``launch --dry-run --json``): :meth:`summary`, and the
        scripts' names and (``scripts``) texts."""
        from pbs_toolkit.schema import stamp

        data = {**self.summary(), "dry_run": dry_run, "script_name": self.script_name}
        if scripts:
            data.update(job_script=self.job_script, start_script=self.start_script)
        return stamp("render", data)


_PACKAGE = Path(__file__).resolve().parent.parent
# Two template homes: the scheduler's job script lives with its backend (``Scheduler.template_dir``), the
# start script with the server.
_SERVER_TEMPLATES = _PACKAGE / "server"


def _environment(backend_dir: Path) -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(str(d)) for d in (backend_dir, _SERVER_TEMPLATES)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    env.filters["shpath"] = sh_path
    return env


#: what a remote home stands for in a script rendered without connecting (its shell expands it)
HOME_VAR = "$HOME"


def sh_path(value: Any) -> str:
    """A path for a shell line: quoted, except that a leading ``$HOME`` stays for the shell to expand
    (``"$HOME"/pbstk-runs``), as in scripts rendered for a remote host without asking it where its home is."""
    text = str(value)
    if text == HOME_VAR or text.startswith(HOME_VAR + "/"):
        rest = text[len(HOME_VAR):]
        return f'"{HOME_VAR}"' + (shlex.quote(rest) if rest else "")
    return shlex.quote(text)


def home_relative(path: str) -> str:
    """``~/x`` -> ``$HOME/x``: the expansion used when rendering for a remote host without connecting (render,
    launch --dry-run). This machine's home is never the remote one; the remote shell expands ``$HOME``."""
    if path == "~" or path.startswith("~/"):
        return HOME_VAR + path[1:]
    return path


def _expander(profile: Profile, runner: Runner | None) -> Callable[[str], str]:
    """How ``~`` in the profile's paths becomes a path on the machine the job runs on."""
    if runner is not None:
        return runner.expanduser
    return home_relative if profile.ssh_host else os.path.expanduser


def slug(text: str) -> str:
    """``Qwen/Qwen3-VL-2B-Instruct`` -> ``qwen3-vl-2b-instruct`` (usable as job name and alias)."""
    base = text.rstrip("/").split("/")[-1].lower()
    base = re.sub(r"[^a-z0-9_.-]+", "-", base).strip("-.") or "model"
    if not base[0].isalpha():
        base = "m-" + base
    return base[:60]


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


def run_dir_error(exc: OSError, run_dir: str) -> UsageError:
    """One clear line for an ``OSError`` while creating or filling the run directory (nothing is submitted then).

    The usual causes are the runs root: missing and not creatable, a file where a directory should be,
    read-only, on a full disk, or a path the filesystem refuses (``/proc``, names over 255 bytes).
    """
    reasons = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only filesystem",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
        errno.ENOENT: "a parent directory does not exist and cannot be created",
        errno.ENAMETOOLONG: "a name in the path is too long",
        errno.EEXIST: "it already exists and is not a directory",
    }
    reason = reasons.get(exc.errno or 0) or exc.strerror or str(exc) or type(exc).__name__
    return UsageError(f"cannot create the run directory {run_dir}: {reason} (check --runs-root / runs_root)")


def run_dir_errors(write: Callable[..., _T]) -> Callable[..., _T]:
    """Decorate ``write(runner, rendered, ...)`` so an ``OSError`` becomes :func:`run_dir_error`."""

    @functools.wraps(write)
    def wrapper(runner: Runner, rendered: RenderedJob, *args: Any, **kw: Any) -> _T:
        try:
            return write(runner, rendered, *args, **kw)
        except OSError as exc:
            raise run_dir_error(exc, rendered.run_dir) from exc

    return wrapper


def request_flags(req: RenderRequest) -> dict[str, Any]:
    """The settings ``req`` gives as flags (``None``: not given), for :func:`resolve_settings`."""
    return {
        "profile": req.profile, "preset": req.preset, "queue": req.queue, "account": req.account,
        "walltime": req.walltime, "nodes": req.nodes, "gpus_per_node": req.gpus_per_node,
        "venv": req.venv, "runs_root": req.runs_root, "vllm_version": req.vllm_version,
        "hf_home": req.hf_home, "vllm_cache_root": req.vllm_cache_root,
        "scheduler": req.scheduler, "ssh_host": req.ssh_host,
        "port": req.port if isinstance(req.port, int) else None, "idle_cancel": req.idle_cancel,
    }


@dataclass(frozen=True)
class NodesAsked:
    """A node count the user asked for (flag, ``PBSTK_NODES``, config.yaml, or a profile that says more than
    one), and how to name it in an error; ``count`` ``None``: the preset decides."""

    count: int | None = None
    named: str = "--nodes"


def resolve_profile(req: RenderRequest) -> tuple[Profile, str | None, bool, NodesAsked]:
    """(profile with every layer applied, placeholders not filled yet; preset name or ``None``; whether the
    GPU count was set by the user; the node count asked for)."""
    settings = resolve_settings(request_flags(req))
    profile = load_profile(settings.profile)
    overrides = dict(settings.profile_overrides)
    if settings.env_layers:
        overrides["env"] = settings.merged_env(profile.env)
    profile = profile.with_overrides(overrides)
    preset = settings.preset or settings.default_presets.get(req.model)
    if "nodes" in settings.profile_overrides:
        source = settings.sources.get("nodes", "")
        asked = NodesAsked(profile.nodes, setting_flag("nodes") if source.startswith("flag") else f"nodes ({source})")
    elif profile.nodes > 1:  # a profile of one node is the default, not a request: a larger preset widens it
        asked = NodesAsked(profile.nodes, f"nodes (profile {profile.name})")
    else:
        asked = NodesAsked()
    return profile, preset, "gpus_per_node" in settings.profile_overrides, asked


def checked_profile(req: RenderRequest) -> Profile:
    """The launchable profile for ``req``: account present when required, one node, placeholders filled.

    Cheap and offline: ``launch`` runs it before it opens an SSH connection (no login for a doomed job)."""
    profile = resolve_profile(req)[0]
    _check_profile(profile)
    return fill_profile(profile)


def _default_preset(profile: Profile) -> str:
    return "cpu" if profile.gpus == 0 else "auto"


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


def render(req: RenderRequest, runner: Runner | None = None) -> RenderedJob:
    """Validate ``req`` and render both scripts. Raises ``UsageError``/``ConfigError`` on bad input.

    The steps run in a fixed order (profile, walltime, model, preset, names, flags, env, port, run directory)
    so the first problem reported is always the same one for the same input.
    """
    profile, preset_name, gpus_given, nodes_asked = resolve_profile(req)
    _check_profile(profile)
    profile = fill_profile(profile)
    walltime = _normalised_walltime(profile)
    model_path, config = resolve_model(req.model, runner, remote_offline=runner is None and bool(profile.ssh_host),
                                       hf_home=profile.hf_home)
    preset, params = _choose_preset(req, profile, preset_name, config, nodes_asked, model_weights(req.model, model_path,
                                                                                             runner))
    profile = _fit_profile_to_preset(profile, preset, gpus_given, nodes_asked)
    plan = node_plan(preset.name, preset.tensor_parallel, preset.pipeline_parallel, preset.data_parallel,
                     profile.nodes, profile)

    version = version_tuple(profile.vllm_version)
    job_name = _job_name(req)
    served = req.served_model_name or (req.model if _HF_ID.match(req.model) and "/" in req.model else job_name)
    args, notes = _vllm_args(req, preset, profile, served, version, plan)
    if params is None and preset.name.startswith("auto ("):
        notes.insert(0, UNKNOWN_SIZE_NOTE)
    env = _job_env(req, profile, preset, version)
    port, fixed_port = _port(req, profile)
    run_dir = _run_dir(req, profile, job_name, runner)
    profile = _expand_profile_paths(profile, runner)

    context = {
        "version": __version__, "model": req.model, "model_path": model_path, "preset": preset,
        "profile": profile, "job_name": job_name, "run_dir": run_dir, "select": profile.select_statement(),
        "walltime": walltime, "env": env, "vllm_args": args, "port": port, "fixed_port": fixed_port,
        "vllm_arg_lines": _pair_flags(args), "port_span": PORT_SPAN,
        "compile_error_re": COMPILE_ERROR_RE, "port_in_use_re": PORT_IN_USE_RE,
        "proxy": any(k.lower() in ("http_proxy", "https_proxy") for k in env),
        "phase_lines": bash_assignments(), "plan": plan, "idle_cancel_s": idle_seconds(profile),
    }
    backend = backend_class(profile.scheduler)
    jenv = _environment(backend.template_dir)
    return RenderedJob(
        job_script=jenv.get_template(backend.template_name).render(**context),
        start_script=render_start_script(jenv, context),
        run_dir=run_dir, job_name=job_name, model=req.model, served_model_name=served, preset=preset,
        profile=profile, port=port, fixed_port=fixed_port, vllm_args=args, notes=notes, params_b=params,
        plan=plan,
    )


def idle_seconds(profile: Profile) -> int:
    """The profile's ``idle_cancel`` (flag, env, config.yaml or profile) in whole seconds; 0: off."""
    from pbs_toolkit.durations import parse

    return int(round(parse(profile.idle_cancel, "--idle-cancel", off=True)))


def plan_layout(req: RenderRequest) -> tuple[Preset, NodePlan, float | None]:
    """(preset, node plan, model size in billions) that :func:`render` would choose for ``req``, offline and
    without the account check: ``presets show auto --model M --profile P`` explains a choice before a launch."""
    profile, preset_name, gpus_given, nodes_asked = resolve_profile(req)
    path, config = resolve_model(req.model, None, remote_offline=bool(profile.ssh_host), hf_home=profile.hf_home)
    weights = model_weights(req.model, path, None)
    preset, params = _choose_preset(req, profile, preset_name, config, nodes_asked, weights)
    profile = _fit_profile_to_preset(profile, preset, gpus_given, nodes_asked)
    plan = node_plan(preset.name, preset.tensor_parallel, preset.pipeline_parallel, preset.data_parallel,
                     profile.nodes, profile)
    return preset, plan, params


def _check_profile(profile: Profile) -> None:
    """Refuse profiles pbstk cannot launch: an account the site requires is missing."""
    if profile.account_required and not profile.account:
        raise UsageError(
            f"profile {profile.name} needs an account: pass --account, set PBSTK_ACCOUNT, "
            "or add 'account:' to your pbstk config.yaml"
        )


def _normalised_walltime(profile: Profile) -> str:
    """The profile's walltime written out as ``HH:MM:SS``, the one form the job script directive uses."""
    secs = walltime_seconds(profile.walltime)
    return f"{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"


def _choose_preset(
    req: RenderRequest, profile: Profile, preset_name: str | None, config: dict[str, Any] | None,
    nodes_asked: NodesAsked, weights: int | None = None,
) -> tuple[Preset, float | None]:
    """The preset to launch with (``auto`` resolved by model size, ``--eager`` applied) and the size in billions:
    the weights on disk (``weights`` bytes over the dtype's bytes) first, then config.json, then the name."""
    preset = load_preset(preset_name or _default_preset(profile))
    if preset.auto and weights is None and config is None and _HF_ID.match(req.model) and "/" in req.model:
        config, weights = hub_lookup(req.model)  # in no cache here: the Hub's own files, where it can be reached
    params = round(weights / bytes_per_param(config)[0] / 1e9, 3) if weights else None
    if params is None:
        params = params_from_config(config) if config else None
    if params is None:
        params = params_from_name(req.model)
    if preset.auto:
        preset = _resolve_auto(preset, params, profile, config, nodes_asked)
    if req.eager is not None:
        preset = replace(preset, eager=req.eager)
    return preset, params


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

    A preset larger than one node spreads over ``GPUs / gpus_per_node`` nodes (``--nodes`` must agree); one
    smaller than the node shrinks the request unless the user asked for a GPU count themselves.
    """
    if preset.device == "gpu" and profile.gpus_per_node:
        nodes = nodes_needed(preset.name, preset.layout(), preset.gpus, profile.gpus_per_node, nodes_asked.count,
                             nodes_asked.named, widen=profile.scheduler != "local")
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
        raise UsageError(
            f"preset {preset.name} ({preset.layout()}) needs {preset.gpus} GPU(s) but profile {profile.name} "
            f"requests {profile.gpus} ({profile.nodes} node(s) x {profile.gpus_per_node}); "
            f"pass --gpus-per-node {preset.gpus}{_local_nodes_hint(profile, preset)} or pick another preset"
        )
    return profile


def _local_nodes_hint(profile: Profile, preset: Preset) -> str:
    """On the local scheduler, stand-in nodes on this host are opt-in: say how to ask for them."""
    per_node = profile.gpus_per_node
    if profile.scheduler != "local" or not per_node or preset.gpus <= per_node or preset.gpus % per_node:
        return ""
    return f", --nodes {preset.gpus // per_node} (stand-in nodes of {per_node} GPU(s) on this host)"


def _job_name(req: RenderRequest) -> str:
    """``--name`` or the model's slug, checked to be a name every scheduler accepts."""
    job_name = req.name or slug(req.model)
    if not _JOB_NAME.fullmatch(job_name):  # fullmatch: ``$`` would let a trailing newline through
        raise UsageError(
            f"bad name {job_name!r}: start with a letter, then letters, digits, _ . - (at most 63 characters)"
        )
    return job_name


def _vllm_args(
    req: RenderRequest, preset: Preset, profile: Profile, served: str, version: tuple[int, ...], plan: NodePlan
) -> tuple[list[str], list[str]]:
    """vLLM's command-line arguments (name, parallel layout, preset flags, ``--vllm-arg``s) and notes on what
    was dropped (the profile's vLLM refuses it or does it itself, a ``--vllm-arg`` replaces it). The same on
    every node: the start script adds each node's rank-specific flags (``NodePlan.parallel_args`` says which)."""
    notes: list[str] = []
    check_vllm_args(req.vllm_args, version)
    kept, overridden = apply_overrides(_preset_flags(preset, profile, version, notes), req.vllm_args, preset.name,
                                       layout=plan.parallel_args())
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
    if key in start_script_settings():
        raise UsageError(f"environment variable {key} would overwrite the start script's own setting {key}; "
                         "pick another name")
    problem = check_env(key, version)
    if problem:
        raise UsageError(problem)


def _port(req: RenderRequest, profile: Profile) -> tuple[int, bool]:
    """(port, fixed): a number given by the user is fixed; otherwise the profile's port, auto-advanced on the node."""
    fixed_port = isinstance(req.port, int) or (isinstance(req.port, str) and req.port.isdigit())
    port = int(req.port) if fixed_port and req.port is not None else profile.port
    if not 1 <= port <= 65535:
        raise UsageError(f"bad port {port}: must be between 1 and 65535")
    return port, fixed_port


def _run_dir(req: RenderRequest, profile: Profile, job_name: str, runner: Runner | None) -> str:
    """The run directory: given, or a fresh one under the runs root; checked to be safe unquoted in directives.

    Rendered for a remote host without connecting, it may start with ``$HOME/`` (the job script then writes
    no ``-o``/``-e`` directive: schedulers do not expand variables there)."""
    expand = _expander(profile, runner)
    run_dir = expand(req.run_dir) if req.run_dir else _default_run_dir(profile, job_name, expand)
    checked = run_dir[len(HOME_VAR):] if run_dir.startswith(HOME_VAR + "/") else run_dir
    if not _RUN_DIR.fullmatch(checked):
        raise UsageError(
            f"run directory {run_dir!r} must be an absolute path of letters, digits and _ . / @ + ~ - "
            "(job script directives read it unquoted)"
        )
    return run_dir


def _expand_profile_paths(profile: Profile, runner: Runner | None) -> Profile:
    """Paths in the profile may start with ``~`` or ``$HOME``: expand them for the machine the job runs on."""
    expand = _expander(profile, runner)
    return replace(
        profile,
        venv=expand(profile.venv) if profile.venv else None,
        hf_home=expand(profile.hf_home) if profile.hf_home else None,
        vllm_cache_root=expand(profile.vllm_cache_root) if profile.vllm_cache_root else None,
    )


_HEADER = "start_vllm.sh.j2"
_BODY = _PACKAGE / "server" / "start_vllm.sh"
_SETTING = re.compile(r"^([A-Z_][A-Z0-9_]*)=", re.MULTILINE)


def render_start_script(jenv: Any, context: dict[str, Any]) -> str:
    """The launch's ``start_vllm.sh``: its rendered settings header (variables only), then the static body.

    The body is plain bash kept in its own file so shellcheck reads it as it runs; everything that differs
    between launches is a variable in the header, and the body branches on those with bash ``if``s.
    """
    return jenv.get_template(_HEADER).render(**context) + _BODY.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def start_script_settings() -> frozenset[str]:
    """Names the settings header assigns: an exported ``--env`` of one of them would change what the body does."""
    text = (_PACKAGE / "server" / _HEADER).read_text(encoding="utf-8")
    return frozenset(_SETTING.findall(text)) | {line.split("=")[0] for line in bash_assignments()}


def _pair_flags(args: list[str]) -> list[list[str]]:
    """Group ``--flag value`` pairs so the script lists one flag a line."""
    lines: list[list[str]] = []
    for arg in args:
        if lines and not arg.startswith("-") and len(lines[-1]) == 1 and lines[-1][0].startswith("--"):
            lines[-1].append(arg)
        else:
            lines.append([arg])
    return lines


def _default_run_dir(profile: Profile, job_name: str, expand: Callable[[str], str]) -> str:
    root = expand(profile.runs_root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{root.rstrip('/')}/{job_name}-{stamp}-{os.urandom(2).hex()}"
