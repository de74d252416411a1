"""Presets: named vLLM layouts and flags, shipped as YAML data (``pbs_toolkit/settings/presets/*.yaml``).

Users add their own in ``$XDG_CONFIG_HOME/pbstk/presets/NAME.yaml`` (same schema; a user preset with a
shipped name replaces it). ``auto`` is resolved at render time from the model size and the GPUs granted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError, UsageError
from pbs_toolkit.schema import stamp
from pbs_toolkit.settings.yamlio import Fields, load_yaml_mapping, require_file

_KEYS = {
    "name", "summary", "rationale", "tensor_parallel", "data_parallel", "pipeline_parallel",
    "eager", "device", "vllm_args", "env", "auto", "text_only",
}


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    rationale: str
    tensor_parallel: int = 1
    data_parallel: int = 1
    pipeline_parallel: int = 1
    eager: bool = False
    device: str = "gpu"  # "gpu" or "cpu"
    #: flag -> value as written in YAML; ``True`` renders a bare flag, ``False`` the ``--no-`` form
    vllm_args: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    auto: bool = False
    #: a vision-language model serves text only (settings/multimodal.py); a profile's or the flag's value wins
    text_only: bool = False
    source: str = "builtin"

    @property
    def gpus(self) -> int:
        """GPUs this layout occupies (0 on CPU)."""
        if self.device == "cpu":
            return 0
        return self.tensor_parallel * self.data_parallel * self.pipeline_parallel

    def layout(self) -> str:
        if self.device == "cpu":
            return "cpu"
        parts = []
        if self.tensor_parallel > 1:
            parts.append(f"TP{self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(f"PP{self.pipeline_parallel}")
        if self.data_parallel > 1 or not parts:
            parts.append(f"DP{self.data_parallel}")
        return "x".join(parts)

    def flag_args(self) -> list[str]:
        """The preset's own flags as an argument list (parallelism and eager mode excluded)."""
        out: list[str] = []
        for flag, value in self.vllm_args.items():
            if value is True:
                out.append(flag)
            elif value is False:
                out.append("--no-" + flag[2:])
            else:
                out.extend([flag, str(value)])
        return out

    def to_dict(self) -> dict[str, Any]:
        """A ``preset`` object (``presets --json``, ``presets show --json``; docs/json.md)."""
        return stamp("preset", {
            "name": self.name, "summary": self.summary, "layout": "auto" if self.auto else self.layout(),
            "gpus": None if self.auto else self.gpus, "auto": self.auto, "device": self.device,
            "tensor_parallel": self.tensor_parallel, "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel, "eager": self.eager, "flags": self.flag_args(),
            "vllm_args": dict(self.vllm_args), "env": dict(self.env), "text_only": self.text_only,
            "rationale": self.rationale,
            "source": self.source,
        })


#: more GPUs than any node and any sensible server; larger values are typos
MAX_PARALLEL = 1024


def _builtin_dir() -> Path:
    return Path(__file__).parent / "presets"


