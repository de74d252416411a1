"""Split a vLLM log line into its metadata prefix and its message.

vLLM lines look like ``INFO 11-22 02:38:28 [loggers.py:123] message``; processes started by the API server
add ``(APIServer pid=123) `` or ``(EngineCore_DP0 pid=456) `` in front
(worker processes add a second tag), and a terminal may add colour codes.
Every parser in this package reads the message through :func:`split_log_line` so that all of these forms
are handled in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PREFIX = re.compile(
    r"""^\s*
    (?:\((?P<process>[^()\s]+)\s+pid=(?P<pid>\d+)\)\s*)*          # (EngineCore_DP0 pid=1) (Worker_TP0 pid=2)
    (?:(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+
       (?P<time>\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?)\s*           # 11-22 02:38:28
       (?:\[[^\]]*\]\s*)?                                          # [loggers.py:123]
    )?""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class LogLine:
    """One log line without its metadata; fields are ``None`` where the line had no such prefix."""

    message: str
    level: str | None = None
    time: str | None = None
    process: str | None = None


def split_log_line(line: str) -> LogLine:
    """Strip colour codes, the ``(Process pid=N)`` tag and the ``LEVEL MM-DD HH:MM:SS [file:line]`` prefix."""
    text = _ANSI.sub("", line).rstrip("\r\n")
    match = _PREFIX.match(text)
    if match is None:  # the pattern is all optional, but keep mypy and readers sure
        return LogLine(message=text.strip())
    return LogLine(
        message=text[match.end() :].strip(),
        level=match.group("level"),
        time=match.group("time"),
        process=match.group("process"),
    )
