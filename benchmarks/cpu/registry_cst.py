"""A libcst editor of verifiers ``configs/endpoints.py``, behind the interface of ``pbs_toolkit.endpoints.py_dict``
(``check``, ``parse``, ``upsert``, ``remove``): the candidate that ``bench_registry_editor.py`` measures against
the byte-offset editor pbstk ships (issue 44 item 6). pbstk does not use it.

The whole file is parsed once with ``ast`` (the refusals and their line numbers, the choice of assignment, the
entries read) and once with libcst (the edit). The ``ENDPOINTS`` dict is seen as its elements and the gaps of
whitespace and comments between them: ``gaps[k]`` stands before element ``k``, ``gaps[-1]`` before ``}``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import libcst as cst

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.endpoints.py_dict import NEW_FILE
from pbs_toolkit.endpoints.py_locate import NAME, chosen_assignment
from pbs_toolkit.errors import RegistryError

Gap = Any  # cst.BaseParenthesizableWhitespace: SimpleWhitespace, or ParenthesizedWhitespace (a line break)


# ---------------------------------------------------------------- which dict (ast: the refusals and their lines)
# (py_locate.chosen_assignment, shared with the byte-offset editor: a libcst-only pbstk would move it here)


def _chosen(text: str, path: Path) -> tuple[ast.Module, ast.Dict | None]:
    """The whole-file ast and the ``ENDPOINTS`` dict Python keeps (None: nothing binds it), or RegistryError."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise RegistryError(f"{path}: cannot parse as Python: line {exc.lineno}: {exc.msg}") from exc
    except (ValueError, MemoryError, RecursionError) as exc:
        raise RegistryError(f"{path}: cannot parse as Python: {exc}") from exc
    try:
        value = chosen_assignment(tree)
    except Exception as exc:  # two dicts of which Python may keep either: py_locate words the refusal
        raise RegistryError(f"{path}: {exc}") from exc
    if value is not None and not isinstance(value, ast.Dict):
        raise RegistryError(f"{path}: line {value.lineno}: {NAME} is not a dict literal; pbstk will not edit it")
    return tree, value


def check(text: str, path: Path) -> None:
    """Refuse (RegistryError) what :func:`upsert` would refuse, without evaluating any entry."""
    _chosen(text, path)


def parse(text: str, path: Path) -> dict[str, EndpointEntry]:
    """Entries of the ``ENDPOINTS`` dict; elements that are not plain string literals are skipped."""
    entries = {}
    chosen = _chosen(text, path)[1]
    for key, value in zip(chosen.keys, chosen.values) if chosen else ():
        try:
            alias, fields = ast.literal_eval(key) if key is not None else None, ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(alias, str) and isinstance(fields, dict):
            model, url, key_env = fields.get("model"), fields.get("url"), fields.get("key")
            if isinstance(model, str) and isinstance(url, str) and isinstance(key_env, str):
                entries[alias] = EndpointEntry(alias, model, url, key_env)
    return entries


# ---------------------------------------------------------------- editing (libcst)


def _literal(text: str) -> cst.SimpleString:
    # JSON string syntax is valid Python string syntax for the printable text validate_entry allows.
    return cst.SimpleString(json.dumps(text, ensure_ascii=False))


def _line(indent: str, like: Gap = None) -> cst.ParenthesizedWhitespace:
    """A line break, then ``indent`` past the block's own indentation (``like``'s flag when given)."""
    return cst.ParenthesizedWhitespace(indent=getattr(like, "indent", True), last_line=cst.SimpleWhitespace(indent))


def _value(entry: EndpointEntry, indent: str | None, step: str | None = None) -> cst.Dict:
    """The entry's dict: on one line (indent None), or one key per line ``step`` deeper than ``indent``."""
    pairs = [("model", entry.model), ("url", entry.url), ("key", entry.key_env)]
    if indent is None:
        return cst.Dict([cst.DictElement(_literal(k), _literal(v)) for k, v in pairs])
    inner = indent + (step or indent or "    ")
    commas = [cst.Comma(whitespace_after=_line(inner)), cst.Comma(whitespace_after=_line(inner)), cst.Comma()]
    return cst.Dict([cst.DictElement(_literal(k), _literal(v), comma=c) for (k, v), c in zip(pairs, commas)],
                    lbrace=cst.LeftCurlyBrace(whitespace_after=_line(inner)),
                    rbrace=cst.RightCurlyBrace(whitespace_before=_line(indent)))


