"""Durations: short human ones for tables and progress lines (``45s``, ``7m05s``, ``1h02m``, ``2d03h``), and the one
grammar every duration option reads (``90s``, ``5m``, ``1h30m``; docs/settings.md "Durations")."""

from __future__ import annotations

import re

from pbs_toolkit.errors import UsageError


def short(seconds: float) -> str:
    """``seconds`` as at most two units, rounded down: a countdown never shows more time than is left."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


#: the units of a duration, largest first: each at most once and in this order (``1h30m``, not ``30m1h``)
_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_NUMBER = r"\d+(?:\.\d+)?"
_GRAMMAR = re.compile("".join(f"(?:({_NUMBER}){unit})?" for unit in _UNITS))
#: the longest duration any option takes
MAX_S = 365 * 86400.0
#: the shortest non-zero duration of an option counted in whole seconds (everything but timeouts and intervals)
MIN_S = 1.0
#: where the grammar is written down once; every option's error and ``--help`` point there
DOC = "docs/settings.md#durations"


def seconds_of(text: str, *, bare: bool = True) -> float | None:
    """The seconds ``text`` spells in the duration grammar, or ``None`` when it does not: a number with units from
    ``w d h m s``, each at most once, largest first (``90s``, ``5m``, ``1h30m``, ``2d12h``, ``1.5h``), or with
    ``bare`` a plain number of seconds (``45``, ``0.5``). No signs, exponents, ``inf`` or ``nan``."""
    raw = text.strip().lower()
    if re.fullmatch(_NUMBER, raw):
        return float(raw) if bare or float(raw) == 0 else None
    match = _GRAMMAR.fullmatch(raw)
    if not raw or match is None:
        return None
    return sum(float(n) * size for n, size in zip(match.groups(), _UNITS.values()) if n is not None)


def parse(text: object, what: str, *, off: bool = False, zero: bool = False, bare: bool = True,
          minimum: float = MIN_S) -> float:
    """One option's duration in seconds, by the one grammar (:func:`seconds_of`) and its bounds: at most a year,
    at least ``minimum`` (1 s, but timeouts and intervals may be fractions). ``off``: ``off`` (also ``none`` or
    empty, as a profile key says it) and any zero (``0``, ``0s``) give ``0``, switched off; ``zero``: a zero is a
    value (``clean --older-than 0``). ``bare=False``: a plain number needs a unit (where ``7`` could mean days).
    Anything else is one ``UsageError`` naming ``what``."""
    raw = str(text).strip().lower()
    if off and raw in ("", "off", "none"):
        return 0.0
    seconds = seconds_of(raw, bare=bare)
    if seconds == 0 and (off or zero):
        return 0.0
    if seconds is None or not minimum <= seconds <= MAX_S:
        also = " or off" if off else " or 0" if zero else ""
        low = "1 s" if minimum == MIN_S else f"{minimum:g} s"
        raise UsageError(f"{what} {text!r}: expected a duration from {low} to 365d such as 90s, 5m, 1h30m or 2d"
                         f"{also}{'' if bare else ' (with its unit)'} ({DOC})")
    return seconds
