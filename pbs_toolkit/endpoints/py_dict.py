"""verifiers 0.1.x ``configs/endpoints.py``: ``ENDPOINTS = {"alias": {"model", "url", "key": ENV_NAME}}``.

Edits splice text: the file is located with the standard ``ast`` module (which reports where every node starts
and ends) and only the bytes of the one element for the alias are replaced or appended, so every other entry,
comment and blank line stays byte-for-byte as the user wrote it. Both reads and edits look at the last
top-level assignment to ``ENDPOINTS``, the one Python keeps.

Cost is linear and bounded: a registry can hold thousands of entries (a 4 MB file), and a whole-file ``ast``
of that costs about 300 MB. So a lexical scan first finds the outermost ``{...}`` spans; the file is parsed
with those spans emptied (small), and the ``ENDPOINTS`` dict is parsed (or, for an edit, compiled) in chunks
of elements, each checked to be part of a plain dict display. Anything the fast path cannot vouch for falls
back to one whole-file ``ast.parse``, which is always right and also names the line of a syntax error.
"""

from __future__ import annotations

import ast
import bisect
import dis
import json
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.errors import RegistryError

NAME = "ENDPOINTS"

NEW_FILE = '''"""Endpoints for verifiers (``vf-eval -m ALIAS``).

``key`` names the environment variable that holds the API key, not the key.
pbstk edits this file in place: it replaces or appends one entry and leaves the rest as written.
"""

ENDPOINTS = {{
{element}
}}
'''

#: bytes of ``ENDPOINTS`` elements parsed at a time: bounds the memory of the parse
CHUNK_BYTES = 1 << 16

# Strings of any prefix (the quote decides where a string ends, raw or not) and comments.
_STRING = (
    rb'"""(?:[^"\\]|\\.|"(?!""))*"""'
    rb"|'''(?:[^'\\]|\\.|'(?!''))*'''"
    rb'|"(?:[^"\\\r\n]|\\.)*"'
    rb"|'(?:[^'\\\r\n]|\\.)*'"
)
# One match per bracket or comma outside strings and comments (the regex engine consumes what lies between),
# per quote that opens no complete string, or for the end. It cannot fail, so it never backtracks.
_TOKEN = re.compile(
    rb"(?:[^\"'#\[\](){},]+|" + _STRING + rb"|#[^\r\n]*)*" + rb"([\[\](){},\"']|\Z)", re.S
)
_CLOSING = {b"(": b")", b"[": b"]", b"{": b"}"}
# What may stand between two dict elements besides whitespace: their parentheses, the comma, ``**``, comments.
_GAP = re.compile(rb"#[^\r\n]*|[(),*]")
_NEWLINE = re.compile(rb"\r\n|\r|\n")


def _literal(text: str) -> str:
    # JSON string syntax is valid Python string syntax for the printable text validate_entry allows.
    return json.dumps(text, ensure_ascii=False)


def _value_code(entry: EndpointEntry, indent: str | None) -> str:
    """The dict literal for one entry, on one line (indent None) or one key per line under ``indent``."""
    pairs = [("model", entry.model), ("url", entry.url), ("key", entry.key_env)]
    if indent is None:
        return "{" + ", ".join(f'"{k}": {_literal(v)}' for k, v in pairs) + "}"
    inner = indent + (indent or "    ")
    lines = "".join(f'{inner}"{k}": {_literal(v)},\n' for k, v in pairs)
    return "{\n" + lines + indent + "}"


def _syntax_error(path: Path, line: int | None, reason: str) -> RegistryError:
    return RegistryError(f"{path}: cannot parse as Python: line {line}: {reason}")


# ---------------------------------------------------------------- locating ENDPOINTS


@dataclass
class _Element:
    """One element of the ``ENDPOINTS`` dict, by byte offsets into the UTF-8 text."""

    first: int  # where its key (or the value of ``**value``) starts
    value_start: int  # -1 until resolved (see _resolved)
    value_end: int
    alias: str | None  # the key when it is a string literal
    value_is_dict: bool
    entry: EndpointEntry | None  # filled only when reading
    piece: tuple[int, int] | None = None  # (start, end) of the text between its separators, while unresolved


@dataclass
class _Layout:
    data: bytes
    open: int  # offset of ENDPOINTS' "{"
    close: int  # offset of its "}"
    elements: list[_Element]


class _Unsure(Exception):
    """The fast path cannot vouch for its reading of the file: use the whole-file parse instead."""


def _line_starts(data: bytes) -> list[int]:
    return [0, *(m.end() for m in _NEWLINE.finditer(data))]


def _last_assignment(tree: ast.Module) -> ast.expr | None:
    found: ast.expr | None = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == NAME for t in stmt.targets):
            found = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == NAME:
            found = stmt.value
    return found


