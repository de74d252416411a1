"""verifiers 0.3.x ``configs/endpoints.toml``: one ``[[endpoint]]`` table per endpoint.

Each table holds ``endpoint_id`` (the alias), ``model``, ``url`` and ``key`` (the name of the environment
variable that holds the API key). tomlkit keeps the user's comments and layout; an existing table is updated
in place, so keys pbstk does not know about survive.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.errors import RegistryError

if TYPE_CHECKING:
    import tomlkit.items
    from tomlkit.toml_document import TOMLDocument

TABLE = "endpoint"

NEW_FILE = """\
# Endpoints for verifiers; `key` names the environment variable that holds the API key.
# pbstk edits this file in place: it replaces or appends one [[endpoint]] table, leaving the rest as is.

"""


def _parse(text: str, path: Path) -> TOMLDocument:
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:
        raise RegistryError(f"{path}: cannot parse as TOML: {exc}") from exc


def _tables(doc: TOMLDocument, path: Path) -> tomlkit.items.AoT | None:
    from tomlkit.items import AoT

    if TABLE not in doc:
        return None
    tables = doc[TABLE]
    if not isinstance(tables, AoT):
        raise RegistryError(
            f"{path}: '{TABLE}' is not an array of [[{TABLE}]] tables; pbstk will not edit it"
        )
    return tables


def parse(text: str, path: Path) -> dict[str, EndpointEntry]:
    """Entries of the ``[[endpoint]]`` tables; tables missing one of the four string keys are skipped."""
    doc = _parse(text, path)
    raw: Any = doc.unwrap().get(TABLE, [])
    if not isinstance(raw, list):
        raise RegistryError(f"{path}: '{TABLE}' is not an array of [[{TABLE}]] tables")
    entries: dict[str, EndpointEntry] = {}
    for table in raw:
        if not isinstance(table, dict):
            continue
        values: list[Any] = [table.get(name) for name in ("endpoint_id", "model", "url", "key")]
        alias, model, url, key = values
        if all(isinstance(v, str) for v in (alias, model, url, key)):
            entries[alias] = EndpointEntry(alias=alias, model=model, url=url, key_env=key)
    return entries


def _fill(table: Any, entry: EndpointEntry) -> None:
    table["endpoint_id"] = entry.alias
    table["model"] = entry.model
    table["url"] = entry.url
    table["key"] = entry.key_env


def upsert(text: str | None, entry: EndpointEntry, path: Path) -> str:
    """Return ``text`` with the alias's table updated in place, or a new table appended."""
    import tomlkit
    from tomlkit.items import Whitespace

    if text is None:
        text = NEW_FILE
    elif text and not text.endswith("\n"):
        text += "\n"  # otherwise the appended table would start on the last line
    doc = _parse(text, path)
    tables = _tables(doc, path)
    if tables is None:
        tables = tomlkit.aot()
        doc.append(TABLE, tables)
    matches = [t for t in tables if t.get("endpoint_id") == entry.alias]
    for table in matches:
        _fill(table, entry)
    if not matches:
        table = tomlkit.table()
        _fill(table, entry)
        if len(tables):
            # Comments after the last table's keys introduce what follows the array (tomlkit stores them in
            # that table): move them below the new table, leaving the blank line that ended the last table.
            trailer = _pop_trailer(tables[-1])
            blank = list(itertools.takewhile(lambda item: isinstance(item[1], Whitespace), trailer))
            tables[-1].value.body.extend(blank)
            table.value.body.extend(trailer if trailer else [(None, tomlkit.nl())])
        else:
            table.add(tomlkit.nl())
        tables.append(table)
    return doc.as_string()


def _pop_trailer(table: Any) -> list[tuple[Any, Any]]:
    """Remove and return the comments and blank lines at the end of ``table``'s body."""
    from tomlkit.items import Comment, Whitespace

    body = table.value.body
    trailer: list[tuple[Any, Any]] = []
    while body and body[-1][0] is None and isinstance(body[-1][1], (Whitespace, Comment)):
        trailer.insert(0, body.pop())
    return trailer


def remove(text: str, alias: str, path: Path) -> str | None:
    """Return ``text`` without the alias's table(s), or None if there is none."""
    from tomlkit.items import Comment

    doc = _parse(text, path)
    tables = _tables(doc, path)
    if tables is None:
        return None
    indices = [i for i, t in enumerate(tables) if t.get("endpoint_id") == alias]
    if not indices:
        return None
    for i in reversed(indices):
        if i > 0 and i == len(tables) - 1:
            # Undo upsert's move: the comments that introduce what follows go back to the table above.
            trailer = _pop_trailer(tables[i])
            if any(isinstance(item, Comment) for _, item in trailer):
                _pop_trailer(tables[i - 1])
                tables[i - 1].value.body.extend(trailer)
        del tables[i]
    if len(tables) == 0:
        del doc[TABLE]
    return doc.as_string()
