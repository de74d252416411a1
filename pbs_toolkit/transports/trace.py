"""``pbstk -v``: one log record per command a runner starts (submit, status, cancel, ssh ...), for every backend.

Both runners call :func:`log_command` first thing in ``run``; the CLI's ``-v`` (or ``PBSTK_VERBOSE=1``) shows
the records on stderr as ``pbstk: run: <status command> 12`` or ``pbstk: ssh user@host: <status command> ...``.

Secrets stay out: stdin (where a key would travel) is never shown, only that there was some; environment
variables are shown by name only; an inline script (``bash -c '...'``) is shown as its line count, not its text.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping, Sequence

#: the logger ``-v`` turns on (DEBUG records; library users can attach their own handler)
COMMAND_LOG = logging.getLogger("pbs_toolkit.commands")
#: arguments longer than this, or with a newline, are summarised
MAX_ARG = 160


def describe(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: str | None = None) -> str:
    """The shell line a person would type for ``argv``, with env names, cwd and stdin only named."""
    parts = [_arg(a) for a in argv]
    line = " ".join(parts)
    extras = []
    if env:
        extras.append("env " + ",".join(sorted(env)))
    if cwd:
        extras.append(f"cwd {shlex.quote(cwd)}")
    if stdin is not None:
        extras.append("stdin given")
    return f"{line}  [{'; '.join(extras)}]" if extras else line


def _arg(value: str) -> str:
    if "\n" in value or len(value) > MAX_ARG:
        lines = value.count("\n") + 1
        return f"<script: {lines} line{'s' if lines != 1 else ''}>"
    return shlex.quote(value)


def log_command(where: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                stdin: str | None = None) -> None:
    """Record that ``where`` (``run`` here, ``ssh HOST`` there) starts ``argv``; cheap when nobody listens."""
    if COMMAND_LOG.isEnabledFor(logging.DEBUG):
        COMMAND_LOG.debug("%s: %s", where, describe(argv, env, cwd, stdin))