def _parse(data: dict[str, object], source: Path) -> Preset:
    f = Fields(data, str(source), _KEYS)
    name = f.get_str("name", source.stem) or source.stem
    args = data.get("vllm_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{source}: key 'vllm_args' must be a mapping of --flag: value")
    for flag, value in args.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise ConfigError(f"{source}: vllm_args key {flag!r} must start with '--'")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{source}: vllm_args.{flag} must be a string, number or true/false")
        if isinstance(value, float) and not math.isfinite(value):  # YAML .inf/.nan: vLLM would refuse it later
            raise ConfigError(f"{source}: vllm_args.{flag} must be a finite number, got {value!r}")
    for key in ("tensor_parallel", "data_parallel", "pipeline_parallel"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_PARALLEL:
            raise ConfigError(f"{source}: key {key!r} must be at most {MAX_PARALLEL}, got {value}")
    device = f.get_str("device", "gpu") or "gpu"
    if device not in ("gpu", "cpu"):
        raise ConfigError(f"{source}: key 'device' must be 'gpu' or 'cpu', got {device!r}")
    return Preset(
        name=name,
        summary=f.get_str("summary", "") or "",
        rationale=" ".join((f.get_str("rationale", "") or "").split()),
        tensor_parallel=f.get_int("tensor_parallel", 1, minimum=1),
        data_parallel=f.get_int("data_parallel", 1, minimum=1),
        pipeline_parallel=f.get_int("pipeline_parallel", 1, minimum=1),
        eager=f.get_bool("eager", False),
        device=device,
        vllm_args=dict(args),
        env=f.get_str_map("env"),
        auto=f.get_bool("auto", False),
        text_only=f.get_bool("text_only", False),
        source=str(source),
    )


def _preset_files() -> dict[str, Path]:
    files = {p.stem: p for p in sorted(_builtin_dir().glob("*.yaml"))}
    user_dir = paths.user_config_dir() / "presets"
    if user_dir.is_dir():
        files.update({p.stem: p for p in sorted(user_dir.glob("*.yaml"))})
    return files


def list_presets() -> list[Preset]:
    """Every preset, shipped and the user's, sorted by name."""
    return [load_preset(name) for name in sorted(_preset_files())]


def load_preset(name_or_path: str) -> Preset:
    """Load a preset by name (user presets first) or from a YAML file path."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")):
        require_file(path, "preset file")
        return _parse(load_yaml_mapping(path), path)
    files = _preset_files()
    if name_or_path not in files:
        raise UsageError(f"unknown preset {name_or_path!r} (known: {', '.join(sorted(files))})")
    return _parse(load_yaml_mapping(files[name_or_path]), files[name_or_path])


# --- auto -------------------------------------------------------------------------------------------


_SEVENTY_B_CLASS = 72.0


def auto_layout(params_b: float | None, gpus: int) -> tuple[int, int, str]:
    """(tensor_parallel, data_parallel, why) for a model of ``params_b`` billion parameters on ``gpus``.

    Rule of thumb, checked against docs/vllm.md "Measured performance" (on NVLink DP and TP differ by ~10%; eager costs
    4-8x): below 7B every GPU holds a full replica (pure DP); 7-20B TP2 x DP; 20-70B TP4 x DP; above 70B TP8.
    "70B" means the 70B class: Llama-70B counts ~70.6B from its config.json (embeddings included) and must
    get the same layout as its name says, so the upper bound is 72B (Qwen2.5-72B, 72.7B, is above it).
    Unknown size: one GPU per replica as well, since data parallelism never needs cross-GPU traffic.
    """
    if gpus < 1:
        raise UsageError(
            f"preset auto needs at least one GPU but {gpus} GPU(s) are requested; "
            "use --preset cpu on a machine without GPUs"
        )
    if params_b is None:
        tp, why = 1, "model size unknown: one replica per GPU"
    elif params_b < 7:
        tp, why = 1, f"{params_b:.1f}B < 7B fits one GPU: pure data parallelism"
    elif params_b < 20:
        tp, why = 2, f"{params_b:.1f}B in 7-20B: tensor parallel 2 per replica"
    elif params_b < _SEVENTY_B_CLASS:
        tp, why = 4, f"{params_b:.1f}B in 20-70B: tensor parallel 4 per replica"
    else:
        tp, why = 8, f"{params_b:.1f}B > 70B: tensor parallel 8"
    if tp > gpus:
        raise UsageError(
            f"preset auto: a {params_b:.0f}B model needs tensor parallel {tp} but only {gpus} GPU(s) are requested"
        )
    return tp, max(1, gpus // tp), why


def resolve_auto(preset: Preset, params_b: float | None, gpus: int) -> Preset:
    """Turn the ``auto`` preset into a concrete layout."""
    tp, dp, why = auto_layout(params_b, gpus)
    name = f"auto ({f'TP{tp} x ' if tp > 1 else ''}DP{dp})"
    return replace(preset, name=name, tensor_parallel=tp, data_parallel=dp, auto=False,
                   summary=f"{preset.summary} -> {why}")


def preset_for_layout(tensor_parallel: int, data_parallel: int) -> str:
    """The graphs-on GPU preset with exactly this layout (shipped or the user's), else ``auto``."""
    for preset in list_presets():
        if (not preset.auto and not preset.eager and preset.device == "gpu" and preset.pipeline_parallel == 1
                and (preset.tensor_parallel, preset.data_parallel) == (tensor_parallel, data_parallel)):
            return preset.name
    return "auto"


def params_from_name(model: str) -> float | None:
    """Parameter count in billions from names like ``Qwen3-VL-2B-Instruct``, ``Llama-3.1-70B``, ``0.5B``."""
    found = re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)\s*([BbMm])(?![A-Za-z])", model.split("/")[-1])
    for number, unit in reversed(found):
        value = float(number)
        return value if unit in "Bb" else value / 1000.0
    # mixture-of-experts names such as 8x7B
    moe = re.search(r"(\d+)x(\d+(?:\.\d+)?)B", model)
    if moe:
        return float(moe.group(1)) * float(moe.group(2))
    return None


#: no real dimension comes near this; a larger one (``1e308``, ``inf``) is junk, not a model to size
_MAX_DIMENSION = 10**9


def _dimension(value: object) -> int:
    """A positive integer dimension from ``config.json``; ``ValueError`` for junk (``1e308``, ``"abc"``, ``-1``,
    ``true``), so a hostile or broken config.json cannot overflow the size estimate."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, float) and not value.is_integer():  # nan and inf as well
        raise ValueError(f"not an integer: {value!r}")
    number = int(value)  # "abc" -> ValueError
    if not 1 <= number <= _MAX_DIMENSION:
        raise ValueError(f"out of range: {value!r}")
    return number


def _text_config(config: dict[str, object]) -> dict[str, object]:
    """The language model's part of a ``config.json`` (a vision-language model's ``text_config``)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(cfg, dict)
    return cfg


