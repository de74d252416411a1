"""Vision-language models: whether a model is one (its ``config.json``, else its name), and the vLLM flags that follow:
the text-only switch (no image or video per prompt) and the vision encoder's tensor-parallel mode (docs/settings.md
"Vision-language models").

The config is the one launch planning already read for ``auto`` sizing (jobs/plan.py ``resolve_model``); where it
could not be read, the name decides, as it does for the size (``Qwen3-VL-2B-Instruct``, ``Llama-3.2-11B-Vision``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.settings.presets import Preset

LIMIT_FLAG = "--limit-mm-per-prompt"
ENCODER_TP_FLAG = "--mm-encoder-tp-mode"
#: what text-only allows per prompt (Qwen-VL's two modalities; vLLM's default is 999 each)
TEXT_ONLY_LIMITS = {"image": 0, "video": 0}
#: vLLM takes the limits as JSON from 0.10 and refuses the older ``image=0,video=0`` form there (vllm#21615)
LIMIT_JSON_SINCE = (0, 10)
#: where a profile key sits when nobody set it (settings/launch_settings.py ``DEFAULT``): the preset decides then
_UNSET = "package default"
#: architectures of vision-language models that may come without a ``vision_config`` (Llava-style configs nest it)
_VL_ARCH = re.compile(r"VL|Vision|Llava|LLaVA|Pixtral|Idefics|Mllama|PaliGemma|Gemma3ForConditional")
#: names that say vision-language: ``Qwen3-VL-2B``, ``InternVL3-8B``, ``llava-1.5-7b``, ``...-Vision-Instruct``
_VL_NAME = re.compile(r"(?:^|[-_.])vl(?:[-_.\d]|$)|internvl|vision|llava|pixtral|idefics|paligemma", re.IGNORECASE)


def is_multimodal(config: dict[str, Any] | None, model: str) -> bool:
    """Whether ``model`` takes images: a ``vision_config`` (or a vision-language architecture) in its
    ``config.json``; without a readable config, its name."""
    if config:
        if isinstance(config.get("vision_config"), dict):
            return True
        archs = config.get("architectures")
        return isinstance(archs, list) and any(isinstance(a, str) and _VL_ARCH.search(a) for a in archs)
    return bool(_VL_NAME.search(model.rstrip("/").split("/")[-1]))


def limits_value(version: tuple[int, ...]) -> str:
    """``--limit-mm-per-prompt``'s value for no image and no video, in the form ``version`` reads."""
    if version >= LIMIT_JSON_SINCE:
        return json.dumps(TEXT_ONLY_LIMITS, separators=(",", ":"))
    return ",".join(f"{k}={v}" for k, v in TEXT_ONLY_LIMITS.items())


@dataclass(frozen=True)
class TextOnly:
    """The text-only switch of one launch and the layer that set it."""

    on: bool
    #: ``flag --text-only``, ``PBSTK_TEXT_ONLY``, ``config.yaml (...)``, ``profile NAME``, ``preset NAME``
    source: str

    @property
    def from_flag(self) -> bool:
        return self.source.startswith("flag")


def text_only_setting(profile_value: bool, profile_source: str, preset: Preset) -> TextOnly:
    """The flag, ``PBSTK_TEXT_ONLY``, config.yaml or the profile when one of them set ``text_only``, else the
    preset's ``text_only``."""
    if profile_source != _UNSET:
        return TextOnly(profile_value, profile_source)
    return TextOnly(preset.text_only, f"preset {preset.name}")


def multimodal_preset(preset: Preset, model: str, config: dict[str, Any] | None, version: tuple[int, ...],
                      text_only: TextOnly) -> tuple[Preset, list[str]]:
    """``preset`` with its flags fitted to the model: ``--mm-encoder-tp-mode`` kept only for a vision-language model
    under tensor parallelism (vLLM's version is checked later, with every preset flag), the limits set to zero when
    text-only. A text-only switch on a model without vision: refused when the command line asked for it
    (``UsageError``), else a note."""
    vision = is_multimodal(config, model)
    args = dict(preset.vllm_args)
    notes: list[str] = []
    if text_only.on and not vision:
        why = "its config.json has no vision_config" if config else "its name does not say vision-language"
        if text_only.from_flag:
            raise UsageError(f"--text-only: {model} is not a vision-language model ({why}); it serves text only "
                             "already: leave --text-only out")
        notes.append(f"text_only ({text_only.source}) ignored: {model} is not a vision-language model ({why})")
    if text_only.on and vision:
        args[LIMIT_FLAG] = limits_value(version)
        if config is None:
            notes.append(f"text-only: {model}'s config.json is not readable here; taken as vision-language by its name")
    if not vision or text_only.on or preset.tensor_parallel < 2:
        args.pop(ENCODER_TP_FLAG, None)  # no encoder to split (or none that runs): the flag only adds noise
    if args == preset.vllm_args:
        return preset, notes
    return replace(preset, vllm_args=args), notes


def compile_variant(preset: Preset) -> str:
    """``text-only`` when the preset serves a vision-language model without images (its limits at zero), else ``""``:
    the compile cache keeps such starts apart (server/coldstart.py ``layout_key``)."""
    return "text-only" if LIMIT_FLAG in preset.vllm_args else ""
