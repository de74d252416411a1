"""verifiers 0.1.x ``configs/endpoints.py``: ``ENDPOINTS = {"alias": {"model", "url", "key": ENV_NAME}}``.

Edits splice text: the dict is located by :mod:`.py_locate` (byte offsets of every element, found with the
standard ``ast`` module) and only the bytes of the one element for the alias are replaced or appended, so every
other entry, comment and blank line stays byte-for-byte as the user wrote it. Reads and edits look at the same
dict: the last top-level assignment to ``ENDPOINTS``, or the one assigned inside an ``if``/``try`` block after
it (``py_locate.chosen_assignment``), edited where it is.

A whole-file concrete syntax tree (libcst) keeps every other byte too: ``benchmarks/cpu/registry_cst.py`` does,
behind this module's interface, and passes the same byte-for-byte tests. It is not used because of what one
write costs (``benchmarks/cpu/bench_registry_editor.py``): at 1,000 entries 0.8 s of CPU and 55 MB more RSS,
plus 0.2-0.35 s to import libcst, where the splice takes 40 ms and 5 MB; at 4 MB, 1.8 GB against a 200 MB bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.endpoints.py_locate import NAME, NEWLINE, Layout, ends_line, locate, resolved

__all__ = ["NAME", "check", "parse", "remove", "upsert"]

NEW_FILE = '''"""Endpoints for verifiers (``vf-eval -m ALIAS``).

``key`` names the environment variable that holds the API key, not the key.
pbstk edits this file in place: it replaces or appends one entry and leaves the rest as written.
"""

ENDPOINTS = {{
{element}
}}
'''

# What may stand between two dict elements besides whitespace: their parentheses, the comma, ``**``, comments.
_GAP = re.compile(rb"#[^\r\n]*|[(),*]")


def _literal(text: str) -> str:
    # JSON string syntax is valid Python string syntax for the printable text validate_entry allows.
    return json.dumps(text, ensure_ascii=False)


def _value_code(entry: EndpointEntry, indent: str | None, step: str | None = None) -> str:
    """The dict literal for one entry, on one line (indent None) or one key per line under ``indent``, each
    ``step`` deeper (default: as deep again as ``indent``)."""
    pairs = [("model", entry.model), ("url", entry.url), ("key", entry.key_env)]
    if indent is None:
        return "{" + ", ".join(f'"{k}": {_literal(v)}' for k, v in pairs) + "}"
    inner = indent + (step or indent or "    ")
    lines = "".join(f'{inner}"{k}": {_literal(v)},\n' for k, v in pairs)
    return "{\n" + lines + indent + "}"


# ---------------------------------------------------------------- reading


def check(text: str, path: Path) -> None:
    """Refuse (RegistryError) what :func:`upsert` would refuse, without evaluating any entry."""
    locate(text, path)



def parse(text: str, path: Path) -> dict[str, EndpointEntry]:
    """Entries of the ``ENDPOINTS`` dict; elements that are not plain string literals are skipped."""
    layout = locate(text, path, want_entries=True)
    entries: dict[str, EndpointEntry] = {}
    for element in layout.elements if layout else []:
        if element.entry is not None:
            entries[element.entry.alias] = element.entry
    return entries


# ---------------------------------------------------------------- editing (text splicing)


def _line_start(data: bytes, pos: int) -> int:
    return max(data.rfind(b"\n", 0, pos), data.rfind(b"\r", 0, pos)) + 1


def _starts_line(data: bytes, pos: int) -> bool:
    return not data[_line_start(data, pos) : pos].strip()


def _after_line(data: bytes, pos: int) -> int:
    """The offset just after the newline that ends ``pos``'s line (the end of the data if none does)."""
    match = NEWLINE.search(data, pos)
    return match.end() if match else len(data)


