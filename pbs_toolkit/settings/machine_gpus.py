"""What a profile of a scheduler whose jobs run on this machine (``local``) does not say about its GPUs, this
machine says: the count (``gpus_per_node``, when the profile and the layers above it leave it at the package's
default) and each GPU's memory (``gpu_memory_gb``, when none says it), from the GPUs the submitting shell's
``CUDA_VISIBLE_DEVICES`` names, else those ``nvidia-smi`` lists (the backend's ``machine_gpus``). So ``auto``, the
packing of several models and ``--max-awake`` plan with this machine's GPUs, and two local jobs never get the
same GPU at 0.95 each (docs/settings.md "The local scheduler's GPUs"). A profile whose jobs run over ssh is not
asked: resolving settings connects nowhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.transports.local import LocalRunner

#: the source a learnt value shows (``pbstk config show``)
SOURCE = "this machine (CUDA_VISIBLE_DEVICES, else nvidia-smi)"
_seen: dict[tuple[tuple[str, str], ...], list[Any]] = {}


def this_machine(scheduler: str) -> list[Any]:
    """Backend ``scheduler``'s view of this machine's GPUs; asked once in a process while what can change its
    answer stays (``CUDA_VISIBLE_DEVICES``, ``PATH``: which ``nvidia-smi``, and pbstk's own ``PBSTK_*``)."""
    key = (("", scheduler), *sorted((k, v) for k, v in os.environ.items()
                                    if k in ("CUDA_VISIBLE_DEVICES", "PATH") or k.startswith("PBSTK_")))
    if key not in _seen:
        gpus = backend_class(scheduler)().machine_gpus(LocalRunner())
        _seen.clear()  # one entry: the environment of the last ask
        _seen[key] = list(gpus or [])
    return _seen[key]


def learn(profile: Profile, given: Callable[[str], bool],
          ask: Callable[[str], list[Any]] = this_machine) -> tuple[Profile, dict[str, str]]:
    """``profile`` with this machine's GPU count and memory where nothing set them (``given(key)``: a layer
    set it), and the keys learnt -> their source; unchanged for a backend whose jobs run elsewhere."""
    if not backend_class(profile.scheduler).runs_on_submit_host or profile.ssh_host:
        return profile, {}
    count_open = not given("gpus_per_node")
    memory_open = not profile.gpu_memory_gb and not given("gpu_memory_gb")
    if not (count_open or memory_open) or (not count_open and not profile.gpus_per_node):
        return profile, {}
    gpus = ask(profile.scheduler)
    learnt: dict[str, Any] = {}
    if count_open:
        learnt["gpus_per_node"] = len(gpus)
    sizes = [g.memory_mib for g in gpus if g.memory_mib]
    if memory_open and sizes:
        learnt["gpu_memory_gb"] = min(sizes) // 1024  # GiB, as profiles write an 80 GB GPU's 79.6 GiB: 80 -> 79
    return replace(profile, **learnt), dict.fromkeys(learnt, SOURCE)
