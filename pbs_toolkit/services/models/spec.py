"""The models of a multi-model service (issue 31; docs/multi-model.md): ``MODEL[:preset=P][:name=N]`` arguments
or a ``--models FILE.yaml``, parsed strictly into :class:`ModelSpec` values before anything is sized or queued.

Only TRAILING ``:key=value`` parts whose key is a lower-case word are options: a Hugging Face id never holds a
``:`` (its characters are letters, digits, ``.``, ``_``, ``-`` and one ``/``), and a local path keeps any ``:``
that is not followed by ``word=``. A path that does end in ``:word=...`` is given in a ``--models`` file, whose
``model:`` values are taken as written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.plan import served_model_name, slug
from pbs_toolkit.settings.presets import load_preset
from pbs_toolkit.settings.yamlio import load_yaml_mapping, require_file

#: the options a model may carry, in a ``:key=value`` suffix or as keys of a ``--models`` entry
OPTION_KEYS = ("preset", "name")
_OPTION = re.compile(r"([a-z][a-z_]*)=(.*)", re.DOTALL)
#: a served name clients send as ``model``: what a Hub id or a slug looks like (no ``:``, no space)
_SERVED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_FILE_KEYS = ("models",)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the service: what vLLM loads, its own preset (``None``: the command's) and its served name."""

    model: str
    preset: str | None
    served_model_name: str
    #: where it was given, for error lines: ``MODEL argument 2``, ``models.yaml: models[1]``
    where: str


def split_options(text: str, where: str) -> tuple[str, dict[str, str]]:
    """``"org/m:preset=single:name=q"`` -> ``("org/m", {"preset": "single", "name": "q"})``; an unknown, repeated
    or empty option is a ``UsageError`` naming ``where``."""
    parts = text.split(":")
    options: dict[str, str] = {}
    while len(parts) > 1 and (found := _OPTION.fullmatch(parts[-1])):
        key, value = found.group(1), found.group(2)
        if key not in OPTION_KEYS:
            raise UsageError(f"{where} {text!r}: unknown option {key!r} (known: {', '.join(OPTION_KEYS)})")
        if key in options:
            raise UsageError(f"{where} {text!r}: option {key!r} given twice")
        if not value:
            raise UsageError(f"{where} {text!r}: option {key!r} has no value")
        options[key] = value
        parts.pop()
    return ":".join(parts), options


def parse_models(arguments: Sequence[str], models_file: str | None) -> list[ModelSpec]:
    """The service's models from MODEL arguments or a ``--models`` file (not both), each preset loaded and each
    served name checked and unique; the first problem is one ``UsageError``/``ConfigError``."""
    if arguments and models_file:
        raise UsageError("give MODEL arguments or --models FILE, not both")
    if models_file:
        specs = _from_file(Path(models_file))
    elif arguments:
        specs = [_spec(*split_options(text, f"MODEL argument {i}"), f"MODEL argument {i}")
                 for i, text in enumerate(arguments, 1)]
    else:
        raise UsageError("missing MODEL: give one or more models, or --models FILE")
    _check_unique(specs)
    return specs


def _spec(model: str, options: dict[str, Any], where: str) -> ModelSpec:
    if not model or "\n" in model or "\0" in model:
        raise UsageError(f"{where}: the model is empty or holds a newline")
    preset, name = options.get("preset"), options.get("name")
    if preset is not None:
        load_preset(preset)  # an unknown preset or a bad preset file: its own one-line error
    if name is not None and not _SERVED.fullmatch(name):
        raise UsageError(f"{where}: served name {name!r}: letters, digits, '.', '_', '/' and '-' (at most 128), "
                         "starting with a letter or digit")
    served = name or served_model_name(model, None, slug(model))
    return ModelSpec(model=model, preset=preset, served_model_name=served, where=where)


def _from_file(path: Path) -> list[ModelSpec]:
    """``models:`` a list of model ids (taken as written) or of ``{model, preset, name}`` mappings."""
    require_file(path, "--models file")
    data = load_yaml_mapping(path)
    unknown = sorted(set(data) - set(_FILE_KEYS))
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(_FILE_KEYS)})")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{path}: 'models' must be a non-empty list of models")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{path}: models[{i}]"
        if isinstance(entry, str):
            specs.append(_spec(entry, {}, where))
            continue
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: a model id or a mapping with 'model', got {type(entry).__name__}")
        bad = sorted(set(entry) - {"model", *OPTION_KEYS})
        if bad:
            raise UsageError(f"{where}: unknown key {str(bad[0])!r} (known: model, {', '.join(OPTION_KEYS)})")
        if not all(isinstance(v, str) for v in entry.values()):
            raise UsageError(f"{where}: 'model', 'preset' and 'name' must be strings")
        if "model" not in entry:
            raise UsageError(f"{where}: no 'model'")
        specs.append(_spec(entry["model"], {k: v for k, v in entry.items() if k != "model"}, where))
    return specs


def _check_unique(specs: list[ModelSpec]) -> None:
    """Two models may not answer to one served name: a request's ``model`` field must pick exactly one."""
    seen: dict[str, ModelSpec] = {}
    for spec in specs:
        first = seen.setdefault(spec.served_model_name, spec)
        if first is not spec:
            raise UsageError(f"served name {spec.served_model_name!r} is given twice ({first.where} and "
                             f"{spec.where}); give one of them :name=OTHER")