def _bounds(layout: Layout, index: int) -> tuple[int, int, int | None]:
    """(start, end, comma) of an element: with the parentheses around its key or value and its ``**``."""
    data, elements = layout.data, layout.elements
    element = resolved(layout, index)
    before = layout.open + 1 if index == 0 else resolved(layout, index - 1).value_end
    start = element.first
    seen_comma = index == 0
    for match in _GAP.finditer(data, before, element.first):
        token = match.group()
        if token == b",":
            seen_comma = True
        elif seen_comma and token in (b"(", b"*"):
            start = match.start()
            break
    end, comma = element.value_end, None
    limit = elements[index + 1].first if index + 1 < len(elements) else layout.close
    for match in _GAP.finditer(data, element.value_end, limit):
        token = match.group()
        if token == b")" and comma is None:
            end = match.end()
        elif token == b",":
            comma = match.start()
            break
    return start, end, comma


def _own_lines(layout: Layout, index: int) -> tuple[int, int] | None:
    """The line range of an element that has its lines to itself (with its comment), else None."""
    start, end, comma = _bounds(layout, index)
    tail = end if comma is None else comma + 1
    data = layout.data
    after = _after_line(data, tail)
    if _starts_line(data, start) and ends_line(data, tail) and after <= layout.close:
        return _line_start(data, start), after
    return None


def _splice(data: bytes, edits: list[tuple[int, int, str]]) -> str:
    """Apply (start, end, new text) edits; overlapping deletions merge."""
    out, pos = [], 0
    for start, end, new in sorted(edits):
        out.append(data[pos:start] if start > pos else b"")
        out.append(new.encode("utf-8"))
        pos = max(pos, end)
    out.append(data[pos:])
    return b"".join(out).decode("utf-8")


def _newline(text: str) -> str:
    match = re.search(r"\r\n|\r|\n", text)
    return match.group() if match else "\n"


def _element_indent(layout: Layout) -> str | None:
    """The indentation of the dict's elements, or None if the first one shares the line of ``{``."""
    start = _bounds(layout, 0)[0]
    if not _starts_line(layout.data, start):
        return None
    return layout.data[_line_start(layout.data, start) : start].decode("utf-8")


def _value_indent(layout: Layout, indent: str | None) -> str | None:
    """Follow the layout of the last existing entry: one key per line, or the whole entry on one line."""
    if indent is None:
        return None
    for index in reversed(range(len(layout.elements))):
        element = resolved(layout, index)
        if element.value_is_dict:
            return indent if ends_line(layout.data, element.value_start + 1) else None
    return indent


def _append(layout: Layout, entry: EndpointEntry, nl: str) -> list[tuple[int, int, str]]:
    """Edits that add the entry after the last element, leaving every existing element's bytes alone.

    When the last element ends its line (comment included) the new one goes on the lines below, so a comment
    introducing the closing brace stays right above it; otherwise it follows on the same line.
    """
    data = layout.data
    indent = _element_indent(layout)
    code = f"{_literal(entry.alias)}: {_value_code(entry, _value_indent(layout, indent))}".replace("\n", nl)
    _, end, comma = _bounds(layout, len(layout.elements) - 1)
    tail = end if comma is None else comma + 1
    after = _after_line(data, tail)
    if ends_line(data, tail) and after <= layout.close:
        if indent is None:  # elements hang after "{": line up under the first one
            first = _bounds(layout, 0)[0]
            indent = re.sub(r"\S", " ", data[_line_start(data, first) : first].decode("utf-8"))
        edits = [(after, after, indent + code + ("," if comma is not None else "") + nl)]
        return edits if comma is not None else [(end, end, ","), *edits]
    if comma is not None:
        return [(comma + 1, comma + 1, f" {code},")]
    return [(end, end, f", {code}")]


def _fill_empty(layout: Layout, entry: EndpointEntry, nl: str) -> list[tuple[int, int, str]]:
    """Edits that put the first element into an empty ``ENDPOINTS``, indented under the line of its ``{`` (it
    may sit in an ``if``/``try`` block); a comment inside stays, with the element below it."""
    data = layout.data
    line = data[_line_start(data, layout.open) : layout.open].decode("utf-8")
    base = line[: len(line) - len(line.lstrip(" \t"))]
    indent = base + "    "
    code = f"{indent}{_literal(entry.alias)}: {_value_code(entry, indent, '    ')},".replace("\n", nl)
    if not data[layout.open + 1 : layout.close].strip():
        return [(layout.open, layout.close + 1, "{" + nl + code + nl + base + "}")]
    if _starts_line(data, layout.close):  # after a comment: a comment runs to the end of its line
        at = _line_start(data, layout.close)
        return [(at, at, code + nl)]
    return [(layout.close, layout.close, nl + code + nl + base)]


