"""A user's ``--vllm-arg`` replaces the preset's value for the same flag.

vLLM's argument parser lets the last of two equal flags win, silently; pbstk puts the preset's flags first, so
``--vllm-arg=--max-num-seqs=64`` on a preset with ``--max-num-seqs 512`` worked, but both reached vLLM and the
command line (and the job record) said two things. Here the preset's flag is dropped instead and a note says
so; ``--no-X`` and ``--X`` count as the same flag. The layout's own flags (``--tensor-parallel-size``, ...)
are not a preset value to replace: pbstk sized the job for them, so a ``--vllm-arg`` that sets one is refused
before this runs (settings/layout_flags.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: a negative number is a value, not a flag
_NUMBER = re.compile(r"^-\d")


def chunks(args: list[str]) -> list[list[str]]:
    """``args`` as one list per flag: the flag, then the values that follow it (``--a 1 --b=2 --c`` ->
    ``[[--a, 1], [--b=2], [--c]]``); values before any flag are a chunk of their own."""
    out: list[list[str]] = []
    for arg in args:
        if arg.startswith("-") and not _NUMBER.match(arg) or not out:
            out.append([arg])
        else:
            out[-1].append(arg)
    return out


def flag_value(args: Sequence[str], name: str) -> str | None:
    """Value of ``name`` in argv, accepting ``--flag value`` and ``--flag=value``; the last one wins (as in vLLM's
    parser). The one reader of a flag's value: ``doctor`` and the autoscaler (a replica's ``--max-num-seqs``)."""
    value = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def int_flag(args: Sequence[str], name: str) -> int | None:
    """:func:`flag_value` as an integer; ``None`` when absent or not a number."""
    value = flag_value(args, name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def base_name(flag: str) -> str:
    """``--no-enforce-eager`` and ``--enforce-eager=true`` -> ``--enforce-eager``."""
    name = flag.split("=", 1)[0]
    return "--" + name[len("--no-"):] if name.startswith("--no-") else name


def apply_overrides(preset_args: list[str], user_args: list[str], preset: str) -> tuple[list[str], list[str]]:
    """``preset_args`` without the flags ``user_args`` set again, and one note per flag dropped."""
    users = {base_name(c[0]): c for c in chunks(user_args) if c[0].startswith("-")}
    kept: list[str] = []
    notes: list[str] = []
    for chunk in chunks(preset_args):
        user = users.get(base_name(chunk[0]))
        if user is None:
            kept += chunk
        else:
            notes.append(f"--vllm-arg {' '.join(user)} overrides preset {preset}'s {' '.join(chunk)}")
    return kept, notes