def _merged(before: Gap, after: Gap) -> Gap:
    """One gap for two with elements removed between them: both line breaks keep both gaps' comments."""
    if isinstance(before, cst.ParenthesizedWhitespace) and isinstance(after, cst.ParenthesizedWhitespace):
        return after.with_changes(first_line=before.first_line, empty_lines=[*before.empty_lines, *after.empty_lines])
    return None


class _Dict:
    """The ``ENDPOINTS`` dict as elements, the gaps around them, and whether the last one has a comma."""

    def __init__(self, node: cst.Dict) -> None:
        self.node, self.items = node, [e.with_changes(comma=cst.MaybeSentinel.DEFAULT) for e in node.elements]
        commas = [e.comma for e in node.elements]
        self.gaps: list[Gap] = [node.lbrace.whitespace_after, *(getattr(c, "whitespace_after", None) for c in commas)]
        self.trailing = bool(commas) and isinstance(commas[-1], cst.Comma)
        if commas:
            self.gaps[-1] = node.rbrace.whitespace_before  # a trailing comma's own is always empty
        self.before_comma = [getattr(c, "whitespace_before", cst.SimpleWhitespace("")) for c in commas]

    def build(self) -> cst.Dict:
        if not self.items:
            return self.node.with_changes(elements=[], lbrace=cst.LeftCurlyBrace(self.gaps[0]),
                                          rbrace=cst.RightCurlyBrace(cst.SimpleWhitespace("")))
        last = len(self.items) - 1
        elements = [item.with_changes(comma=cst.Comma(self.before_comma[k], self.gaps[k + 1] if k < last else
                                                     cst.SimpleWhitespace("")) if k < last or self.trailing
                                      else cst.MaybeSentinel.DEFAULT) for k, item in enumerate(self.items)]
        return self.node.with_changes(elements=elements, lbrace=cst.LeftCurlyBrace(self.gaps[0]),
                                      rbrace=cst.RightCurlyBrace(self.gaps[-1]))

    def own_lines(self, k: int) -> bool:
        return all(isinstance(g, cst.ParenthesizedWhitespace) for g in self.gaps[k : k + 2])

    def indent(self) -> str | None:
        """The elements' indentation past the block's, or None if the first one shares the line of ``{``."""
        first = self.gaps[0]
        return first.last_line.value if isinstance(first, cst.ParenthesizedWhitespace) else None

    def value_indent(self) -> str | None:
        """Follow the layout of the last existing entry: one key per line, or the whole entry on one line."""
        values = [item.value for item in self.items if isinstance(getattr(item, "value", None), cst.Dict)]
        if self.indent() is None or not values:
            return self.indent()
        return self.indent() if isinstance(values[-1].lbrace.whitespace_after, cst.ParenthesizedWhitespace) else None

    def append(self, entry: EndpointEntry) -> None:
        new = cst.DictElement(_literal(entry.alias), _value(entry, self.value_indent()))
        end, sep = self.gaps[-1], self.gaps[-2]
        if isinstance(end, cst.ParenthesizedWhitespace) and isinstance(sep, cst.ParenthesizedWhitespace):
            self.gaps[-1:] = [_line(sep.last_line.value, sep).with_changes(first_line=end.first_line),
                              end.with_changes(first_line=cst.TrailingWhitespace())]
        else:  # on the line of the last element
            self.gaps[-1:] = [cst.SimpleWhitespace(" "), end]
        self.items.append(new)
        self.before_comma.append(cst.SimpleWhitespace(""))

    def fill_empty(self, entry: EndpointEntry) -> None:
        """The first element, indented one level under the line of ``{``; a comment inside stays above it."""
        gap = self.gaps[0]
        new = cst.DictElement(_literal(entry.alias), _value(entry, "    ", "    "))
        if isinstance(gap, cst.ParenthesizedWhitespace):
            self.gaps = [gap.with_changes(last_line=cst.SimpleWhitespace("    ")), _line("", gap)]
        else:
            self.gaps = [_line("    "), _line("")]
        self.items, self.trailing, self.before_comma = [new], True, [cst.SimpleWhitespace("")]

    def remove(self, gone: set[int]) -> None:
        """Take elements out: one with its lines to itself goes with them (a comment above it stays); one sharing
        a line goes with the separator after it; the last kept element takes the trailing-comma style."""
        for k in sorted(gone, reverse=True):
            tail = k == len(self.items) - 1
            merged = _merged(self.gaps[k], self.gaps[k + 1]) if self.own_lines(k) else None
            self.gaps[k : k + 2] = [merged or self.gaps[k + 1 if tail else k]]
            del self.items[k], self.before_comma[k]
        if not self.items and not _comments(self.gaps[0]):
            self.gaps[0] = cst.SimpleWhitespace("")


