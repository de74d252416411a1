"""Finding the ``ENDPOINTS`` dict of a verifiers ``endpoints.py``, by byte offsets, for :mod:`.py_dict` to splice.

Cost is linear and bounded: a registry can hold thousands of entries (a 4 MB file), and a whole-file ``ast``
of that costs about 300 MB. So a lexical scan first finds the outermost ``{...}`` spans; the file is parsed
with those spans emptied (small), and the ``ENDPOINTS`` dict is parsed (or, for an edit, compiled) in chunks
of elements, each checked to be part of a plain dict display. Anything the fast path cannot vouch for falls
back to one whole-file ``ast.parse``, which is always right and also names the line of a syntax error.

Which assignment: the last top-level one, the one Python keeps, unless ``ENDPOINTS`` is assigned again inside
an ``if``/``try`` block after it: then the one dict literal among those (see :func:`chosen_assignment`).
"""

from __future__ import annotations

import ast
import bisect
import dis
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.errors import RegistryError

NAME = "ENDPOINTS"

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
NEWLINE = re.compile(rb"\r\n|\r|\n")


def _syntax_error(path: Path, line: int | None, reason: str) -> RegistryError:
    return RegistryError(f"{path}: cannot parse as Python: line {line}: {reason}")


@dataclass
class Element:
    """One element of the ``ENDPOINTS`` dict, by byte offsets into the UTF-8 text."""

    first: int  # where its key (or the value of ``**value``) starts
    value_start: int  # -1 until resolved (see resolved)
    value_end: int
    alias: str | None  # the key when it is a string literal
    value_is_dict: bool
    entry: EndpointEntry | None  # filled only when reading
    piece: tuple[int, int] | None = None  # (start, end) of the text between its separators, while unresolved


@dataclass
class Layout:
    data: bytes
    open: int  # offset of ENDPOINTS' "{"
    close: int  # offset of its "}"
    elements: list[Element]


class _Unsure(Exception):
    """The fast path cannot vouch for its reading of the file: use the whole-file parse instead."""


def line_starts(data: bytes) -> list[int]:
    return [0, *(m.end() for m in NEWLINE.finditer(data))]



class _Ambiguous(Exception):
    """Which ``ENDPOINTS`` Python ends up with depends on how the file runs: pbstk will not guess (the message)."""


def _bindings(body: list[ast.stmt], top: bool, out: list[tuple[ast.stmt, ast.expr | None, bool]]) -> None:
    """Statements of ``body`` (and of the ``if``/``try``/``with``/loop blocks in it, not of functions or
    classes) that bind ``ENDPOINTS``, in source order: (statement, the assigned value or None for an import,
    whether it runs unconditionally at the top level)."""
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == NAME for t in stmt.targets):
            out.append((stmt, stmt.value, top))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == NAME:
            if stmt.value is not None:
                out.append((stmt, stmt.value, top))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name) == NAME for alias in stmt.names):
                out.append((stmt, None, top))
        elif not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for block in ("body", "orelse", "finalbody"):
                _bindings(getattr(stmt, block, None) or [], False, out)
            for part in [*getattr(stmt, "handlers", []), *getattr(stmt, "cases", [])]:
                _bindings(part.body, False, out)


def chosen_assignment(tree: ast.Module) -> ast.expr | None:
    """The ``ENDPOINTS`` dict to read and edit, where it is: the last top-level assignment, or the one dict
    literal assigned after it inside an ``if``/``try``/``with`` block (``try: from private import ENDPOINTS``
    ``except ImportError: ENDPOINTS = {...}``). None when nothing binds it (an edit then appends one).
    ``_Ambiguous`` when two dict literals may each be the one Python keeps; a non-dict value is returned
    for the caller to refuse."""
    found: list[tuple[ast.stmt, ast.expr | None, bool]] = []
    _bindings(tree.body, True, found)
    if not found:
        return None
    last_top = max((i for i, (_, _, top) in enumerate(found) if top), default=0)
    candidates = found[last_top:]
    dicts = [value for _, value, _ in candidates if isinstance(value, ast.Dict)]
    if len(dicts) == 1:
        return dicts[0]
    if len(dicts) > 1:
        lines = ", ".join(str(value.lineno) for value in dicts)
        raise _Ambiguous(f"{NAME} is assigned a dict on lines {lines} and which one Python keeps depends on how "
                         "the file runs; pbstk will not guess: keep one literal and merge the others into it")
    stmt, value, _ = candidates[-1]
    return value if value is not None else ast.Constant(None, lineno=stmt.lineno, col_offset=stmt.col_offset)


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


def ends_line(data: bytes, pos: int) -> bool:
    """Whether only blanks or a comment follow ``pos`` on its line."""
    match = NEWLINE.search(data, pos)
    rest = data[pos : match.start() if match else len(data)].strip()
    return not rest or rest.startswith(b"#")


