"""The vLLM flags that set a parallel layout, refused in ``--vllm-arg`` whatever the preset (docs/vllm.md).

pbstk requests the preset's TP x PP x DP GPUs, spread over ``--nodes``, and renders the flags of that layout
itself; on several nodes the start script adds each node's rank and wiring flags (server/start/peers.sh). A
``--vllm-arg`` that sets one of them makes vLLM run a layout the job was not sized for (DP4 x TP2 = 8 GPUs in a
4-GPU job) or contradicts what a node was told, so it is refused in one line that says what to use instead:
for a size, the presets that have it (computed from the preset data, the user's too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pbs_toolkit.errors import UsageError
from pbs_toolkit.settings.presets import Preset, list_presets, load_preset

#: the sizes pbstk requests GPUs for: flag -> (vLLM's short spelling, the layout's letters, the preset key)
SIZE_FLAGS = {
    "--tensor-parallel-size": ("-tp", "TP", "tensor_parallel"),
    "--pipeline-parallel-size": ("-pp", "PP", "pipeline_parallel"),
    "--data-parallel-size": ("-dp", "DP", "data_parallel"),
}
_SPREAD = "--nodes/--gpus-per-node spread a preset over nodes"
_PER_NODE = f"the start script sets it on each node of a layout over several nodes ({_SPREAD})"
_ENGINE = ("pbstk starts the layout's processes itself, with the engine the profile's multinode_engine (native "
           "or ray) picks")
_ONE_ENDPOINT = "pbstk's endpoint is the head's API server, which balances over every data-parallel rank"
#: every other layout flag: long name -> (vLLM's short spellings, why it is refused)
OTHER_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "--data-parallel-size-local": (("-dpl",), f"pbstk sets the data-parallel ranks per node ({_SPREAD})"),
    "--prefill-context-parallel-size": (("-pcp",), "it multiplies the GPUs vLLM uses beyond the preset's "
                                        "TP x PP x DP, which is what pbstk requests"),
    "--headless": ((), _PER_NODE),
    "--data-parallel-start-rank": (("-dpr",), _PER_NODE),
    "--data-parallel-rank": (("-dpn",), _PER_NODE),
    "--data-parallel-address": (("-dpa",), _PER_NODE),
    "--data-parallel-rpc-port": (("-dpp",), _PER_NODE),
    "--nnodes": (("-n",), _PER_NODE),
    "--node-rank": (("-r",), _PER_NODE),
    "--master-addr": ((), _PER_NODE),
    "--master-port": ((), _PER_NODE),
    "--distributed-executor-backend": ((), _ENGINE),
    "--data-parallel-backend": (("-dpb",), _ENGINE),
    "--data-parallel-hybrid-lb": (("-dph",), _ONE_ENDPOINT),
    "--data-parallel-external-lb": (("-dpe",), _ONE_ENDPOINT),
    "--data-parallel-multi-port-external-lb": (("-dpm",), _ONE_ENDPOINT),
}
_SHORT = {short: long for long, (short, _, _) in SIZE_FLAGS.items()} | {
    short: long for long, (shorts, _) in OTHER_FLAGS.items() for short in shorts}
#: argparse takes a one-letter option's value glued on: ``-n2`` is ``--nnodes 2``
_GLUED = re.compile(r"^(-[nr])\d")
_NUMBER = re.compile(r"^-\d")


def layout_flag(arg: str) -> str | None:
    """The layout flag ``arg`` sets, by its long name, else ``None``: ``-tp``, ``-tp=2``,
    ``--tensor_parallel_size=2`` (vLLM reads ``_`` as ``-``) -> ``--tensor-parallel-size``; ``-n2`` ->
    ``--nnodes``; ``--no-data-parallel-hybrid-lb`` -> ``--data-parallel-hybrid-lb``."""
    if not arg.startswith("-") or _NUMBER.match(arg):
        return None
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
        name = "--" + name[len("--no-"):] if name.startswith("--no-") else name
        return name if name in SIZE_FLAGS or name in OTHER_FLAGS else None
    glued = _GLUED.match(name)
    return _SHORT.get(glued.group(1) if glued else name)


def refuse_layout_flags(user_args: Sequence[str], preset: Preset | str) -> None:
    """A ``UsageError`` (one line) for the first ``--vllm-arg`` in ``user_args`` that sets a layout flag;
    ``preset`` is what the job is sized for (``auto`` before or after sizing: ``auto (TP2 x DP2)``), or its
    name, loaded only when there is a flag to refuse (an unknown preset is then refused where it was before)."""
    for index, arg in enumerate(user_args):
        flag = layout_flag(arg)
        if flag is None:
            continue
        if isinstance(preset, str):
            preset = load_preset(preset)
        named = preset.auto or preset.name.endswith(")")
        sized_for = preset.name if named else f"{preset.name} ({preset.layout()})"
        value = arg.split("=", 1)[1] if "=" in arg else None
        if value is None and index + 1 < len(user_args) and not user_args[index + 1].startswith("-"):
            value = user_args[index + 1]
        given = arg if "=" in arg or value is None else f"{arg} {value}"
        why = _size_advice(flag, value) if flag in SIZE_FLAGS else OTHER_FLAGS[flag][1]
        raise UsageError(f"--vllm-arg {given}: pbstk sizes the job's GPUs and nodes for the layout of preset "
                         f"{sized_for} and renders its flags itself; {why}")


def _size_advice(flag: str, value: str | None) -> str:
    """The presets that have the size ``value`` asks for (``for TP2 use --preset tp2, tp2-eager or tp2dp2``)."""
    _, letters, key = SIZE_FLAGS[flag]
    try:
        size = int(value) if value is not None else None
    except ValueError:
        size = None
    presets = [p.name for p in list_presets() if not p.auto and p.device == "gpu"
               and (getattr(p, key) == size if size is not None else getattr(p, key) > 1)]
    wanted = f"{letters}{size}" if size is not None else f"{letters} > 1"
    if not presets:
        return f"no preset has {wanted}: add one of your own (~/.config/pbstk/presets/NAME.yaml, docs/settings.md)"
    choices = presets[0] if len(presets) == 1 else f"{', '.join(presets[:-1])} or {presets[-1]}"
    return f"for {wanted} use --preset {choices} (`pbstk presets`; {_SPREAD})"
