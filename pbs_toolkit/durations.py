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
