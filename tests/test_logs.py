"""``pbstk logs``: the last N lines without reading the whole file (a million lines too), and follow mode
(queued, rotation, recreation, truncation, partial lines, bad UTF-8, job end), locally and over a real sshd
(including a dropped connection)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import launch, until, wait_recorded
from helpers import pbstk_raising as pbstk
from sshd import SshdInfo, start_sshd

from pbs_toolkit.errors import TransportError
from pbs_toolkit.jobs.logs import decoded_pieces, follow, tail_bytes, tail_lines
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.transports.local import LocalRunner
from pbs_toolkit.transports.local_files import LocalFiles


class CountingReads(LocalFiles):
    """Counts the bytes read, to show ``tail_bytes`` does not read the whole file (``LocalFiles``: what ``pbstk
    logs -n`` of a local job reads with)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0
        self.reads = 0

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = super().read_bytes(path, offset, length)
        self.bytes_read += len(data)
        self.reads += 1
        return data


# -- tail ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "n", "expected"),
    [
        ("a\nb\nc\n", 2, "b\nc\n"),
        ("a\nb\nc", 2, "b\nc"),  # no final newline
        ("a\nb\nc\n", 10, "a\nb\nc\n"),  # more than there is
        ("a\nb\nc\n", 0, ""),
        ("", 5, ""),
        ("\n\n\n", 2, "\n\n"),  # empty lines count
        ("x\r\ny\r\n", 1, "y\r\n"),
    ],
)
def test_tail_bytes_small(tmp_path: Path, text: str, n: int, expected: str) -> None:
    path = tmp_path / "log"
    path.write_text(text, newline="")
    data, size = tail_bytes(LocalRunner(), str(path), n)
    assert data.decode() == expected and size == len(text.encode())


