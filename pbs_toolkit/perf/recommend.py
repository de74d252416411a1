"""``doctor``'s closing advice: the preset to launch instead, as a command a user can paste.

The command keeps everything else the job was launched with (``LaunchSpec.options``: ``--account``, ``--queue``,
``--vllm-arg``, ...), so it reaches the same allocation with the same flags; and it is never the layout that
already runs (advice to relaunch what runs is noise, and after an eager fallback it would fail the same way).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.perf.doctor import DoctorContext
from pbs_toolkit.settings.presets import auto_layout, preset_for_layout


@dataclass(frozen=True)
class Recommendation:
    preset: str
    why: str
    launch: str


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
    argv = ["pbstk", "launch", record.model, "--preset", preset, "--profile", record.profile]
    if record.name:
        argv += ["--name", record.name]
    return Recommendation(preset, why, shlex.join(argv + list(spec.options)))
