"""Tables for people and for scripts: coloured on a terminal, today's plain columns everywhere else.

A pipe, a file or a CI log gets exactly ``textutil.table``'s text (columns two spaces apart, no ANSI, no box
drawing) so scripts that cut columns keep working. A terminal gets a rich table whose job states are coloured
(READY green, PENDING/STARTING yellow, FAILED/LOST red, FINISHED/CANCELLED dim, UNKNOWN magenta); ``NO_COLOR``
(https://no-color.org) keeps the layout and drops the colours, ``TERM=dumb`` gets the plain text.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from pbs_toolkit.durations import short
from pbs_toolkit.textutil import table as plain_table

__all__ = ["STATE_STYLES", "color_enabled", "state_cell", "state_style", "table", "wants_rich"]

#: rich style per job state (``ServerState`` values); anything else is left as it is
STATE_STYLES = {
    "READY": "green", "STARTING": "yellow", "PENDING": "yellow", "FAILED": "red", "LOST": "red",
    "FINISHED": "dim", "CANCELLED": "dim", "UNKNOWN": "magenta",
}
#: headers of columns that hold a job state (``status`` STATE, ``jobs`` RECORDED)
STATE_HEADERS = frozenset({"STATE", "RECORDED"})


def state_style(value: str) -> str | None:
    """The style for a state word (``None``: not a state, shown plain); ``READY (busy: probe slow)`` is READY's."""
    return STATE_STYLES.get(value.strip().split(" (", 1)[0].upper())


def state_cell(s: Any) -> str:
    """A status row's STATE: the state, or ``READY (busy: probe slow)`` for a server too busy to answer its
    probe in time (docs/status.md "Busy is still READY")."""
    return f"{s.state.value} (busy: {s.busy.split(';')[0]})" if s.busy else s.state.value


def wants_rich(stream: Any = None) -> bool:
    """True when ``stream`` (default: stdout) is a terminal that can show a drawn table (not ``TERM=dumb``)."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


def color_enabled() -> bool:
    """False when ``NO_COLOR`` is set to anything non-empty (https://no-color.org)."""
    return not os.environ.get("NO_COLOR")


def table(rows: Sequence[Sequence[object]], headers: Sequence[str], *, rich: bool | None = None,
          color: bool | None = None, width: int | None = None) -> str:
    """``rows`` under ``headers``: plain columns off a terminal, a coloured rich table on one.

    ``rich``/``color``: force either way (default: decided from stdout and ``NO_COLOR``); ``width``: the
    terminal width to lay out for (default: the terminal's). Returns text; the caller prints it.
    """
    cells = [[str(c) for c in row] for row in rows]
    heads = [str(h) for h in headers]
    if not (wants_rich() if rich is None else rich):
        return plain_table(cells, heads)
    return _rich_table(cells, heads, color_enabled() if color is None else color,
                       width or shutil.get_terminal_size((120, 24)).columns)


def _rich_table(rows: list[list[str]], headers: list[str], color: bool, width: int) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold" if color else "")
    for header in headers:
        grid.add_column(header, overflow="fold")
    states = {i for i, h in enumerate(headers) if h in STATE_HEADERS}
    for row in rows:
        grid.add_row(*(Text(c, style=(state_style(c) or "") if color and i in states else "")
                       for i, c in enumerate(row)))
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, no_color=not color, width=width, highlight=False,
                      color_system="standard" if color else None, soft_wrap=False)
    console.print(grid)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())


def time_cells(s: Any) -> tuple[str, str]:
    """UPTIME and WALLTIME-LEFT of a status row; ``!`` marks a job within ten minutes of its walltime."""
    uptime = "-" if s.uptime_s is None else short(s.uptime_s)
    left = s.walltime_left_s
    return uptime, "-" if left is None else short(left) + ("!" if s.walltime_ending else "")