def _comments(gap: Gap) -> bool:
    lines = [gap.first_line, *gap.empty_lines] if isinstance(gap, cst.ParenthesizedWhitespace) else []
    return any(line.comment is not None for line in lines)


def _edit(text: str, path: Path, change: Any) -> str | None:
    """``text`` with ``change(_Dict)`` applied to its ``ENDPOINTS`` (None: no ENDPOINTS, or no change made)."""
    tree, chosen = _chosen(text, path)
    if chosen is None:
        return None
    index = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Dict)
                and (node.lineno, node.col_offset) < (chosen.lineno, chosen.col_offset))
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:  # Python that libcst's grammar does not know
        raise RegistryError(f"{path}: cannot parse as Python: line {exc.raw_line}: {exc.message}") from exc
    dicts: list[cst.Dict] = []

    class Find(cst.CSTVisitor):
        def visit_Dict(self, node: cst.Dict) -> None:
            dicts.append(node)

    module.visit(Find())
    found = _Dict(dicts[index])
    if not change(found):
        return None
    return module.deep_replace(found.node, found.build()).code  # type: ignore[union-attr]


def _indices(found: _Dict, alias: str) -> set[int]:
    return {k for k, item in enumerate(found.items)
            if isinstance(item, cst.DictElement) and getattr(item.key, "evaluated_value", None) == alias}


def upsert(text: str | None, entry: EndpointEntry, path: Path) -> str:
    """Return ``text`` with the alias's element replaced, or appended to ``ENDPOINTS`` (created if absent)."""
    element = f"    {json.dumps(entry.alias, ensure_ascii=False)}: {_value_code(entry)},"
    if text is None:
        return NEW_FILE.format(element=element)

    def change(found: _Dict) -> bool:
        matches = _indices(found, entry.alias)
        for k in matches:  # duplicate keys: Python keeps the last, so make them all agree
            old = found.items[k].value
            value = _value(entry, found.value_indent()).with_changes(lpar=old.lpar, rpar=old.rpar)
            found.items[k] = found.items[k].with_changes(value=value)
        if not matches and found.items:
            found.append(entry)
        elif not matches:
            found.fill_empty(entry)
        return True

    edited = _edit(text, path, change)
    if edited is not None:
        return edited
    match = re.search(r"\r\n|\r|\n", text)
    nl = match.group() if match else "\n"
    prefix = text if not text or text.endswith(("\n", "\r")) else text + nl
    block = f"{NAME} = {{\n{element}\n}}\n".replace("\n", nl)
    return prefix + (nl if prefix.strip() else "") + block


def _value_code(entry: EndpointEntry) -> str:
    return cst.Module([]).code_for_node(_value(entry, "    ", "    "))


def remove(text: str, alias: str, path: Path) -> str | None:
    """Return ``text`` without the alias's element(s), or None if the alias is not there."""

    def change(found: _Dict) -> bool:
        gone = _indices(found, alias)
        found.remove(gone)
        return bool(gone)

    return _edit(text, path, change)
