"""The registry formats behind one interface, ``RegistryFormat``, looked up in one dict, ``FORMATS``.

``registry.py`` does the file safety (locking, atomic rename, regular files only) once for every format; a
format only turns text into entries and back. Adding a format is one class here (or in its own module) and
one entry in ``FORMATS``: format names, suffix detection and the secret rule all follow from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pbs_toolkit.endpoints import data_file, py_dict, verifiers_toml
from pbs_toolkit.endpoints.entry import EndpointEntry


class RegistryFormat(Protocol):
    """One registry file format. Every method raises ``RegistryError`` naming ``path`` for text it cannot
    read; none touches the file (``registry.py`` reads and writes it)."""

    #: the name users pass as ``--format``
    name: str
    #: file suffixes (lower case, with the dot) that mean this format
    suffixes: tuple[str, ...]
    #: whether the file may hold an API key itself (other formats name the key's environment variable only)
    holds_secrets: bool

    def check(self, text: str, path: Path) -> None:
        """Refuse what ``upsert`` would refuse, as cheaply as possible (before a long wait)."""
        ...

    def parse(self, text: str, path: Path) -> dict[str, EndpointEntry]:
        """Every entry by alias."""
        ...

    def upsert(self, text: str | None, entry: EndpointEntry, path: Path,
               api_key: str | None) -> tuple[str, bool]:
        """The new text with ``entry`` set (``text=None``: a new file), and whether it now holds a key."""
        ...

    def remove(self, text: str, alias: str, path: Path) -> str | None:
        """The new text without ``alias``, or ``None`` when it is not there."""
        ...


class PyDictFormat:
    """verifiers 0.1.x ``configs/endpoints.py``: an ``ENDPOINTS = {...}`` dict, edited by splicing text."""

    name: str = "py"
    suffixes: tuple[str, ...] = (".py",)
    holds_secrets: bool = False

    def check(self, text: str, path: Path) -> None:
        py_dict.check(text, path)  # the edit's own reading: no entry evaluated

    def parse(self, text: str, path: Path) -> dict[str, EndpointEntry]:
        return py_dict.parse(text, path)

    def upsert(self, text: str | None, entry: EndpointEntry, path: Path,
               api_key: str | None) -> tuple[str, bool]:
        return py_dict.upsert(text, entry, path), False

    def remove(self, text: str, alias: str, path: Path) -> str | None:
        return py_dict.remove(text, alias, path)


class VerifiersTomlFormat:
    """verifiers 0.3.x ``configs/endpoints.toml``: ``[[endpoint]]`` tables, edited with tomlkit."""

    name: str = "toml"
    suffixes: tuple[str, ...] = (".toml",)
    holds_secrets: bool = False

    def check(self, text: str, path: Path) -> None:
        verifiers_toml.parse(text, path)

    def parse(self, text: str, path: Path) -> dict[str, EndpointEntry]:
        return verifiers_toml.parse(text, path)

    def upsert(self, text: str | None, entry: EndpointEntry, path: Path,
               api_key: str | None) -> tuple[str, bool]:
        return verifiers_toml.upsert(text, entry, path), False

    def remove(self, text: str, alias: str, path: Path) -> str | None:
        return verifiers_toml.remove(text, alias, path)


class DataFileFormat:
    """pbstk's own registry in YAML or JSON (``data_file``): the only formats that may hold the key."""

    holds_secrets: bool = True

    def __init__(self, name: str, suffixes: tuple[str, ...]) -> None:
        self.name, self.suffixes = name, suffixes

    def check(self, text: str, path: Path) -> None:
        data_file.parse(text, path, self.name)

    def parse(self, text: str, path: Path) -> dict[str, EndpointEntry]:
        return data_file.parse(text, path, self.name)

    def upsert(self, text: str | None, entry: EndpointEntry, path: Path,
               api_key: str | None) -> tuple[str, bool]:
        return data_file.upsert(text, entry, path, self.name, api_key)

    def remove(self, text: str, alias: str, path: Path) -> str | None:
        return data_file.remove(text, alias, path, self.name)


#: every registry format by name, in the order the suffixes are tried and listed
FORMATS: dict[str, RegistryFormat] = {
    "py": PyDictFormat(),
    "toml": VerifiersTomlFormat(),
    "yaml": DataFileFormat("yaml", (".yaml", ".yml")),
    "json": DataFileFormat("json", (".json",)),
}


def by_suffix() -> dict[str, str]:
    """Suffix -> format name, from ``FORMATS`` as it is now."""
    return {suffix: name for name, fmt in FORMATS.items() for suffix in fmt.suffixes}
