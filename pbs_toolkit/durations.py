"""Short human durations for tables and progress lines (``45s``, ``7m05s``, ``1h02m``, ``2d03h``)."""

from __future__ import annotations


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


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse(text: object, what: str, *, off: bool = False) -> float:
    """``90s``, ``30m``, ``1h``, ``2d`` or plain seconds (``45``) -> seconds, finite and > 0. ``off``: also ``0``,
    ``off`` or an empty text, which give ``0`` (switched off). Anything else is one ``UsageError`` naming ``what``."""
    import math

    from pbs_toolkit.errors import UsageError

    raw = str(text).strip().lower()
    if off and raw in ("", "0", "off", "none"):
        return 0.0
    unit = raw[-1:] if raw[-1:] in _UNITS else "s"
    number = raw[:-1] if raw[-1:] in _UNITS else raw
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0 or seconds > 365 * 86400:
        hint = " (or off)" if off else ""
        raise UsageError(f"{what} {text!r}: expected a duration like 30m, 90s, 1h or 2d{hint}")
    return seconds
