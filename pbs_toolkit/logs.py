"""Reading run-directory logs through a runner: the last N lines without loading the file, and follow mode."""

from __future__ import annotations

import time
from collections.abc import Callable

from pbs_toolkit.transports.base import Runner

_CHUNK = 64 * 1024

#: stream name -> file in the run directory
STREAMS = {"vllm": "vllm.log", "pbs-out": "pbs.out", "pbs-err": "pbs.err"}


def tail_bytes(runner: Runner, path: str, n: int) -> tuple[bytes, int]:
    """The bytes holding the last ``n`` lines of ``path`` and the file size read up to.

    Reads backwards in 64 KiB chunks, so time and memory depend on ``n``, not on the file size.
    Raises ``FileNotFoundError``.
    """
    size = runner.size(path)
    if size is None:
        raise FileNotFoundError(path)
    if n <= 0:
        return b"", size
    pos, data = size, b""
    while pos > 0:
        step = min(_CHUNK, pos)
        pos -= step
        data = runner.read_bytes(path, pos, step) + data
        # one newline more than n (the file usually ends with one)
        if data.count(b"\n", 0, len(data) - 1) >= n:
            break
    lines = data.split(b"\n")
    trailing = data.endswith(b"\n")
    body = lines[:-1] if trailing else lines
    return b"\n".join(body[-n:]) + (b"\n" if trailing else b""), size


def tail_lines(runner: Runner, path: str, n: int) -> list[str]:
    """The last ``n`` lines (decoded, without newlines); empty when the file does not exist."""
    try:
        data, _ = tail_bytes(runner, path, n)
    except FileNotFoundError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def follow(
    runner: Runner,
    path: str,
    emit: Callable[[str], None],
    *,
    lines: int = 10,
    is_final: Callable[[], bool] = lambda: False,
    notice: Callable[[str], None] = lambda _msg: None,
    poll: float = 0.2,
    final_every: float = 5.0,
) -> None:
    """Print the last ``lines`` lines, then new output as it arrives, until the job is final.

    Handles a file that does not exist yet (job queued), truncation (starts again from the top), and the
    end of the job (drains what is left, then returns). ``is_final`` is called at most every ``final_every``
    seconds since it may ask the scheduler.
    """
    offset: int | None = None
    pending = b""
    last_check = 0.0
    waiting_said = False
    while True:
        size = runner.size(path)
        if size is None:
            if not waiting_said:
                notice(f"waiting for {path} to appear (job not started yet?)")
                waiting_said = True
        elif offset is None:
            data, offset = tail_bytes(runner, path, lines)
            pending = _emit_lines(data, emit)
        elif size < offset:
            notice(f"{path} was truncated; reading from the start")
            offset, pending = 0, b""
        elif size > offset:
            data = runner.read_bytes(path, offset, size - offset)
            offset += len(data)
            pending = _emit_lines(pending + data, emit)
            continue  # more may be waiting: read again before sleeping
        now = time.monotonic()
        if now - last_check >= final_every:
            last_check = now
            if is_final():
                final_size = runner.size(path)
                if offset is not None and final_size is not None and final_size > offset:
                    continue
                if pending:
                    emit(pending.decode("utf-8", "replace"))
                return
        time.sleep(poll)


def _emit_lines(data: bytes, emit: Callable[[str], None]) -> bytes:
    """Emit complete lines; return the incomplete tail to prepend next time."""
    *complete, rest = data.split(b"\n")
    for line in complete:
        emit(line.decode("utf-8", "replace"))
    return rest
