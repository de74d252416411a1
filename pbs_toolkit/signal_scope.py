"""Signal handlers for the length of a block: installed on entry, the previous ones put back however it ends.

Called from the main thread only (``signal.signal`` refuses any other); callers that may run elsewhere check.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def handled_by(handler: Callable[[int, Any], Any], signals: Iterable[int]) -> Iterator[None]:
    """``handler`` for each of ``signals`` while the block runs."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, earlier in previous.items():
            signal.signal(sig, earlier)