def _attention(cfg: dict[str, object]) -> tuple[int, int, int, int, int]:
    """(hidden size, layers, attention heads, KV heads, head dim) of a decoder-only transformer's config;
    ``KeyError``/``ValueError``/... for one that cannot be told."""
    h = _dimension(cfg["hidden_size"])
    layers = _dimension(cfg["num_hidden_layers"])
    heads = _dimension(cfg.get("num_attention_heads", 1))
    kv = _dimension(cfg.get("num_key_value_heads", heads))
    return h, layers, heads, kv, _dimension(cfg.get("head_dim") or h // heads)


_UNTOLD = (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError)


def kv_bytes_per_token(config: dict[str, object], dtype_bytes: int = 2) -> int | None:
    """Bytes of KV cache one token takes in a decoder-only transformer (keys and values of every layer's KV heads,
    16-bit by default), from its ``config.json``; ``None`` when it cannot be told."""
    try:
        _, layers, _, kv, head_dim = _attention(_text_config(config))
    except _UNTOLD:
        return None
    return 2 * layers * kv * head_dim * dtype_bytes


def context_length(config: dict[str, object]) -> int | None:
    """The longest request the model takes (``max_position_embeddings``, what vLLM's ``--max-model-len``
    defaults to), from its ``config.json``; ``None`` when absent or junk."""
    try:
        return _dimension(_text_config(config)["max_position_embeddings"])
    except _UNTOLD:
        return None


def params_from_config(config: dict[str, object]) -> float | None:
    """Approximate parameter count (billions) of a decoder-only transformer from its ``config.json``."""
    cfg = _text_config(config)
    try:
        h, layers, heads, kv, head_dim = _attention(cfg)
        vocab = _dimension(cfg.get("vocab_size", 32000))
        inter = _dimension(cfg.get("intermediate_size", 4 * h))
        experts = _dimension(cfg.get("num_local_experts") or cfg.get("num_experts") or 1)
    except _UNTOLD:
        return None  # not a model we can size: the layout falls back to "size unknown"
    attn = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    mlp = 3 * h * inter * experts
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    total = layers * (attn + mlp) + embed
    return round(total / 1e9, 3) if math.isfinite(total) else None
