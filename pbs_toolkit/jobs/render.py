"""Turn *model + preset + profile + options* into the job script and ``start_vllm.sh``: a straight pipeline.

settings (resolved once: settings/launch_settings.py) -> plan (layout, vLLM arguments, environment, run
directory: jobs/plan.py) -> the scripts' context -> the templates. This module only computes text; writing
files, submitting and recording live in ``launch.py``.
"""

from __future__ import annotations

import errno
import functools
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.idle import watch_seconds
from pbs_toolkit.jobs.plan import HOME_VAR, SERVER_DIR, START_HEADER, LaunchPlan, plan_launch
from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.server.coldstart import coldstart_context
from pbs_toolkit.server.phases import bash_assignments
from pbs_toolkit.settings.launch_settings import LaunchSettings, RenderRequest, settings_of
from pbs_toolkit.settings.layout import NodePlan
from pbs_toolkit.settings.multimodal import compile_variant
from pbs_toolkit.settings.presets import Preset, preset_for_layout
from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.settings.vllm_flags import api_key_channel
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.version import __version__
from pbs_toolkit.vllm.logline import LOG_PREFIX_RE
from pbs_toolkit.vllm.startup import COMPILE_ERROR_RE, EXCEPTION_RE, FATAL_WRAPPER_RE, PORT_IN_USE_RE

PORT_SPAN = 100
_T = TypeVar("_T")


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
    #: the container command vLLM starts with (server/coldstart.py), ``None`` without a container
    container_command: list[str] | None = None

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
            "container_command": self.container_command,
        }

    def to_dict(self, *, dry_run: bool = False, scripts: bool = True) -> dict[str, Any]:
        """A ``render`` object (``render --json``, ``launch --dry-run --json``): :meth:`summary`, and the
        scripts' names and (``scripts``) texts."""
        from pbs_toolkit.schema import stamp

        data = {**self.summary(), "dry_run": dry_run, "script_name": self.script_name}
        if scripts:
            data.update(job_script=self.job_script, start_script=self.start_script)
        return stamp("render", data)


# Two template homes: the scheduler's job script lives with its backend (``Scheduler.template_dir``), the
# start script with the server.
_SERVER_TEMPLATES = SERVER_DIR
#: the start script's static body: these files of server/start/, concatenated in this order (the order they run)
START_DIR = SERVER_DIR / "start"
START_PARTS = (
    "settings.sh",  # the header's settings declared, strict mode
    "node-role.sh",  # this copy's node, role and rank; its log and marker paths
    "markers.sh",  # server.json, nodes/K.json, head.json; the stop trap until server.sh sets its own
    "coldstart.sh",  # the start-up timeline, the keyed compile cache, containers (functions)
    "setup.sh",  # the profile's site setup, TMPDIR, the API key, GPU UUIDs
    "amx.sh",  # AMX CPUs: every Python process asks for the AMX tile permission first
    "launcher.sh",  # several nodes: the launcher starts one copy per node
    "address.sh",  # the address this node is reached at
    "free_port.sh",  # the free-port rule (functions), shared with the router's start_router.sh
    "port.sh",  # the port: the requested one or a free one in its window
    "groups.sh",  # each vLLM in a process group of its own, ended whole; the EXIT trap
    "gpu_free.sh",  # a vLLM starts only on GPUs whose memory is free, else the job says what holds it
    "server.sh",  # what runs vLLM; the stop trap
    "peers.sh",  # several nodes: per-rank engine flags, head.json, the nodes watching each other
    "idle.sh",  # idle reclaim (--idle-cancel)
    "lease.sh",  # the lease of pbstk run: the job ends itself when the run stops renewing it
    "supervise.sh",  # the server's attempts, the eager restart, the exit code
)


def render(settings: LaunchSettings | RenderRequest, runner: Runner | None = None) -> RenderedJob:
    """Plan and render both scripts for ``settings`` (a ``RenderRequest`` is resolved first), through ``runner``
    (``None``: connecting nowhere). Raises ``UsageError``/``ConfigError`` on bad input (``plan_launch``)."""
    main, models = co_models(settings_of(settings), runner)
    plan = plan_launch(main, runner)
    if models:  # the job asks the scheduler for every GPU its models use, not only its first model's
        plan = replace(plan, profile=replace(plan.profile, gpus_per_node=job_gpus(main.request.models)))
    context = {**script_context(plan), **multi_context(main, models)}
    backend = backend_class(plan.profile.scheduler)
    jenv = template_environment(backend.template_dir)
    return RenderedJob(
        job_script=jenv.get_template(backend.template_name).render(**context),
        start_script=render_start_script(jenv, context),
        run_dir=plan.run_dir, job_name=plan.job_name, model=plan.model, served_model_name=plan.served_model_name,
        preset=plan.preset, profile=plan.profile, port=plan.port, fixed_port=plan.fixed_port,
        vllm_args=plan.vllm_args, notes=plan.notes, params_b=plan.params_b, plan=plan.nodes,
        container_command=plan.container_command,
    )


