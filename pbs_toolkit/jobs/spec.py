"""``LaunchSpec``: what a job was launched with, as one typed value instead of keys in ``JobRecord.extra``.

``launch`` writes it once; ``perf`` (doctor, bench) and ``status`` read it. It is stored as JSON in the job
store's ``spec`` column and in ``RUN_DIR/pbstk-job.json``. Stores, intents and run directories written before
it existed kept these keys in ``extra``; :func:`split_legacy_extra` moves them over when such a row is read, so
old stores keep working (``store.py`` also migrates the rows themselves).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class LaunchSpec:
    """The launch settings later commands need. Every field has a default: records adopted from an old run
    directory may know none of them, and readers then fall back as they always did."""

    #: vLLM's arguments as rendered (parallelism flags included, eager mode excluded)
    vllm_args: list[str] = field(default_factory=list)
    #: e.g. ``TP2xDP2``
    layout: str = ""
    tensor_parallel: int = 1
    data_parallel: int = 1
    pipeline_parallel: int = 1
    gpus: int = 0
    eager: bool = False
    vllm_version: str = ""
    #: the SSH host the job was submitted through, ``None`` for this machine
    ssh_host: str | None = None
    vllm_cache_root: str | None = None
    #: the model's size in billions of parameters, when render could tell
    params_b: float | None = None
    venv: str | None = None
    #: the ``pbstk launch`` options that reproduce the launch besides the model, preset, profile and name
    #: (``--account``, ``--queue``, ``--vllm-arg``, ...): ``doctor``'s recommended command keeps them
    options: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LaunchSpec:
        """A spec from stored JSON. Unknown keys are ignored and a value of the wrong type falls back to the
        default, so one odd row never makes a whole job unreadable."""
        spec = cls()
        if not isinstance(data, dict):
            return spec
        for f in fields(cls):
            if f.name in data:
                value = _coerce(f.name, data[f.name], getattr(spec, f.name))
                setattr(spec, f.name, value)
        return spec


#: the keys ``launch`` wrote into ``extra`` before ``LaunchSpec`` existed
SPEC_KEYS = frozenset(f.name for f in fields(LaunchSpec))


def _coerce(name: str, value: Any, default: Any) -> Any:
    """``value`` if it has the field's type (ints accepted for floats), else ``default``."""
    if name in ("vllm_args", "options"):
        return [str(a) for a in value] if isinstance(value, list) else default
    if name in ("ssh_host", "vllm_cache_root", "venv"):
        return value if value is None or isinstance(value, str) else default
    if name == "params_b":
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        return (float(value) if value is not None else None) if ok else default
    if isinstance(default, bool):
        return value if isinstance(value, bool) else default
    if isinstance(default, int):
        return value if isinstance(value, int) and not isinstance(value, bool) else default
    return value if isinstance(value, str) else default


def split_legacy_extra(extra: dict[str, Any], spec: Any) -> tuple[LaunchSpec, dict[str, Any]]:
    """(spec, extra without the launch keys) for a row that may predate ``LaunchSpec``: launch keys found in
    ``extra`` fill the spec where the stored spec has none (an empty or missing spec column)."""
    legacy = {k: v for k, v in extra.items() if k in SPEC_KEYS}
    rest = {k: v for k, v in extra.items() if k not in SPEC_KEYS}
    stored = spec if isinstance(spec, dict) else {}
    return LaunchSpec.from_dict({**legacy, **stored}), rest


#: ``RenderRequest`` field -> the ``pbstk launch`` option that sets it (the model, preset, profile and name are
#: written out by whoever rebuilds the command)
_OPTIONS = (
    ("served_model_name", "--served-model-name"), ("queue", "--queue"), ("account", "--account"),
    ("walltime", "--walltime"), ("nodes", "--nodes"), ("gpus_per_node", "--gpus-per-node"), ("port", "--port"),
    ("venv", "--venv"), ("runs_root", "--runs-root"), ("vllm_version", "--vllm-version"), ("hf_home", "--hf-home"),
    ("vllm_cache_root", "--vllm-cache-root"), ("scheduler", "--scheduler"), ("ssh_host", "--ssh"),
)


def launch_options(req: Any, account: str | None) -> list[str]:
    """The options of ``req`` (a ``RenderRequest``) as ``pbstk launch`` arguments, ``--account`` included when
    the launch resolved one (from a flag, ``PBSTK_ACCOUNT`` or config.yaml): a command rebuilt from them in
    another shell must reach the same allocation. ``--eager`` is left out (the preset decides it then)."""
    out: list[str] = []
    for key, flag in _OPTIONS:
        value = getattr(req, key, None)
        if key == "account":
            value = value or account
        if value is not None and value != "":
            out += [flag, str(value)]
    if getattr(req, "eager", None) is False:
        out.append("--no-eager")
    text_only = getattr(req, "text_only", None)
    if text_only is not None:
        out.append("--text-only" if text_only else "--no-text-only")
    for arg in getattr(req, "vllm_args", None) or []:
        out.append(f"--vllm-arg={arg}")
    for key, value in (getattr(req, "env", None) or {}).items():
        out += ["--env", f"{key}={value}"]
    return out


#: the options :func:`launch_options` writes with a value in the next argument
_VALUED = frozenset(flag for _, flag in _OPTIONS) | {"--env"}


def split_vllm_args(options: list[str]) -> tuple[list[str], list[str]]:
    """(``options`` without their ``--vllm-arg=...``, the vLLM arguments those carried): the inverse of the
    ``--vllm-arg`` part of :func:`launch_options`, for a command rebuilt with other vLLM arguments (``doctor``'s
    relaunch). A value that follows its option is never taken for a ``--vllm-arg``."""
    rest: list[str] = []
    vllm_args: list[str] = []
    index = 0
    while index < len(options):
        option = options[index]
        if option in _VALUED:
            rest += options[index:index + 2]
            index += 2
            continue
        if option.startswith("--vllm-arg="):
            vllm_args.append(option[len("--vllm-arg="):])
        else:
            rest.append(option)
        index += 1
    return rest, vllm_args