def _elements(data: bytes, node: ast.Dict, offset: Any, want_entries: bool) -> list[Element]:
    """The elements of ``node``; ``offset(lineno, col)`` maps an ast position to a byte offset into ``data``."""
    elements = []
    for key, value in zip(node.keys, node.values):
        value_start = offset(value.lineno, value.col_offset)
        alias = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
        elements.append(Element(
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
) -> list[Element]:
    """Parse the dict at ``span`` a few elements at a time (``{`` + elements + ``}``), each a plain dict."""
    open_, close, commas = span
    bounds = [open_, *commas, close]
    elements: list[Element] = []
    for lo, hi in _chunks(bounds):
        begin, end = bounds[lo] + 1, bounds[hi]
        source = b"{" + data[begin:end] + b"\n}"
        try:
            node = ast.parse(source.decode("utf-8"), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
            raise _Unsure from exc
        if not isinstance(node, ast.Dict):
            raise _Unsure  # a comprehension or a set, or elements split wrongly (a lambda's commas)
        starts = line_starts(source)

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


def _piece_element(data: bytes, start: int, end: int) -> Element:
    """The one element between ``start`` and ``end`` (its separators), parsed on its own."""
    source = b"{" + data[start:end] + b"\n}"
    try:
        node = ast.parse(source.decode("utf-8"), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise _Unsure from exc
    if not isinstance(node, ast.Dict) or len(node.keys) != 1:
        raise _Unsure
    starts = line_starts(source)

    def offset(lineno: int, col: int) -> int:
        return start - 1 + starts[lineno - 1] + col

    return _elements(data, node, offset, False)[0]


def resolved(layout: Layout, index: int) -> Element:
    """Element ``index`` with its value's position and kind (parsing its piece now if the scan skipped that)."""
    element = layout.elements[index]
    if element.piece is not None:
        full = _piece_element(layout.data, *element.piece)
        if full.first != element.first or full.alias != element.alias:
            raise RegistryError(f"internal error: element {index} of {NAME} read two ways")
        layout.elements[index] = element = full
    return element


def _compile_dict_chunks(data: bytes, span: tuple[int, int, list[int]]) -> list[Element]:
    """What an edit needs, at about half the cost of :func:`_parse_dict_chunks`: each chunk is compiled to
    bytecode (the syntax check, no ast objects) and must build a plain dict: no nested code and no loop, which
    a comprehension has. A piece that starts with a plain string key is known by its key and position; its
    value is parsed only if an edit needs it. Any other piece is parsed on its own now."""
    open_, close, commas = span
    bounds = [open_, *commas, close]
    elements: list[Element] = []
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
                elements.append(Element(first=match.start(group) - 1, value_start=-1, value_end=-1,
                                         alias=match.group(group).decode("utf-8"), value_is_dict=False,
                                         entry=None, piece=(start, end)))
            elif index == len(bounds) - 2 and not re.sub(rb"#[^\r\n]*", b"", data[start:end]).strip():
                continue  # the blank after a trailing comma
            else:
                elements.append(_piece_element(data, start, end))
    return elements


def _fast(data: bytes, want_entries: bool) -> Layout | None:
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
    try:
        value = chosen_assignment(tree)
    except _Ambiguous as exc:
        raise _Unsure from exc
    if value is not None and not isinstance(value, ast.Dict):
        raise _Unsure  # the whole-file parse words the refusal, with its line
    chosen = None
    if value is not None:
        starts = line_starts(outer)
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
        return Layout(data, chosen[0], chosen[1], _parse_dict_chunks(data, chosen, want_entries))
    return Layout(data, chosen[0], chosen[1], _compile_dict_chunks(data, chosen))


def _slow(text: str, data: bytes, path: Path, want_entries: bool) -> Layout | None:
    """The whole-file parse: always right, names the line of a syntax error, costs ~75 bytes per byte."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise _syntax_error(path, exc.lineno, exc.msg) from exc
    except (ValueError, MemoryError, RecursionError) as exc:
        raise RegistryError(f"{path}: cannot parse as Python: {exc}") from exc
    try:
        value = chosen_assignment(tree)
    except _Ambiguous as exc:
        raise RegistryError(f"{path}: {exc}") from exc
    if value is None:
        return None
    if not isinstance(value, ast.Dict):
        raise RegistryError(f"{path}: line {value.lineno}: {NAME} is not a dict literal; pbstk will not edit it")
    starts = line_starts(data)

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + col

    close = offset(value.end_lineno or value.lineno, value.end_col_offset or 0) - 1
    return Layout(data, offset(value.lineno, value.col_offset), close,
                   _elements(data, value, offset, want_entries))


def locate(text: str, path: Path, *, want_entries: bool = False) -> Layout | None:
    """The ENDPOINTS dict of ``text``, or None if there is none; RegistryError if the file is not Python."""
    data = text.encode("utf-8")
    try:
        return _fast(data, want_entries)
    except _Unsure:
        return _slow(text, data, path, want_entries)