def _emptied(layout: Layout, gone: list[int]) -> list[tuple[int, int, str]]:
    """Edits that take every element out: their own lines where each has them and a comment stays inside
    (``upsert`` into ``{ # comment }`` and back gives the file back), else the whole dict becomes ``{}``."""
    own = [_own_lines(layout, i) for i in gone]
    lines = [span for span in own if span is not None]
    if len(lines) == len(own):
        kept, pos = b"", layout.open + 1
        for start, end in sorted(lines):
            kept, pos = kept + layout.data[pos:start], end
        if (kept + layout.data[pos : layout.close]).strip():
            return [(start, end, "") for start, end in lines]
    return [(layout.open, layout.close + 1, "{}")]


def upsert(text: str | None, entry: EndpointEntry, path: Path) -> str:
    """Return ``text`` with the alias's element replaced, or appended to ``ENDPOINTS`` (created if absent)."""
    element_code = f"    {_literal(entry.alias)}: {_value_code(entry, '    ')},"
    if text is None:
        return NEW_FILE.format(element=element_code)
    layout = locate(text, path)
    nl = _newline(text)
    if layout is None:
        prefix = text if not text or text.endswith(("\n", "\r")) else text + nl
        block = f"{NAME} = {{\n{element_code}\n}}\n".replace("\n", nl)
        return prefix + (nl if prefix.strip() else "") + block
    if not layout.elements:
        return _splice(layout.data, _fill_empty(layout, entry, nl))
    matches = [resolved(layout, i) for i, element in enumerate(layout.elements) if element.alias == entry.alias]
    if not matches:
        return _splice(layout.data, _append(layout, entry, nl))
    value = _value_code(entry, _value_indent(layout, _element_indent(layout))).replace("\n", nl)
    # duplicate keys: Python keeps the last, so make them all agree
    return _splice(layout.data, [(m.value_start, m.value_end, value) for m in matches])


def remove(text: str, alias: str, path: Path) -> str | None:
    """Return ``text`` without the alias's element(s), or None if the alias is not there.

    An element with its lines to itself goes with those lines (and its comment); one sharing a line goes with
    the separator before the next element. When the last elements go, the new last one takes their trailing-
    comma style, so that removing what :func:`upsert` appended gives back the file exactly.
    """
    layout = locate(text, path)
    if layout is None:
        return None
    elements = layout.elements
    gone = {i for i, element in enumerate(elements) if element.alias == alias}
    if not gone:
        return None
    if len(gone) == len(elements):
        return _splice(layout.data, _emptied(layout, sorted(gone)))
    kept_last = max(i for i in range(len(elements)) if i not in gone)
    edits: list[tuple[int, int, str]] = []
    for i in sorted(gone):
        if i < kept_last:
            lines = _own_lines(layout, i)
            edits.append((*lines, "") if lines else (_bounds(layout, i)[0], _bounds(layout, i + 1)[0], ""))
    tail = range(kept_last + 1, len(elements))
    if tail:
        _, kept_end, kept_comma = _bounds(layout, kept_last)
        _, final_end, final_comma = _bounds(layout, len(elements) - 1)
        own = [_own_lines(layout, i) for i in tail]
        if all(own):
            edits.extend((*lines, "") for lines in own if lines)
            if final_comma is None and kept_comma is not None:
                edits.append((kept_comma, kept_comma + 1, ""))
        elif final_comma is not None and kept_comma is not None:
            edits.append((kept_comma + 1, final_comma + 1, ""))
        else:
            edits.append((kept_end, final_end, ""))
    return _splice(layout.data, edits)
