"""pbstk's own registry, YAML or JSON: ``{"endpoints": {alias: {model, url, key_env, updated, [api_key]}}}``.

Other top-level keys, and other keys inside an entry, are kept. Unlike the verifiers formats this one may hold
the API key itself (``api_key``), so a file that does is written with mode 0600.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.errors import RegistryError

SECTION = "endpoints"


def _load(text: str, fmt: str, path: Path) -> dict[str, Any]:
    if fmt == "json":
        if not text.strip():
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{path}: cannot parse as JSON: line {exc.lineno}: {exc.msg}") from exc
    else:
        import yaml

        # The C loader (when PyYAML has libyaml) is the same safe loader, about ten times faster.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        try:
            data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, chosen above
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise RegistryError(f"{path}: cannot parse as YAML: {where}{problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RegistryError(f"{path}: cannot parse: expected a mapping at the top, got {type(data).__name__}")
    section = data.get(SECTION)
    if section is not None and not isinstance(section, dict):
        raise RegistryError(
            f"{path}: cannot parse: '{SECTION}' must be a mapping, got {type(section).__name__}"
        )
    return data


def _dump(data: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def parse(text: str, path: Path, fmt: str) -> dict[str, EndpointEntry]:
    """Every entry; one that lacks ``model``, ``url`` or ``key_env`` is an error naming the file and alias."""
    section = _load(text, fmt, path).get(SECTION) or {}
    entries: dict[str, EndpointEntry] = {}
    for alias, fields in section.items():
        if not isinstance(fields, dict):
            raise RegistryError(f"{path}: {SECTION}.{alias}: expected a mapping, got {type(fields).__name__}")
        values = {}
        for key in ("model", "url", "key_env"):
            value = fields.get(key)
            if not isinstance(value, str):
                raise RegistryError(f"{path}: {SECTION}.{alias}: '{key}' must be a string, got {value!r}")
            values[key] = value
        entries[str(alias)] = EndpointEntry(alias=str(alias), **values)
    return entries


def holds_secret(data: dict[str, Any]) -> bool:
    section = data.get(SECTION) or {}
    return any(isinstance(f, dict) and f.get("api_key") for f in section.values())


def upsert(
    text: str | None, entry: EndpointEntry, path: Path, fmt: str, api_key: str | None = None
) -> tuple[str, bool]:
    """Return the new text with the alias's entry set, and whether the file now holds any API key."""
    data = _load(text, fmt, path) if text is not None else {}
    section = data.get(SECTION)
    if section is None:
        section = data[SECTION] = {}
    fields = section.get(entry.alias)
    fields = dict(fields) if isinstance(fields, dict) else {}
    fields.update(
        model=entry.model,
        url=entry.url,
        key_env=entry.key_env,
        updated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    if api_key is not None:
        fields["api_key"] = api_key
    else:
        fields.pop("api_key", None)  # a stale key for a re-launched server would be wrong, not merely old
    section[entry.alias] = fields
    return _dump(data, fmt), holds_secret(data)


def remove(text: str, alias: str, path: Path, fmt: str) -> str | None:
    """Return the new text without the alias's entry, or None if the alias is not there."""
    data = _load(text, fmt, path)
    section = data.get(SECTION) or {}
    if alias not in section:
        return None
    del section[alias]
    return _dump(data, fmt)
