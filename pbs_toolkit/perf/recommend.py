"""``doctor``'s commands: the job's own launch line with one finding's fix applied, and the preset to launch instead.

Both keep everything else the job was launched with (the model, preset, profile and name, and ``LaunchSpec.options``:
``--account``, ``--queue``, ``--vllm-arg``, ...), so they reach the same allocation with the same flags; each value
is quoted for the shell. A finding's relaunch changes only what its :class:`Remedy` says; the closing preset is
never the layout that already runs (advice to relaunch what runs is noise, and after an eager fallback it would
fail the same way).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.spec import split_vllm_args
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.perf.doctor import DoctorContext, Finding, Remedy
from pbs_toolkit.settings.presets import auto_layout, preset_for_layout
from pbs_toolkit.settings.vllm_overrides import base_name, chunks


@dataclass(frozen=True)
class Recommendation:
    preset: str
    why: str
    launch: str


def launch_argv(record: JobRecord, preset: str, options: list[str]) -> list[str]:
    """``pbstk launch MODEL --preset PRESET --profile P --name N OPTIONS...`` for ``record``'s job."""
    argv = ["pbstk", "launch", record.model, "--preset", preset, "--profile", record.profile]
    if record.name:
        argv += ["--name", record.name]
    return argv + options


def with_relaunches(record: JobRecord, findings: list[Finding]) -> list[Finding]:
    """``findings``, each with the command that relaunches ``record``'s job with its remedy (:func:`relaunch`)."""
    return [replace(f, relaunch=relaunch(record, f.remedy)) for f in findings]


def relaunch(record: JobRecord, remedy: Remedy | None) -> str | None:
    """The job's launch command with ``remedy`` applied, or ``None``: no remedy, a flag to drop that the preset
    itself renders (no ``--vllm-arg`` takes it away), or nothing that would change."""
    if remedy is None:
        return None
    spec = record.spec
    options, user = split_vllm_args(list(spec.options))
    rendered = list(spec.vllm_args)  # the preset's flags, then the user's (jobs/plan.py _vllm_args)
    preset_part = rendered[:len(rendered) - len(user)] if user and rendered[-len(user):] == user else rendered
    by_preset = {base_name(c[0]) for c in chunks(preset_part) if c[0].startswith("-")}
    if any(base_name(flag) in by_preset for flag in remedy.drop):
        return None
    names = {base_name(flag) for flag in (*remedy.drop, *remedy.set)}
    args = [arg for chunk in chunks(user) if base_name(chunk[0]) not in names for arg in chunk]
    # a bare --X / --no-X is vLLM's default once the user's other spelling is gone, unless the preset says it
    args += [flag for flag in remedy.set if "=" in flag or base_name(flag) in by_preset]
    eager_off = ["--no-eager"] if remedy.eager_off and spec.eager else []
    asked = "auto" if record.preset.startswith("auto (") else record.preset
    preset = preset_for_layout(*remedy.layout) if remedy.layout else asked
    if args == user and not eager_off and preset == asked:
        return None
    return shlex.join(launch_argv(record, preset, options + [f"--vllm-arg={a}" for a in args] + eager_off))


def recommend(record: JobRecord, ctx: DoctorContext) -> Recommendation | None:
    """The preset for this model on the job's GPUs and the launch line, or ``None``: no GPUs, size unknown (a
    guess could put a large model on one GPU), no layout fits, or the recommended layout is the running one."""
    if not ctx.gpus or ctx.device == "cpu" or ctx.model_params_b is None:
        return None
    try:
        tp, dp, why = auto_layout(ctx.model_params_b, ctx.gpus)
    except UsageError:
        return None
    spec = record.spec
    running = (spec.tensor_parallel or 1, spec.data_parallel or 1, spec.pipeline_parallel or 1)
    if running == (tp, dp, 1) and (not spec.eager or ctx.eager_fallback):
        return None
    preset = preset_for_layout(tp, dp)
    return Recommendation(preset, why, shlex.join(launch_argv(record, preset, list(spec.options))))
