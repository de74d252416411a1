"""The version stamp every ``--json`` object carries (docs/json.md lists each object's fields).

Each object pbstk prints or saves as JSON starts with ``schema_version`` (bumped only when a field is removed,
renamed or changes meaning; new fields may appear at any time) and ``kind`` (``job``, ``endpoint``, ``metrics``
...), so a script can check both before reading the rest. The objects' own ``to_dict`` methods call
:func:`stamp`; nothing in the CLI builds these dictionaries by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the version of every object's JSON shape
SCHEMA_VERSION = 1
#: the keys :func:`stamp` adds (readers of saved documents drop them and stamp afresh when writing)
STAMP_KEYS = ("schema_version", "kind")


def stamp(kind: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as a ``kind`` object of the current schema: ``schema_version`` and ``kind`` first."""
    return {"schema_version": SCHEMA_VERSION, "kind": kind,
            **{k: v for k, v in data.items() if k not in STAMP_KEYS}}
