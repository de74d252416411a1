"""Reading run-directory logs through a runner: the last N lines without loading the file, and follow mode."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterable, Iterator

from pbs_toolkit.transports.base import Runner

_CHUNK = 64 * 1024
#: backwards reads grow to this size for a large N, so a million lines over SFTP is not 3000 round trips
_MAX_CHUNK = 4 * 1024 * 1024

#: stream name -> file in the run directory
STREAMS = {"vllm": "vllm.log", "pbs-out": "pbs.out", "pbs-err": "pbs.err"}


def tail_blocks(runner: Runner, path: str, n: int) -> tuple[list[bytes], int]:
    """The last ``n`` lines of ``path`` as blocks in file order (joined, they are ``tail_bytes``) and the size.

    Reads backwards in blocks (64 KiB first, doubling up to 4 MiB) and counts the newlines of each block once,
    so time is linear in the bytes of the answer and memory is the answer plus one block, whatever the file
    size. (Prepending every block to one buffer and recounting it was quadratic: a million lines took 103 s.)
    A final newline does not start an extra line. Raises ``FileNotFoundError``.
    """
    size = runner.size(path)
    if size is None:
        raise FileNotFoundError(path)
    blocks: list[bytes] = []  # from the end of the file backwards
    pos, step, missing = size, _CHUNK, n
    while pos > 0 and missing > 0:
        length = min(step, pos)
        pos -= length
        block = runner.read_bytes(path, pos, length)
        # the file's own last byte, a newline, ends the last line rather than separating two
        end = len(block) - 1 if pos + len(block) == size else len(block)
        found = block.count(b"\n", 0, end)
        if found >= missing:
            cut = end
            for _ in range(missing):
                cut = block.rfind(b"\n", 0, cut)
            blocks.append(block[cut + 1 :])
            break
        missing -= found
        blocks.append(block)
        step = min(step * 2, _MAX_CHUNK)
    blocks.reverse()
    return blocks, size


def tail_bytes(runner: Runner, path: str, n: int) -> tuple[bytes, int]:
    """The bytes holding the last ``n`` lines of ``path`` and the file size read up to (see ``tail_blocks``)."""
    blocks, size = tail_blocks(runner, path, n)
    return b"".join(blocks), size


def tail_lines(runner: Runner, path: str, n: int) -> list[str]:
    """The last ``n`` lines (decoded, without newlines); empty when the file does not exist."""
    try:
        data, _ = tail_bytes(runner, path, n)
    except FileNotFoundError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def decoded_pieces(blocks: Iterable[bytes]) -> Iterator[str]:
    """``blocks`` decoded (bad UTF-8 as U+FFFD; a character split between blocks kept whole), one by one, so
    printing a large tail never holds a second copy of it."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for block in blocks:
        yield decoder.decode(block)
    rest = decoder.decode(b"", final=True)
    if rest:
        yield rest


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
