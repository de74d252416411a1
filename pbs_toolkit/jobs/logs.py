"""Reading run-directory logs through a runner: the last N lines without loading the file, and follow mode."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from pbs_toolkit.errors import UsageError

if TYPE_CHECKING:  # only named: a runner is handed in, and `pbstk logs` must not import every transport
    from pbs_toolkit.transports.base import OpenFile, Runner

_CHUNK = 64 * 1024
#: backwards reads grow to this size for a large N, so a million lines over SFTP is not 3000 round trips
_MAX_CHUNK = 4 * 1024 * 1024

#: the server's own stream; the scheduler's (``sched-out``, ``sched-err``) are files its backend names
SERVER_STREAMS = {"vllm": "vllm.log"}


class FileReader(Protocol):
    """What reading the end of a file needs of a runner: any ``Runner``, or ``transports.local_files.LocalFiles``
    alone (``pbstk logs -n`` of a job on this machine, which must not pay for running commands)."""

    def size(self, path: str) -> int | None: ...

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...


def streams() -> tuple[str, ...]:
    """Every stream name ``logs`` accepts: the server's, each backend's, older aliases (``stream_aliases``)."""
    # imported here, not at the top: the scheduler backends are a third of `pbstk logs -n 100`'s start, and the
    # server's own stream (the default) needs none of them (tests/test_cli_startup.py holds logs to its imports)
    from pbs_toolkit.schedulers import stream_aliases, stream_names

    return (*SERVER_STREAMS, *stream_names(), *stream_aliases())


def stream_path(run_dir: str, scheduler: str, stream: str) -> str:
    """The file of ``stream`` for a job of backend ``scheduler`` (an alias maps to its generic name)."""
    if stream in SERVER_STREAMS:
        return f"{run_dir}/{SERVER_STREAMS[stream]}"
    from pbs_toolkit.schedulers import backend_class, stream_aliases  # a scheduler's stream: see streams()

    stream = stream_aliases().get(stream, stream)
    name = SERVER_STREAMS.get(stream) or backend_class(scheduler).streams.get(stream)
    if name is None:
        raise UsageError(f"unknown log stream {stream!r} (known: {', '.join(streams())})")
    return f"{run_dir}/{name}"


def tail_blocks(runner: FileReader, path: str, n: int) -> tuple[list[bytes], int]:
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


def tail_bytes(runner: FileReader, path: str, n: int) -> tuple[bytes, int]:
    """The bytes holding the last ``n`` lines of ``path`` and the file size read up to (see ``tail_blocks``)."""
    blocks, size = tail_blocks(runner, path, n)
    return b"".join(blocks), size


def tail_lines(runner: FileReader, path: str, n: int) -> list[str]:
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


# -- follow ----------------------------------------------------------------------------------------------


class _Follower:
    """The state of ``follow``: the open file, how far it was read, and the incomplete last line."""

    def __init__(self, runner: Runner, path: str, emit: Callable[[str], None], notice: Callable[[str], None]) -> None:
        self.runner, self.path, self.emit, self.notice = runner, path, emit, notice
        self.file: OpenFile | None = None
        self.offset = 0
        self.pending = b""
        self.seen_any = False
        self.waiting_said = False

    def step(self, lines: int) -> bool:
        """One look at the file; ``True`` when something changed (look again before sleeping)."""
        if self.file is None:
            return self._open(lines)
        try:
            names = self.file.path_names_it()
            if names is None:
                self._leave("was removed")
                return False
            if not names:
                self._leave("was replaced (rotated or recreated)")
                return True
            size = self.file.size()
            if size < self.offset:
                self.notice(f"{self.path} was truncated; reading from the start")
                self._flush()
                self.offset = 0
                return True
            if size == self.offset:
                return False
            data = self.file.read(self.offset, min(size - self.offset, _MAX_CHUNK))
        except FileNotFoundError:  # gone between two calls (over SSH: reopened after a drop, and gone)
            self._leave("was removed")
            return False
        self.offset += len(data)
        self.pending = _emit_lines(self.pending + data, self.emit)
        return bool(data)

    def _open(self, lines: int) -> bool:
        """Open the file the path names now: its last ``lines`` lines the first time, all of it after that."""
        try:
            self.file = self.runner.open_file(self.path)
        except FileNotFoundError:
            if not self.seen_any and not self.waiting_said:
                self.notice(f"waiting for {self.path} to appear (job not started yet?)")
                self.waiting_said = True
            return False
        if self.seen_any:
            self.notice(f"reading the new {self.path} from the start")
            self.offset = 0
            return True
        self.seen_any = True
        try:
            data, self.offset = tail_bytes(self.runner, self.path, lines)
        except FileNotFoundError:
            self.offset = 0
            return True
        self.pending = _emit_lines(data, self.emit)
        return True

    def _leave(self, why: str) -> None:
        """The path no longer names the open file: show what the old file still holds, then let it go."""
        assert self.file is not None
        if self.file.drains:
            self.notice(f"{self.path} {why}")
            try:
                while data := self.file.read(self.offset, _MAX_CHUNK):
                    self.offset += len(data)
                    self.pending = _emit_lines(self.pending + data, self.emit)
            except FileNotFoundError:
                pass
        else:
            self.notice(f"{self.path} {why}; lines written to the old file after the last read are not shown")
        self._flush()
        self.file.close()
        self.file = None
        self.offset = 0

    def _flush(self) -> None:
        """The incomplete last line of a file that ends (rotation, truncation, job end) is a line after all."""
        if self.pending:
            self.emit(self.pending.decode("utf-8", "replace"))
            self.pending = b""

    def close(self) -> None:
        self._flush()
        if self.file is not None:
            self.file.close()
            self.file = None


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

    Follows the file, not the name: when the path names another file (rotated: renamed and a new one created;
    recreated: deleted and written again), the old file is drained where it can still be read and the new one
    is read from byte 0, so nothing between the two is lost. The file is held open (``Runner.open_file``): a
    descriptor here, compared by (device, inode) with the path; over SSH an SFTP handle, compared by size and
    mtime since SFTP has no inodes (see ``SSHRunner.open_file``). Also handles a file that does not exist yet
    (job queued), truncation (starts again from the top), partial lines (held until complete, shown at the
    end), bad UTF-8 (shown as U+FFFD), and the end of the job (drains what is left, then returns). ``is_final``
    is called at most every ``final_every`` seconds since it may ask the scheduler.
    """
    for line in follow_lines(runner, path, lines, final_every, notice, is_final, poll=poll):
        emit(line)


