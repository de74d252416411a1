"""The endpoint entry every registry format stores, and the checks an entry must pass before it is written."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from pbs_toolkit.errors import RegistryError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Cc: control characters; Cf: invisible format characters; Zl/Zp: line and paragraph separators.
_FORBIDDEN_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


@dataclass(frozen=True)
class EndpointEntry:
    """One OpenAI-compatible endpoint as evaluation tools see it."""

    alias: str
    """The name users pass to their tool, e.g. ``vf-eval -m qwen3-vl-2b``."""
    model: str
    """The model name the server serves (``--served-model-name``)."""
    url: str
    """Base URL including ``/v1``, e.g. ``http://host:8000/v1``."""
    key_env: str
    """Name of the environment variable that holds the API key (never the key itself)."""


def bad_character(text: str) -> str | None:
    for char in text:
        if unicodedata.category(char) in _FORBIDDEN_CATEGORIES:
            return repr(char)
    return None


def validate_entry(entry: EndpointEntry, fmt: str, path: Path) -> None:
    """Refuse an entry that the registry at ``path`` (format ``fmt``) cannot hold or a tool cannot use."""
    alias = entry.alias
    if not isinstance(alias, str) or not alias.strip():
        raise RegistryError(f"{path}: endpoint alias must be a non-empty string, got {alias!r}")
    if alias != alias.strip():
        raise RegistryError(f"{path}: endpoint alias {alias!r} has leading or trailing whitespace")
    bad = bad_character(alias)
    if bad is not None:
        raise RegistryError(f"{path}: endpoint alias {alias!r} contains the control character {bad}")
    if fmt == "py" and not alias.isprintable():
        raise RegistryError(f"{path}: endpoint alias {alias!r} has characters that are not printable")
    if not isinstance(entry.model, str) or not entry.model.strip() or bad_character(entry.model):
        raise RegistryError(
            f"{path}: model name for {alias!r} must be non-empty printable text: {entry.model!r}"
        )
    url = entry.url
    if (
        not isinstance(url, str)
        or not url.startswith(("http://", "https://"))
        or any(c.isspace() for c in url)
        or bad_character(url)
    ):
        raise RegistryError(
            f"{path}: URL for {alias!r} must start with http:// or https:// and hold no spaces: {url!r}"
        )
    if not isinstance(entry.key_env, str) or not _ENV_NAME.fullmatch(entry.key_env):
        raise RegistryError(
            f"{path}: key_env for {alias!r} must name an environment variable "
            f"([A-Za-z_][A-Za-z0-9_]*), got {entry.key_env!r}"
        )
