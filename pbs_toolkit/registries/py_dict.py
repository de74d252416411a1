"""verifiers 0.1.x ``configs/endpoints.py``: ``ENDPOINTS = {"alias": {"model", "url", "key": ENV_NAME}}``.

Edits go through libcst so that every other entry, comment and blank line stays byte-for-byte as the user
wrote it; only the one element for the alias is replaced or appended. Reads use the standard ``ast`` module,
which is quicker to import. Both look at the last top-level assignment to ``ENDPOINTS``, the one Python
keeps.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import RegistryError
from pbs_toolkit.registries.entry import EndpointEntry

if TYPE_CHECKING:
    import libcst as cst

NAME = "ENDPOINTS"

NEW_FILE = '''"""Endpoints for verifiers (``vf-eval -m ALIAS``).

``key`` names the environment variable that holds the API key, not the key.
pbstk edits this file in place: it replaces or appends one entry and leaves the rest as written.
"""

ENDPOINTS = {{
{element}
}}
'''


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


# ---------------------------------------------------------------- reading (ast)


def _syntax_error(path: Path, line: int | None, reason: str) -> RegistryError:
    return RegistryError(f"{path}: cannot parse as Python: line {line}: {reason}")


def _find_ast_dict(tree: ast.Module, path: Path) -> ast.Dict | None:
    found: ast.expr | None = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == NAME for t in stmt.targets
        ):
            found = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == NAME:
            found = stmt.value
    if found is None:
        return None
    if not isinstance(found, ast.Dict):
        raise RegistryError(
            f"{path}: line {found.lineno}: {NAME} is not a dict literal; pbstk will not edit it"
        )
    return found


def parse(text: str, path: Path) -> dict[str, EndpointEntry]:
    """Entries of the ``ENDPOINTS`` dict; elements that are not plain string literals are skipped."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise _syntax_error(path, exc.lineno, exc.msg) from exc
    node = _find_ast_dict(tree, path)
    entries: dict[str, EndpointEntry] = {}
    if node is None:
        return entries
    for key_node, value_node in zip(node.keys, node.values, strict=True):
        if key_node is None:  # ``**other``: not ours to interpret
            continue
        try:
            alias = ast.literal_eval(key_node)
            value: Any = ast.literal_eval(value_node)
        except ValueError:
            continue  # computed at run time (os.environ, f-strings ...): skip rather than guess
        if not isinstance(alias, str) or not isinstance(value, dict):
            continue
        model, url, key = value.get("model"), value.get("url"), value.get("key")
        if isinstance(model, str) and isinstance(url, str) and isinstance(key, str):
            entries[alias] = EndpointEntry(alias=alias, model=model, url=url, key_env=key)
    return entries


# ---------------------------------------------------------------- editing (libcst)


def _parse_module(text: str, path: Path) -> cst.Module:
    import libcst as cst

    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        # libcst's native parser reports the line after some errors; Python's own parser names the right one.
        try:
            ast.parse(text, filename=str(path))
        except SyntaxError as py_exc:
            raise _syntax_error(path, py_exc.lineno, py_exc.msg) from exc
        reason = exc.message.splitlines()[0] if exc.message else "libcst cannot parse it"
        raise _syntax_error(path, exc.raw_line, reason) from exc


def _find_cst_dict(module: cst.Module, path: Path) -> cst.Dict | None:
    import libcst as cst

    found: cst.BaseExpression | None = None
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and any(
                isinstance(t.target, cst.Name) and t.target.value == NAME for t in small.targets
            ):
                found = small.value
            elif (
                isinstance(small, cst.AnnAssign)
                and isinstance(small.target, cst.Name)
                and small.target.value == NAME
                and small.value is not None
            ):
                found = small.value
    if found is None:
        return None
    if not isinstance(found, cst.Dict):
        code = module.code_for_node(found).split("\n", 1)[0][:40]
        raise RegistryError(f"{path}: {NAME} is not a dict literal ({code}); pbstk will not edit it")
    return found


def _element_alias(element: cst.BaseDictElement) -> str | None:
    import libcst as cst

    if isinstance(element, cst.DictElement) and isinstance(
        element.key, (cst.SimpleString, cst.ConcatenatedString)
    ):
        value = element.key.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _element_indent(node: cst.Dict) -> str | None:
    """The indentation of the dict's elements, or None if the dict is written on one line."""
    import libcst as cst

    ws = node.lbrace.whitespace_after
    return ws.last_line.value if isinstance(ws, cst.ParenthesizedWhitespace) else None


def _value_indent(node: cst.Dict, indent: str | None) -> str | None:
    """Follow the layout of the last existing entry: one key per line, or the whole entry on one line."""
    import libcst as cst

    if indent is None:
        return None
    for element in reversed(node.elements):
        if isinstance(element, cst.DictElement) and isinstance(element.value, cst.Dict):
            if not isinstance(element.value.lbrace.whitespace_after, cst.ParenthesizedWhitespace):
                return None
            break
    return indent