def test_tail_reads_only_the_end(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    line = b"INFO 11-22 02:38:28 [api_server.py:1] " + b"x" * 60 + b"\n"  # 100 bytes
    with open(path, "wb") as fh:
        block = line * 10_000
        for _ in range(20):  # 20 MB
            fh.write(block)
        fh.write(b"last line without newline")
    runner = CountingReads()
    data, _ = tail_bytes(runner, str(path), 100)
    lines = data.decode().split("\n")
    assert len(lines) == 100 and lines[-1] == "last line without newline" and lines[0] == line.decode().rstrip()
    assert runner.bytes_read <= 2 * 64 * 1024  # about 10 KB needed, read in 64 KiB chunks


def test_tail_line_longer_than_a_chunk(tmp_path: Path) -> None:
    path = tmp_path / "log"
    long = "y" * 200_000
    path.write_text(f"first\n{long}\nlast\n")
    assert tail_lines(LocalRunner(), str(path), 2) == [long, "last"]
    assert tail_lines(LocalRunner(), str(path), 3) == ["first", long, "last"]


@pytest.mark.parametrize("final_newline", [True, False])
def test_tail_many_lines_exact(tmp_path: Path, final_newline: bool) -> None:
    """-n over hundreds of thousands of lines (of varying length, some empty, some longer than a block) gives
    exactly those lines, reading little more than the answer in few reads (each one a round trip over SFTP).
    The old code was correct here but quadratic (a million lines: 103 s); benchmarks/cpu/bench_logs.py has the
    numbers."""
    lines = [f"line {i} " + "x" * (i % 97) if i % 13 else "" for i in range(300_000)]
    lines[123_456] = "z" * 300_000
    text = "\n".join(lines) + ("\n" if final_newline else "")
    path = tmp_path / "log"
    path.write_text(text)
    for n in (1, 99_999, 299_999, 400_000):
        runner = CountingReads()
        data, size = tail_bytes(runner, str(path), n)
        want = "\n".join(lines[-n:]) + ("\n" if final_newline else "")
        assert size == len(text) and data.decode() == want, n
        assert runner.bytes_read <= 2 * len(want) + 128 * 1024 and runner.reads <= 12, (n, runner.reads)


def test_decoded_pieces_keeps_characters_split_across_blocks() -> None:
    data = "é€😀\n".encode() * 5 + b"bad \xff\xfe bytes\n\xe2\x82"
    for size in (1, 2, 3, 7):
        blocks = [data[i : i + size] for i in range(0, len(data), size)]
        assert "".join(decoded_pieces(blocks)) == data.decode("utf-8", "replace")


def test_tail_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tail_bytes(LocalRunner(), str(tmp_path / "nope"), 5)
    assert tail_lines(LocalRunner(), str(tmp_path / "nope"), 5) == []


# -- follow (library) ----------------------------------------------------------------------------------------


class Follower:
    """Runs ``follow`` in a thread, collecting lines and notices."""

    def __init__(self, runner: Runner, path: Path, **kw: Any) -> None:
        self.lines: list[str] = []
        self.notices: list[str] = []
        self.final = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(runner, str(path)), kwargs=kw, daemon=True)
        self.thread.start()

    def _run(self, runner: Runner, path: str, **kw: Any) -> None:
        try:
            follow(runner, path, self.lines.append, is_final=self.final.is_set, notice=self.notices.append,
                   poll=0.05, final_every=0.2, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc

    def wait_for(self, line: str, timeout: float = 5.0) -> None:
        until(lambda: line in self.lines, timeout, f"{line!r} in {self.lines[-5:]}")

    def stop(self, timeout: float = 5.0) -> None:
        self.final.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "follow did not return after the job became final"


def test_follow_missing_then_appended_then_truncated(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    f = Follower(LocalRunner(), path, lines=2)
    until(lambda: f.notices, what="the waiting notice")
    assert "waiting for" in f.notices[0] and "to appear" in f.notices[0]
    # appears whole (a rename): a follower that looked between a create and its write would rightly show all three
    (tmp_path / "vllm.log.new").write_text("one\ntwo\nthree\n")
    os.rename(tmp_path / "vllm.log.new", path)
    f.wait_for("three")
    assert f.lines == ["two", "three"]  # the last 2 lines first
    with open(path, "a") as fh:
        fh.write("four\nfi")  # half a line is held back ...
    f.wait_for("four")
    time.sleep(0.2)
    assert "fi" not in f.lines
    with open(path, "a") as fh:
        fh.write("ve\n")  # ... until it is complete
    f.wait_for("five")
    path.write_text("new\n")  # truncated (a restart with a fresh log)
    f.wait_for("new")
    assert any("truncated" in n for n in f.notices)
    with open(path, "a") as fh:
        fh.write("tail without newline")
    time.sleep(0.2)
    f.stop()
    assert f.error is None
    assert f.lines == ["two", "three", "four", "five", "new", "tail without newline"]


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def test_follow_rotation_drains_the_old_file_and_reads_the_new_one_from_the_start(tmp_path: Path) -> None:
    """logrotate's rename + create: the old file's last lines (written after the last poll) and the new file's
    first bytes both appear. With only an offset, the new (bigger) file was read from the old offset."""
    path = tmp_path / "vllm.log"
    path.write_bytes(b"old 1\nold 2\n")
    f = Follower(LocalRunner(), path, lines=10)
    f.wait_for("old 2")
    _append(path, b"old 3\nold 4 without newline")  # written, then rotated before the next poll
    os.rename(path, tmp_path / "vllm.log.1")
    path.write_bytes(b"new file, first line, longer than the old one was\nnew 2\n")
    f.wait_for("new 2")
    _append(tmp_path / "vllm.log.1", b"late write to the old file\n")  # the old name is no longer followed
    _append(path, b"new 3\n")
    f.wait_for("new 3")
    f.stop()
    assert f.error is None
    assert f.lines == ["old 1", "old 2", "old 3", "old 4 without newline",
                       "new file, first line, longer than the old one was", "new 2", "new 3"]
    assert any("was replaced" in n or "was removed" in n for n in f.notices), f.notices


@pytest.mark.parametrize("how", ["unlink", "replace"])
def test_follow_recreated_file_is_read_from_byte_0(tmp_path: Path, how: str) -> None:
    """A log deleted and written again (a restart), or atomically replaced, is a new file even when it is
    already longer than what was read of the old one."""
    path = tmp_path / "vllm.log"
    path.write_bytes(b"first run\n")
    f = Follower(LocalRunner(), path, lines=10)
    f.wait_for("first run")
    fresh = b"second run: a first line that is longer than the whole old file\nsecond run: 2\n"
    if how == "unlink":
        path.unlink()
        path.write_bytes(fresh)
    else:
        (tmp_path / "tmp").write_bytes(fresh)
        os.replace(tmp_path / "tmp", path)
    f.wait_for("second run: 2")
    f.stop()
    assert f.error is None
    assert f.lines == ["first run", "second run: a first line that is longer than the whole old file", "second run: 2"]


class ByPathOnly(LocalRunner):
    """A runner that cannot hold files open: the ``Runner`` defaults (read by path, ``stat -c`` for the inode)."""

    open_file = Runner.open_file
    file_id = Runner.file_id


def test_follow_by_path_fallback_still_reads_a_new_file_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_bytes(b"old\n")
    f = Follower(ByPathOnly(), path, lines=10)
    f.wait_for("old")
    os.rename(path, tmp_path / "vllm.log.1")
    path.write_bytes(b"new file, first line, longer than the old one\nnew 2\n")
    f.wait_for("new 2")
    f.stop()
    assert f.error is None and f.lines == ["old", "new file, first line, longer than the old one", "new 2"]
    assert any("not shown" in n for n in f.notices), f.notices  # it says it could not drain the old file


def test_follow_file_removed_then_created_again_later(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_bytes(b"a\n")
    f = Follower(LocalRunner(), path, lines=10)
    f.wait_for("a")
    _append(path, b"b\n")
    path.unlink()
    until(lambda: any("was removed" in n for n in f.notices), what="the removal notice")
    time.sleep(0.15)
    path.write_bytes(b"c\n")
    f.wait_for("c")
    f.stop()
    assert f.error is None and f.lines == ["a", "b", "c"]
    assert not any("waiting for" in n for n in f.notices)  # not "job not started yet" after a removal


def test_follow_partial_lines_and_bad_utf8(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 show as U+FFFD instead of stopping the follower; a character split across two
    writes is whole; an incomplete last line is held until it ends, or shown when the job ends."""
    path = tmp_path / "vllm.log"
    path.write_bytes(b"")
    f = Follower(LocalRunner(), path, lines=10)
    time.sleep(0.1)
    _append(path, b"bad \xff\xfe bytes\ncaf\xc3")
    f.wait_for("bad \ufffd\ufffd bytes")
    time.sleep(0.15)
    assert f.lines == ["bad \ufffd\ufffd bytes"]  # "caf" + half of "é" is held back
    _append(path, b"\xa9\nunfinished \xe2\x82")
    f.wait_for("café")
    time.sleep(0.15)
    f.stop()
    assert f.error is None
    assert f.lines == ["bad \ufffd\ufffd bytes", "café", "unfinished \ufffd"]


def test_follow_returns_at_once_for_an_ended_job(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text("a\nb\n")
    done: list[str] = []
    begin = time.monotonic()
    follow(LocalRunner(), str(path), done.append, lines=5, is_final=lambda: True, poll=0.05)
    assert done == ["a", "b"] and time.monotonic() - begin < 1


# -- the CLI on a job of this machine: -n reads the end of the file ---------------------------------------------


def recorded_local_job(tmp_path: Path, log: bytes) -> tuple[str, Path]:
    """A job of this machine in the job store, its vLLM log holding ``log`` (nothing runs: ``-n`` reads a file)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "vllm.log").write_bytes(log)
    JobStore().add(JobRecord(job_id="7.local", scheduler="local", profile="local", model="m", served_model_name="m",
                             preset="cpu", name="tail", run_dir=str(run_dir)))
    return "7.local", run_dir / "vllm.log"


LONG = b"y" * 200_000  # longer than the first backwards read (64 KiB) and than the second (128 KiB)


@pytest.mark.parametrize(
    ("log", "n", "expected"),
    [
        (b"first\n" + LONG + b"\nlast\n", 2, LONG + b"\nlast\n"),  # a line longer than a block
        (b"first\n" + LONG + b"\nlast\n", 3, b"first\n" + LONG + b"\nlast\n"),
        (b"a\nb\nc", 2, b"b\nc"),  # no final newline: the last line is still one
        (b"a\nb\nc\n", 10, b"a\nb\nc\n"),  # N above the number of lines: all of them
        (b"", 5, b""),  # an empty log
        (b"x\r\ny\r\nz\r\n", 2, b"y\r\nz\r\n"),  # CRLF: lines end at \n, the \r is the line's own
        (b"a\n\n\n", 2, b"\n\n"),  # empty lines count
        ("é€😀\n".encode() * 30_000, 1, "é€😀\n".encode()),  # characters split between blocks stay whole
    ],
)
def test_cli_logs_n_of_a_local_job(tmp_path: Path, log: bytes, n: int, expected: bytes) -> None:
    job, _ = recorded_local_job(tmp_path, log)
    result = pbstk("logs", job, "-n", str(n))
    assert result.exit_code == 0 and result.stdout_bytes == expected, result.stdout_bytes[:200]


def bytes_read_by_this_process() -> int:
    """The kernel's count of the bytes this process has read so far (``rchar``: read and pread, any file)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_cli_logs_n_reads_the_end_of_a_4_gib_log_not_the_log(tmp_path: Path) -> None:
    """``pbstk logs JOB -n 2`` on a 4 GiB log (sparse: it costs no disk) reads a block at its end, as the kernel
    counts the bytes this process reads: not the file, whatever reads it (no reader replaced)."""
    job, log = recorded_local_job(tmp_path, b"")
    with open(log, "r+b") as fh:
        fh.truncate(4 << 30)
        fh.seek(4 << 30)
        fh.write(b"\nfirst\nsecond\n")
    assert pbstk("logs", job, "-n", "1").stdout == "second\n"  # imports and the store's first look, not measured
    before = bytes_read_by_this_process()
    result = pbstk("logs", job, "-n", "2")
    read = bytes_read_by_this_process() - before
    assert result.exit_code == 0 and result.stdout == "first\nsecond\n", result.output
    assert read < 1 << 20, f"read {read} bytes of a {4 << 30}-byte log for its last 2 lines"


# -- the CLI on real (fake PBS) jobs ----------------------------------------------------------------------


def test_cli_tail_newest_job_and_streams(fakepbs: Path, standins: Path) -> None:
    record = launch()
    assert pbstk("wait", "--timeout", "30").exit_code == 0
    newest = pbstk("logs", "-n", "2")  # no JOB: the newest job
    assert newest.exit_code == 0, newest.output
    assert newest.stdout.splitlines() == tail_lines(LocalRunner(), f"{record.run_dir}/vllm.log", 2)
    assert len(newest.stdout.splitlines()) == 2
    by_id = pbstk("logs", record.job_id.split(".")[0], "-n", "1")  # an id prefix works too
    assert by_id.stdout == newest.stdout.splitlines(keepends=True)[-1]
    pbs_out = pbstk("logs", record.job_id, "--stream", "pbs-out")
    assert pbs_out.exit_code == 0 and f"pbstk: job {record.job_id} on" in pbs_out.stdout
    pbs_err = pbstk("logs", record.job_id, "--stream", "pbs-err")
    assert pbs_err.exit_code == 0 and pbs_err.stdout == ""
    assert pbstk("logs", "-n", "-1").exit_code == 2
    unknown = pbstk("logs", "999999")
    assert unknown.exit_code == 7 and "unknown job '999999'" in unknown.stderr


def test_cli_tail_before_the_job_starts(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "30")
    record = launch()
    result = pbstk("logs", "-n", "5")
    assert result.exit_code == 2
    assert f"vllm.log does not exist yet (job {record.job_id} not started?)" in result.stderr


def _follow_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit.cli.main", "logs", "-f", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_cli_follow_from_queued_to_job_end(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts while the job is queued (no file yet), shows the startup, stops by itself when the job ends."""
    # queued long enough for `pbstk logs -f` to start (a Python start-up) before the log exists; 1 s was a race
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "exit-after-ready")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SECONDS", "1.5")
    record = launch()
    proc = _follow_cli("-n", "100")
    try:
        out, err = proc.communicate(timeout=25)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "waiting for" in err and "to appear" in err
    assert "Starting to load model" in out and "Application startup complete." in out
    assert "vLLM exited with code 0" in out  # the lines written at the very end were drained
    # follow stops on the run directory's verdict; the store records it once the scheduler says F
    wait_recorded(record.job_id, "FINISHED")


def test_cli_follow_stops_after_cancel(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")
    record = launch()
    until(lambda: Path(record.run_dir, "vllm.log").exists(), what="the log")
    proc = _follow_cli(record.job_id)
    assert proc.stdout is not None
    assert until(proc.stdout.readline, what="a first line").strip()
    assert pbstk("cancel", record.job_id).exit_code == 0
    cancelled = time.monotonic()
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert time.monotonic() - cancelled < 10  # is_final is asked every 5 s at most
    assert "received a stop signal" in out


# -- over SSH --------------------------------------------------------------------------------------------------


def _ssh_runner(info: SshdInfo) -> Any:
    from pbs_toolkit.transports.ssh import SSHRunner

    return SSHRunner(info.alias, config_path=info.ssh_config, known_hosts_path=info.known_hosts)


@pytest.mark.ssh
def test_cli_logs_over_ssh(login_node: SshdInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    record = launch("--ssh", login_node.alias)
    assert pbstk("wait", "--timeout", "30").exit_code == 0
    result = pbstk("logs", "-n", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == tail_lines(LocalRunner(), f"{record.run_dir}/vllm.log", 3)
    proc = _follow_cli("-n", "1")  # -f over SSH, then the job ends
    assert proc.stdout is not None
    until(proc.stdout.readline, what="the first followed line")
    assert pbstk("cancel", record.job_id).exit_code == 0
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "received a stop signal" in out


@pytest.mark.ssh
def test_follow_over_ssh_survives_a_drop(login_node: SshdInfo, tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text("before\n")
    with _ssh_runner(login_node) as runner:
        f = Follower(runner, path)
        f.wait_for("before")
        runner._client.get_transport().close()  # the network drops under the follower
        with open(path, "a") as fh:
            fh.write("after the drop\n")
        f.wait_for("after the drop")
        f.stop()
        assert f.error is None and runner.connections_opened == 2


@pytest.mark.ssh
def test_follow_over_ssh_reads_a_rotated_file_from_the_start(login_node: SshdInfo, tmp_path: Path) -> None:
    """SFTP attributes carry no inode: the open SFTP handle still drains the renamed file, and its size/mtime
    tell the new file apart, which is read from byte 0 (the same connection throughout)."""
    path = tmp_path / "vllm.log"
    path.write_bytes(b"old\n")
    with _ssh_runner(login_node) as runner:
        f = Follower(runner, path)
        f.wait_for("old")
        _append(path, b"old 2, written just before the rotation\n")
        os.rename(path, tmp_path / "vllm.log.1")
        path.write_bytes(b"new file, first line, longer than the old one\nnew 2\n")
        f.wait_for("new 2")
        f.stop()
        assert f.error is None
        assert f.lines == ["old", "old 2, written just before the rotation",
                           "new file, first line, longer than the old one", "new 2"]
        assert runner.connections_opened == 1


@pytest.mark.ssh
def test_follow_over_ssh_gives_a_clear_error_when_the_host_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text("before\n")
    with start_sshd(tmp_path / "gone") as own:
        runner = _ssh_runner(own)
        f = Follower(runner, path)
        f.wait_for("before")
    # the listening sshd is gone (open sessions live on in their own processes): drop ours too
    runner._client.get_transport().close()
    f.thread.join(15)
    runner.close()
    assert isinstance(f.error, TransportError)
    assert "cannot reach 127.0.0.1" in str(f.error) and "connection refused" in str(f.error)