def _entry(key: ast.expr | None, value: ast.expr) -> EndpointEntry | None:
    """The entry an element holds; None for ``**other`` and anything computed at run time (skipped, not guessed)."""
    if key is None:
        return None
    try:
        alias = ast.literal_eval(key)
        fields: Any = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(alias, str) or not isinstance(fields, dict):
        return None
    model, url, key_env = fields.get("model"), fields.get("url"), fields.get("key")
    if isinstance(model, str) and isinstance(url, str) and isinstance(key_env, str):
        return EndpointEntry(alias=alias, model=model, url=url, key_env=key_env)
    return None


def _ends_line(data: bytes, pos: int) -> bool:
    """Whether only blanks or a comment follow ``pos`` on its line."""
    match = _NEWLINE.search(data, pos)
    rest = data[pos : match.start() if match else len(data)].strip()
    return not rest or rest.startswith(b"#")


def _elements(data: bytes, node: ast.Dict, offset: Any, want_entries: bool) -> list[_Element]:
    """The elements of ``node``; ``offset(lineno, col)`` maps an ast position to a byte offset into ``data``."""
    elements = []
    for key, value in zip(node.keys, node.values):
        value_start = offset(value.lineno, value.col_offset)
        alias = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
        elements.append(_Element(
            first=offset(key.lineno, key.col_offset) if key is not None else value_start,
            value_start=value_start,
            value_end=offset(value.end_lineno, value.end_col_offset),
            alias=alias,
            value_is_dict=isinstance(value, ast.Dict),
            entry=_entry(key, value) if want_entries else None,
        ))
    return elements


def _brace_spans(data: bytes) -> list[tuple[int, int, list[int]]]:
    """Every outermost ``{...}`` outside strings and comments: (open, close, commas directly inside it)."""
    spans: list[tuple[int, int, list[int]]] = []
    stack: list[bytes] = []
    base, start, commas = -1, 0, []
    pos = 0
    while True:
        match = _TOKEN.match(data, pos)
        if match is None:
            raise _Unsure
        token, at, pos = match.group(1), match.start(1), match.end()
        if not token:
            break
        if token == b",":
            if base >= 0 and len(stack) == base + 1:
                commas.append(at)
        elif token in _CLOSING:
            if token == b"{" and base < 0:
                base, start, commas = len(stack), at, []
            stack.append(_CLOSING[token])
        elif token in b"\"'" or not stack or stack.pop() != token:
            raise _Unsure  # a string that never closes, or unbalanced brackets: let the real parser say where
        elif len(stack) == base:
            spans.append((start, at, commas))
            base = -1
    if stack:
        raise _Unsure
    return spans