def _append(node: cst.Dict, entry: EndpointEntry) -> cst.Dict:
    """Append the entry after the last element, leaving every existing element's bytes alone.

    In a multi-line dict the comment after the last element (``"b": {...},  # note``) is stored with the
    closing brace; it is moved onto that element's comma so that it stays on b's line.
    """
    import libcst as cst

    indent = _element_indent(node)
    value = cst.parse_expression(_value_code(entry, _value_indent(node, indent)))
    new = cst.DictElement(
        key=cst.SimpleString(_literal(entry.alias)),
        value=value,
        whitespace_before_colon=cst.SimpleWhitespace(""),
        whitespace_after_colon=cst.SimpleWhitespace(" "),
    )
    elements = list(node.elements)
    last = elements[-1]
    had_comma = isinstance(last.comma, cst.Comma)
    comma = last.comma if isinstance(last.comma, cst.Comma) else cst.Comma()
    after = comma.whitespace_after
    closing = node.rbrace.whitespace_before
    rbrace = node.rbrace
    if isinstance(after, cst.ParenthesizedWhitespace):
        # Comment lines between the last element and ``}``: keep them before ``}``, below the new element.
        comma = comma.with_changes(
            whitespace_after=after.with_changes(empty_lines=[], last_line=cst.SimpleWhitespace(indent or ""))
        )
        new = new.with_changes(
            comma=cst.Comma(
                whitespace_after=cst.ParenthesizedWhitespace(
                    empty_lines=after.empty_lines, indent=after.indent, last_line=after.last_line
                )
            )
        )
    elif isinstance(closing, cst.ParenthesizedWhitespace):
        comma = comma.with_changes(
            whitespace_after=cst.ParenthesizedWhitespace(
                first_line=closing.first_line, indent=True, last_line=cst.SimpleWhitespace(indent or "")
            )
        )
        rbrace = rbrace.with_changes(
            whitespace_before=closing.with_changes(first_line=cst.TrailingWhitespace())
        )
        new = new.with_changes(
            comma=cst.Comma(whitespace_after=after) if had_comma else cst.MaybeSentinel.DEFAULT
        )
    else:  # everything on one line
        comma = comma.with_changes(whitespace_after=cst.SimpleWhitespace(" "))
        new = new.with_changes(
            comma=cst.Comma(whitespace_after=after) if had_comma else cst.MaybeSentinel.DEFAULT
        )
    elements[-1] = last.with_changes(comma=comma)
    elements.append(new)
    return node.with_changes(elements=elements, rbrace=rbrace)


def _replace(module: cst.Module, old: cst.Dict, new: cst.BaseExpression) -> str:
    replaced = module.deep_replace(old, new)
    assert isinstance(replaced, type(module))
    return replaced.code


def upsert(text: str | None, entry: EndpointEntry, path: Path) -> str:
    """Return ``text`` with the alias's element replaced, or appended to ``ENDPOINTS`` (created if absent)."""
    import libcst as cst

    element_code = f"    {_literal(entry.alias)}: {_value_code(entry, '    ')},"
    if text is None:
        return NEW_FILE.format(element=element_code)
    module = _parse_module(text, path)
    node = _find_cst_dict(module, path)
    if node is None:
        prefix = text if not text or text.endswith(("\n", "\r")) else text + module.default_newline
        block = f"{NAME} = {{\n{element_code}\n}}\n".replace("\n", module.default_newline)
        return prefix + (module.default_newline if prefix.strip() else "") + block
    if not node.elements:
        replacement = cst.parse_expression("{\n" + element_code + "\n}")
        return _replace(module, node, replacement)

    matches = [i for i, e in enumerate(node.elements) if _element_alias(e) == entry.alias]
    if not matches:
        return _replace(module, node, _append(node, entry))
    value = cst.parse_expression(_value_code(entry, _value_indent(node, _element_indent(node))))
    elements = list(node.elements)
    for i in matches:  # duplicate keys: Python keeps the last, so make them all agree
        elements[i] = elements[i].with_changes(value=value)
    return _replace(module, node, node.with_changes(elements=elements))


def remove(text: str, alias: str, path: Path) -> str | None:
    """Return ``text`` without the alias's element, or None if the alias is not there."""
    import libcst as cst

    module = _parse_module(text, path)
    node = _find_cst_dict(module, path)
    if node is None:
        return None
    elements = list(node.elements)
    keep = [e for e in elements if _element_alias(e) != alias]
    if len(keep) == len(elements):
        return None
    if not keep:
        empty = node.with_changes(
            elements=[],
            lbrace=cst.LeftCurlyBrace(),
            rbrace=cst.RightCurlyBrace(),
        )
        return _replace(module, node, empty)
    rbrace = node.rbrace
    if _element_alias(elements[-1]) == alias:
        # The removed element ended the dict: the new last one takes its trailing-comma style, and its own
        # trailing comment (stored on its comma) moves to the closing brace, which now follows it.
        removed, last = elements[-1], keep[-1]
        own = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else None
        closing = rbrace.whitespace_before
        if (
            isinstance(own, cst.ParenthesizedWhitespace)
            and isinstance(closing, cst.ParenthesizedWhitespace)
            and closing.first_line.comment is None
        ):
            rbrace = rbrace.with_changes(whitespace_before=closing.with_changes(first_line=own.first_line))
        if isinstance(removed.comma, cst.Comma) and isinstance(last.comma, cst.Comma):
            keep[-1] = last.with_changes(
                comma=last.comma.with_changes(whitespace_after=removed.comma.whitespace_after)
            )
        else:
            keep[-1] = last.with_changes(comma=removed.comma)
    return _replace(module, node, node.with_changes(elements=keep, rbrace=rbrace))
