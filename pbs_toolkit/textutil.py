"""Plain-text tables for terminal output, shared by the CLI and library reports such as ``tune``."""

from __future__ import annotations


def table(rows: list[list[str]], headers: list[str]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)