def follow_lines(runner: Runner, path: str, lines: int, final_every: float, notice: Callable[[str], None],
                 is_final: Callable[[], bool], *, poll: float = 0.2) -> Iterator[str]:
    """The follow loop (``follow`` hands each line to ``emit``; ``Client.logs`` iterates): the follower's lines
    handed out as they arrive and its notices told to ``notice`` in their place between them (so "rotated"
    comes between the old file's last line and the new file's first). Closing the generator stops following."""
    pending: list[tuple[bool, str]] = []
    follower = _Follower(runner, path, lambda line: pending.append((False, line)),
                         lambda message: pending.append((True, message)))
    closed, final, last_check = False, False, 0.0
    try:
        while True:
            progressed = follower.step(lines)
            yield from _drain(pending, notice)
            if progressed:
                continue
            if final:
                break
            if time.monotonic() - last_check >= final_every:
                last_check = time.monotonic()
                final = is_final()
                if final:
                    continue
            time.sleep(poll)
        follower.close()  # the incomplete last line, if any
        closed = True
        yield from _drain(pending, notice)
    finally:
        if not closed:
            follower.close()


def _drain(pending: list[tuple[bool, str]], notice: Callable[[str], None]) -> Iterator[str]:
    """Hand out and forget what the follower emitted: its lines, and (``True``) its notices told to ``notice``."""
    items = pending[:]
    pending.clear()
    for is_notice, text in items:
        if is_notice:
            notice(text)
        else:
            yield text


def _emit_lines(data: bytes, emit: Callable[[str], None]) -> bytes:
    """Emit complete lines; return the incomplete tail to prepend next time."""
    *complete, rest = data.split(b"\n")
    for line in complete:
        emit(line.decode("utf-8", "replace"))
    return rest


# -- one job's log (``Client.logs`` / ``log_text``) -----------------------------------------------------------


def check_log_request(lines: int, stream: str, node: int | None, model: int | None = None) -> None:
    """Refuse a negative ``lines``, and ``node`` (or a multi-model job's ``model``) with a stream that is the
    job's, not a node's (a model's)."""
    if lines < 0:
        raise UsageError("lines must not be negative")
    if node is not None and stream != "vllm":
        raise UsageError(f"--node picks one node's vLLM log; the {stream} stream is the job's, not a node's")
    if model is not None and (stream != "vllm" or node is not None):
        raise UsageError("--model picks one model's vLLM log: leave --stream and --node out (the scheduler's "
                         "streams are the job's: --replica K)")


def tail_pieces(runner: FileReader, path: str, lines: int, owner: str) -> Iterator[str]:
    """The last ``lines`` of ``path`` as decoded pieces (line ends kept); ``owner``: whose log, for the error
    when it does not exist yet."""
    try:
        blocks, _ = tail_blocks(runner, path, lines)
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist yet ({owner} not started?)") from None
    return decoded_pieces(blocks)


def last_lines(runner: FileReader, path: str, lines: int, owner: str) -> Iterator[str]:
    """``tail_pieces`` as lines without their ends (refuses a log that does not exist yet, at once)."""
    pieces = tail_pieces(runner, path, lines, owner)
    return iter("".join(pieces).splitlines() if lines else ())


def follow_job_log(runner: Callable[[], Runner], path: str, lines: int, final_every: float,
                   notice: Callable[[str], None], is_final: Callable[[], bool]) -> Iterator[str]:
    """``follow_lines`` until ``is_final``, a dropped connection named as such (the path it followed). The
    runner is opened at the first line asked for."""
    from pbs_toolkit.errors import TransportError

    try:
        yield from follow_lines(runner(), path, lines, final_every, notice, is_final)
    except TransportError as exc:
        raise TransportError(f"lost the connection while following {path}: {exc}") from exc