def script_context(plan: LaunchPlan) -> dict[str, Any]:
    """What the job template and the start script header read."""
    return {
        "version": __version__, "model": plan.model, "model_path": plan.model_path, "preset": plan.preset,
        "profile": plan.profile, "job_name": plan.job_name, "run_dir": plan.run_dir,
        "select": plan.profile.select_statement(), "walltime": plan.walltime, "env": plan.env,
        "vllm_args": plan.vllm_args, "port": plan.port, "fixed_port": plan.fixed_port,
        "vllm_arg_lines": _pair_flags(plan.vllm_args), "port_span": PORT_SPAN,
        "compile_error_re": COMPILE_ERROR_RE, "port_in_use_re": PORT_IN_USE_RE,
        "proxy": any(k.lower() in ("http_proxy", "https_proxy") for k in plan.env),
        "phase_lines": bash_assignments(), "plan": plan.nodes,
        **coldstart_context(plan.model, plan.preset.layout(), plan.nodes.nnodes, plan.profile,
                            compile_variant(plan.preset)),
        # where vLLM gets the API key: not VLLM_API_KEY, which vLLM <= 0.22 puts into the compile cache's key
        "api_key_via": api_key_channel(plan.profile.vllm_version),
        "idle_cancel_s": watch_seconds(plan.profile.idle_cancel), "lease_s": plan.lease_s,
        "models": [], "main_gpus": "",
    }


def co_models(settings: LaunchSettings, runner: Runner | None) -> tuple[LaunchSettings, list[dict[str, Any]]]:
    """A job of several models (the request's ``models``, docs/multi-model.md): the settings of its first
    model (its memory share added to its vLLM arguments) and what the start script needs of each other one
    (its path, served name, planned GPUs and vLLM arguments, planned as a launch of its own). One model: the
    settings as they are, and no other."""
    req = settings.request
    if len(req.models) < 2:
        return settings, []
    first = req.models[0]
    main = settings_of(replace(req, vllm_args=[*req.vllm_args, *_share_args(first)], **_own_layout(first, req)))
    others = []
    for m in req.models[1:]:
        sub = settings_of(replace(req, model=m["model"], served_model_name=m["served_model_name"], models=[],
                                  vllm_args=[*req.vllm_args, *_share_args(m)], **_own_layout(m, req)))
        p = plan_launch(sub, runner)
        others.append({"model_path": p.model_path, "served": p.served_model_name, "vllm_args": p.vllm_args,
                       "gpus": ",".join(str(g) for g in m.get("gpus") or ()), "arg_lines": _pair_flags(p.vllm_args),
                       "swap": bool(m.get("swap"))})
    return main, others


def _own_layout(model: dict[str, Any], req: RenderRequest) -> dict[str, Any]:
    """A packed model's layout is that of its own planned GPUs, never the node's (a model ``auto`` would size as
    DP4 on a node of 4 GPUs got --data-parallel-size 4 with one GPU visible, and died): ``auto`` becomes the
    tensor-parallel preset of its GPU count (``single`` for one), a named preset stays; either is planned on one
    node of exactly its GPUs."""
    gpus = list(model.get("gpus") or ())
    preset = model.get("preset") or req.preset
    if not gpus:  # a CPU job: the node's CPUs, as planned
        return {"preset": preset}
    if preset in (None, "auto"):
        preset = preset_for_layout(len(gpus), 1)
    return {"preset": preset, "gpus_per_node": len(gpus), "nodes": 1}


def job_gpus(models: list[dict[str, Any]]) -> int:
    """The GPUs a job of several models asks its scheduler for: every GPU a model of it is planned on."""
    used = {int(g) for m in models for g in m.get("gpus") or ()}
    return max(used) + 1 if used else 0


def _share_args(model: dict[str, Any]) -> list[str]:
    """A model's ``--gpu-memory-utilization`` share; a swapping one's sleep mode and the guard of its development
    endpoints (docs/multi-model.md "Swapping")."""
    share = model.get("share")
    out = [] if share is None else ["--gpu-memory-utilization", f"{float(share):g}"]
    return [*out, *SWAP_VLLM_ARGS] if model.get("swap") else out


def multi_context(settings: LaunchSettings, models: list[dict[str, Any]]) -> dict[str, Any]:
    """The start script's multi-model settings: none for one model (its script renders as ever)."""
    if not models:
        return {}
    first = settings.request.models[0]
    swapping = [m for m in settings.request.models if m.get("swap")]
    return {"models": models, "main_gpus": ",".join(str(g) for g in first.get("gpus") or ()),
            "main_served": first["served_model_name"], "main_swap": bool(first.get("swap")),
            "swap_max_awake": int(swapping[0]["max_awake"]) if swapping else 0,
            "swap_sleep_after_s": int(swapping[0].get("sleep_after_s") or 0) if swapping else 0,
            "log_prefix_re": LOG_PREFIX_RE, "exception_re": EXCEPTION_RE, "fatal_wrapper_re": FATAL_WRAPPER_RE}


