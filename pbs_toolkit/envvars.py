"""Numbers read from ``PBSTK_*`` environment variables: one reader, so a bad value means the default everywhere."""

from __future__ import annotations

import os
from collections.abc import Callable


def env_float(name: str, default: float, valid: Callable[[float], bool]) -> float:
    """``$name`` as a number; ``default`` when it is unset, empty, not a number, or not ``valid`` (NaN never is)."""
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if valid(value) else default