def _chunks(bounds: list[int]) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` index ranges into ``bounds`` (the dict's braces and top-level commas) covering about
    ``CHUNK_BYTES`` of elements each: what one parse or compile of ``{`` + elements + ``}`` takes at a time."""
    lo = 0
    while lo < len(bounds) - 1:
        hi = lo + 1
        while hi < len(bounds) - 1 and bounds[hi] - bounds[lo] < CHUNK_BYTES:
            hi += 1
        yield lo, hi
        lo = hi


def _parse_dict_chunks(
    data: bytes, span: tuple[int, int, list[int]], want_entries: bool
) -> list[_Element]:
    """Parse the dict at ``span`` a few elements at a time (``{`` + elements + ``}``), each a plain dict."""
    open_, close, commas = span
    bounds = [open_, *commas, close]
    elements: list[_Element] = []
    for lo, hi in _chunks(bounds):
        begin, end = bounds[lo] + 1, bounds[hi]
        source = b"{" + data[begin:end] + b"\n}"
        try:
            node = ast.parse(source.decode("utf-8"), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
            raise _Unsure from exc
        if not isinstance(node, ast.Dict):
            raise _Unsure  # a comprehension or a set, or elements split wrongly (a lambda's commas)
        starts = _line_starts(source)

        def offset(lineno: int, col: int, base: int = begin - 1, starts: list[int] = starts) -> int:
            return base + starts[lineno - 1] + col

        elements.extend(_elements(data, node, offset, want_entries))
    last_piece = data[bounds[-2] + 1 : close]
    expected = len(bounds) - 1 - (not re.sub(rb"#[^\r\n]*", b"", last_piece).strip())
    if len(elements) != expected:
        raise _Unsure  # an empty element (",,") that a chunk of its own would hide
    return elements


# A piece of the dict that starts with a plain string key: all an edit needs to know about most elements.
_SIMPLE_KEY = re.compile(rb"""(?:\s|#[^\r\n]*)*(?:"([^"\\\r\n]*)"|'([^'\\\r\n]*)')\s*:""")
_FOR_ITER = dis.opmap["FOR_ITER"]


def _piece_element(data: bytes, start: int, end: int) -> _Element:
    """The one element between ``start`` and ``end`` (its separators), parsed on its own."""
    source = b"{" + data[start:end] + b"\n}"
    try:
        node = ast.parse(source.decode("utf-8"), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise _Unsure from exc
    if not isinstance(node, ast.Dict) or len(node.keys) != 1:
        raise _Unsure
    starts = _line_starts(source)

    def offset(lineno: int, col: int) -> int:
        return start - 1 + starts[lineno - 1] + col

    return _elements(data, node, offset, False)[0]


def _resolved(layout: _Layout, index: int) -> _Element:
    """Element ``index`` with its value's position and kind (parsing its piece now if the scan skipped that)."""
    element = layout.elements[index]
    if element.piece is not None:
        full = _piece_element(layout.data, *element.piece)
        if full.first != element.first or full.alias != element.alias:
            raise RegistryError(f"internal error: element {index} of {NAME} read two ways")
        layout.elements[index] = element = full
    return element


def _compile_dict_chunks(data: bytes, span: tuple[int, int, list[int]]) -> list[_Element]:
    """What an edit needs, at about half the cost of :func:`_parse_dict_chunks`: each chunk is compiled to
    bytecode (the syntax check, no ast objects) and must build a plain dict: no nested code and no loop, which
    a comprehension has. A piece that starts with a plain string key is known by its key and position; its
    value is parsed only if an edit needs it. Any other piece is parsed on its own now."""
    open_, close, commas = span
    bounds = [open_, *commas, close]
    elements: list[_Element] = []
    for lo, hi in _chunks(bounds):
        source = b"{" + data[bounds[lo] + 1 : bounds[hi]] + b"\n}"
        try:
            code = compile(source.decode("utf-8"), "<ENDPOINTS>", "eval", dont_inherit=True)
        except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
            raise _Unsure from exc
        if any(isinstance(c, types.CodeType) for c in code.co_consts) or _FOR_ITER in code.co_code[::2]:
            raise _Unsure  # a comprehension (or a lambda): not a plain dict display, or not only one
        for index in range(lo, hi):
            start, end = bounds[index] + 1, bounds[index + 1]
            match = _SIMPLE_KEY.match(data, start, end)
            if match is not None:
                group = 1 if match.group(1) is not None else 2
                elements.append(_Element(first=match.start(group) - 1, value_start=-1, value_end=-1,
                                         alias=match.group(group).decode("utf-8"), value_is_dict=False,
                                         entry=None, piece=(start, end)))
            elif index == len(bounds) - 2 and not re.sub(rb"#[^\r\n]*", b"", data[start:end]).strip():
                continue  # the blank after a trailing comma
            else:
                elements.append(_piece_element(data, start, end))
    return elements


def _fast(data: bytes, want_entries: bool) -> _Layout | None:
    """Find ENDPOINTS without a whole-file ast: the file with every outermost ``{...}`` emptied, then the dict."""
    spans = _brace_spans(data)
    pieces, segments, pos, size = [], [], 0, 0  # segments: (offset in the emptied text, offset in data)
    for open_, close, _ in spans:
        segments.append((size, pos))
        pieces.append(data[pos : open_ + 1])
        size += open_ + 1 - pos
        pos = close
    segments.append((size, pos))
    pieces.append(data[pos:])
    outer = b"".join(pieces)
    try:
        tree = ast.parse(outer.decode("utf-8"))
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise _Unsure from exc
    value = _last_assignment(tree)
    if value is not None and not isinstance(value, ast.Dict):
        raise _Unsure  # the whole-file parse words the refusal, with its line
    chosen = None
    if value is not None:
        starts = _line_starts(outer)
        at = starts[value.lineno - 1] + value.col_offset
        seg_outer, seg_data = segments[bisect.bisect_right([s for s, _ in segments], at) - 1]
        wanted = seg_data + at - seg_outer
        chosen = next((span for span in spans if span[0] == wanted), None)
        if chosen is None:
            raise _Unsure
    for span in spans:  # the emptied spans must parse too: a file that does not parse is never edited
        if span is not chosen:
            try:
                ast.parse(data[span[0] : span[1] + 1].decode("utf-8"), mode="eval")
            except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
                raise _Unsure from exc
    if chosen is None:
        return None
    if want_entries:
        return _Layout(data, chosen[0], chosen[1], _parse_dict_chunks(data, chosen, want_entries))
    return _Layout(data, chosen[0], chosen[1], _compile_dict_chunks(data, chosen))


def _slow(text: str, data: bytes, path: Path, want_entries: bool) -> _Layout | None:
    """The whole-file parse: always right, names the line of a syntax error, costs ~75 bytes per byte."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise _syntax_error(path, exc.lineno, exc.msg) from exc
    except (ValueError, MemoryError, RecursionError) as exc:
        raise RegistryError(f"{path}: cannot parse as Python: {exc}") from exc
    value = _last_assignment(tree)
    if value is None:
        return None
    if not isinstance(value, ast.Dict):
        raise RegistryError(f"{path}: line {value.lineno}: {NAME} is not a dict literal; pbstk will not edit it")
    starts = _line_starts(data)

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + col

    close = offset(value.end_lineno or value.lineno, value.end_col_offset or 0) - 1
    return _Layout(data, offset(value.lineno, value.col_offset), close,
                   _elements(data, value, offset, want_entries))


def _locate(text: str, path: Path, *, want_entries: bool = False) -> _Layout | None:
    """The ENDPOINTS dict of ``text``, or None if there is none; RegistryError if the file is not Python."""
    data = text.encode("utf-8")
    try:
        return _fast(data, want_entries)
    except _Unsure:
        return _slow(text, data, path, want_entries)


# ---------------------------------------------------------------- reading


def check(text: str, path: Path) -> None:
    """Refuse (RegistryError) what :func:`upsert` would refuse, without evaluating any entry."""
    _locate(text, path)



def parse(text: str, path: Path) -> dict[str, EndpointEntry]:
    """Entries of the ``ENDPOINTS`` dict; elements that are not plain string literals are skipped."""
    layout = _locate(text, path, want_entries=True)
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
    match = _NEWLINE.search(data, pos)
    return match.end() if match else len(data)


def _bounds(layout: _Layout, index: int) -> tuple[int, int, int | None]:
    """(start, end, comma) of an element: with the parentheses around its key or value and its ``**``."""
    data, elements = layout.data, layout.elements
    element = _resolved(layout, index)
    before = layout.open + 1 if index == 0 else _resolved(layout, index - 1).value_end
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


def _own_lines(layout: _Layout, index: int) -> tuple[int, int] | None:
    """The line range of an element that has its lines to itself (with its comment), else None."""
    start, end, comma = _bounds(layout, index)
    tail = end if comma is None else comma + 1
    data = layout.data
    after = _after_line(data, tail)
    if _starts_line(data, start) and _ends_line(data, tail) and after <= layout.close:
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


def _element_indent(layout: _Layout) -> str | None:
    """The indentation of the dict's elements, or None if the first one shares the line of ``{``."""
    start = _bounds(layout, 0)[0]
    if not _starts_line(layout.data, start):
        return None
    return layout.data[_line_start(layout.data, start) : start].decode("utf-8")


def _value_indent(layout: _Layout, indent: str | None) -> str | None:
    """Follow the layout of the last existing entry: one key per line, or the whole entry on one line."""
    if indent is None:
        return None
    for index in reversed(range(len(layout.elements))):
        element = _resolved(layout, index)
        if element.value_is_dict:
            return indent if _ends_line(layout.data, element.value_start + 1) else None
    return indent


def _append(layout: _Layout, entry: EndpointEntry, nl: str) -> list[tuple[int, int, str]]:
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
    if _ends_line(data, tail) and after <= layout.close:
        if indent is None:  # elements hang after "{": line up under the first one
            first = _bounds(layout, 0)[0]
            indent = re.sub(r"\S", " ", data[_line_start(data, first) : first].decode("utf-8"))
        edits = [(after, after, indent + code + ("," if comma is not None else "") + nl)]
        return edits if comma is not None else [(end, end, ","), *edits]
    if comma is not None:
        return [(comma + 1, comma + 1, f" {code},")]
    return [(end, end, f", {code}")]


def upsert(text: str | None, entry: EndpointEntry, path: Path) -> str:
    """Return ``text`` with the alias's element replaced, or appended to ``ENDPOINTS`` (created if absent)."""
    element_code = f"    {_literal(entry.alias)}: {_value_code(entry, '    ')},"
    if text is None:
        return NEW_FILE.format(element=element_code)
    layout = _locate(text, path)
    nl = _newline(text)
    if layout is None:
        prefix = text if not text or text.endswith(("\n", "\r")) else text + nl
        block = f"{NAME} = {{\n{element_code}\n}}\n".replace("\n", nl)
        return prefix + (nl if prefix.strip() else "") + block
    if not layout.elements:
        return _splice(layout.data, [(layout.open, layout.close + 1, f"{{\n{element_code}\n}}".replace("\n", nl))])
    matches = [_resolved(layout, i) for i, element in enumerate(layout.elements) if element.alias == entry.alias]
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
    layout = _locate(text, path)
    if layout is None:
        return None
    elements = layout.elements
    gone = {i for i, element in enumerate(elements) if element.alias == alias}
    if not gone:
        return None
    if len(gone) == len(elements):
        return _splice(layout.data, [(layout.open, layout.close + 1, "{}")])
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
