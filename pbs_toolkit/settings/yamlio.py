"""Loading YAML data files (presets, profiles, user config) with errors that name the file and key.

A neutral module that lives beside its main users: it imports only the neutral modules, so every floor may
read the user's config through it (scripts/check_imports.py LAYERS places it on floor 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError


def user_config() -> dict[str, Any]:
    """The user's ``config.yaml`` (XDG config directory) as a mapping; ``{}`` when there is none."""
    path = paths.user_config_dir() / "config.yaml"
    if not path.is_file():
        return {}
    return load_yaml_mapping(path)


def require_file(path: Path, what: str) -> None:
    """``ConfigError`` unless ``path`` is a regular file; a name the filesystem cannot look up (over 255 bytes:
    ENAMETOOLONG, which ``Path.is_file`` raises) is refused the same way instead of a traceback."""
    try:
        exists = path.is_file()
    except OSError as exc:
        shown = str(path) if len(str(path)) <= 80 else str(path)[:77] + "..."
        raise ConfigError(f"{what} {shown}: {exc.strerror or exc}") from None
    if not exists:
        raise ConfigError(f"{what} {path} does not exist")


def load_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read ``path`` with ``yaml.safe_load`` and require a mapping at the top."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


class Fields:
    """Typed access to one mapping loaded from ``source``; each error names the file and the key."""

    def __init__(self, data: dict[str, Any], source: str, known: set[str]) -> None:
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        self.data = data
        self.source = source

    def _bad(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.source}: key {key!r} must be {expected}, got {self.data[key]!r}")

    def get_str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        if key not in self.data or self.data[key] is None:
            if required:
                raise ConfigError(f"{self.source}: missing required key {key!r}")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self._bad(key, "a string")
        return str(value)

    def get_int(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self.data.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(key, f"an integer >= {minimum}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def get_str_list(self, key: str) -> list[str]:
        value = self.data.get(key) or []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise self._bad(key, "a list of strings")
        return [str(v) for v in value]

    def get_str_map(self, key: str) -> dict[str, str]:
        value = self.data.get(key) or {}
        if not isinstance(value, dict):
            raise self._bad(key, "a mapping of names to strings")
        out: dict[str, str] = {}
        for k, v in value.items():
            if isinstance(v, bool):
                v = "1" if v else "0"
            if not isinstance(v, (str, int, float)):
                raise ConfigError(f"{self.source}: key {key}.{k} must be a string, got {v!r}")
            out[str(k)] = str(v)
        return out