def template_environment(backend_dir: Path) -> Any:
    """Jinja over ``backend_dir`` (the job template) and the server's templates, with the ``sh``/``shpath``
    quoting filters."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(str(d)) for d in (backend_dir, _SERVER_TEMPLATES)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = sh_word
    env.filters["shpath"] = sh_path
    return env


def sh_word(value: Any) -> str:
    """``shlex.quote``, with a comma quoted as well: in a bash array ``image=0,video=0`` is one element, but it reads
    like a mistaken separator (shellcheck SC2054), so it is written ``'image=0,video=0'``."""
    text = str(value)
    quoted = shlex.quote(text)
    return f"'{text}'" if quoted == text and "," in text else quoted


def sh_path(value: Any) -> str:
    """A path for a shell line: quoted, except that a leading ``$HOME`` stays for the shell to expand
    (``"$HOME"/pbstk-runs``), as in scripts rendered for a remote host without asking it where its home is."""
    text = str(value)
    if text == HOME_VAR or text.startswith(HOME_VAR + "/"):
        rest = text[len(HOME_VAR):]
        return f'"{HOME_VAR}"' + (shlex.quote(rest) if rest else "")
    return shlex.quote(text)


#: the parts of server/start/ only some scripts hold: models.sh, a multi-model job's (before supervise.sh)
OPTIONAL_PARTS = ("models.sh",)
#: the Python helpers of a job whose models swap, written into ``$SWAP_DIR`` by its start script (standard library
#: only: they run in the vLLM's Python)
SWAP_HELPERS = ("pbstk_dev_guard.py", "pbstk_swapper.py")
#: a swapping model's vLLM arguments: sleep mode, and the guard of the development endpoints it needs
SWAP_VLLM_ARGS = ("--enable-sleep-mode", "--middleware", "pbstk_dev_guard.DevGuard")
#: the first line of supervise.sh: the multi-model part (models.sh) goes right before it
_SUPERVISE_MARK = "# vLLM's output line by line into the log where stdbuf is there\n"


def start_body() -> str:
    """The static body every start script ends with: the ``START_PARTS`` files, in that order."""
    return "".join((START_DIR / name).read_text(encoding="utf-8") for name in START_PARTS)


def render_start_script(jenv: Any, context: dict[str, Any]) -> str:
    """The launch's ``start_vllm.sh``: its rendered settings header (variables only), then the static body.

    The body is plain bash kept in its own files (``START_PARTS``, one per concern) so shellcheck reads it as it
    runs; everything that differs between launches is a variable in the header, and the body branches on those
    with bash ``if``s.
    """
    from pbs_toolkit.weights.nodecopy import stage_copy_block

    header = jenv.get_template(START_HEADER).render(**context)
    body = start_body()
    if context.get("models"):  # several models: their part runs before the first model's supervised attempts
        cut = body.index(_SUPERVISE_MARK)
        body = (body[:cut] + _swap_helpers(context) + (START_DIR / OPTIONAL_PARTS[0]).read_text(encoding="utf-8")
                + body[cut:])
    return header + stage_copy_block(context["profile"], context["vllm_args"]) + body


def _swap_helpers(context: dict[str, Any]) -> str:
    """A swapping job's lines that write ``SWAP_HELPERS`` into ``$SWAP_DIR`` (quoted here-documents); none
    where no model swaps."""
    if not context.get("swap_max_awake"):
        return ""
    out = ["# --- swapping (docs/multi-model.md): the development endpoints' guard and the swapper, beside the logs\n",
           'mkdir -p "$SWAP_DIR" || pbstk_fail "cannot create $SWAP_DIR"\n']
    for name in SWAP_HELPERS:
        text = (START_DIR / name).read_text(encoding="utf-8")
        assert "\nPBSTK_PYTHON\n" not in text
        out.append(f'cat >"$SWAP_DIR/{name}" <<\'PBSTK_PYTHON\' || pbstk_fail "cannot write $SWAP_DIR/{name}"\n'
                   f"{text}PBSTK_PYTHON\n")
    return "".join(out)


def _pair_flags(args: list[str]) -> list[list[str]]:
    """Group ``--flag value`` pairs so the script lists one flag a line."""
    lines: list[list[str]] = []
    for arg in args:
        if lines and not arg.startswith("-") and len(lines[-1]) == 1 and lines[-1][0].startswith("--"):
            lines[-1].append(arg)
        else:
            lines.append([arg])
    return lines



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
