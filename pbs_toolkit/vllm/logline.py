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
#: the metadata prefix, in the POSIX ERE subset that Python's ``re`` reads the same way (no ``\s``, no escapes in
#: brackets: vLLM pads with spaces only): a start script's bash (``[[ =~ ]]``) strips it with this very text.
#: Groups: 2 process, 5 level, 6 time.
LOG_PREFIX_RE = (
    r"^ *(\(([^() ]+) +pid=([0-9]+)\) *)*"  # (EngineCore_DP0 pid=1) (Worker_TP0 pid=2)
    r"((DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) +"
    r"([0-9][0-9]-[0-9][0-9] +[0-9][0-9]:[0-9][0-9]:[0-9][0-9](\.[0-9]+)?) *"  # 11-22 02:38:28
    r"(\[[^]]*\] *)?)?"  # [loggers.py:123]
)
_PREFIX = re.compile(LOG_PREFIX_RE)


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
        level=match.group(5),
        time=match.group(6),
        process=match.group(2),
    )
