"""How many vLLM API-server processes front one job's engine (``--api-server-count``; docs/vllm.md "API servers").

One API-server process (vLLM's default for one engine) turns every request's tokens into HTTP on one core, and at
the concurrency campaigns use that core is the ceiling of a one-GPU replica: on one H200 (vLLM 0.22.1,
Qwen3-1.7B-shaped, `single`, benchmarks/README.md "1x H200, session 15") one process made 23,657 output tok/s at
c=1024 and four made 41,412 (1.75x), mean TTFT 7.3 s against 2.2 s; at c=512 19,182 against 33,588. So the
one-GPU presets (``single``, and ``auto`` where it gives one GPU) ask for ``ONE_GPU_SERVERS``.

Where it is left out: layouts of several GPUs that ``auto`` gives (vLLM runs one API server per data-parallel rank
from 0.15 by itself; tensor-parallel layouts were not measured), and models that swap (their guard counts the
requests in flight per process: docs/multi-model.md "Swapping"). vLLM before 0.10 does not know the flag: the
preset's is dropped with a note there (settings/vllm_flags.py).
"""

from __future__ import annotations

from dataclasses import replace

from pbs_toolkit.settings.presets import Preset

FLAG = "--api-server-count"
#: the count the one-GPU presets ask for (the figures above)
ONE_GPU_SERVERS = 4
#: what tells a swapping model's arguments (jobs/render.py SWAP_VLLM_ARGS)
_SLEEP_FLAG = "--enable-sleep-mode"


def front_preset(preset: Preset, user_args: list[str] | tuple[str, ...], from_auto: bool) -> tuple[Preset, list[str]]:
    """``preset`` without its ``--api-server-count`` where it does not apply, and a note when one was dropped:
    ``auto``'s (``from_auto``) on a layout of more than one GPU, anyone's on a model that swaps (``user_args``
    hold sleep mode). A ``--vllm-arg`` of the flag replaces the preset's anyway (settings/vllm_overrides.py).
    (The CPU build never gets one: its ``cpu`` preset has none, and the GPU presets refuse a profile without GPUs.)"""
    if FLAG not in preset.vllm_args:
        return preset, []
    gpus = preset.tensor_parallel * preset.pipeline_parallel * preset.data_parallel
    if _SLEEP_FLAG in user_args:
        why = "a swapping model's guard counts its requests in one API-server process"
    elif from_auto and gpus > 1:
        why = f"measured for one GPU; on {gpus} GPUs vLLM's own default applies"
    else:
        return preset, []
    args = {k: v for k, v in preset.vllm_args.items() if k != FLAG}
    return replace(preset, vllm_args=args), [f"dropped {FLAG} from preset {preset.name}: {why}"]
