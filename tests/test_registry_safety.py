"""Registries are regular files or nothing: devices, FIFOs, sockets, directories, pseudo-files, symlinks leaving
their directory, read-only files and directories, and a --format that contradicts the suffix are refused (exit 8)
before anything is written or waited for; a large endpoints.py is edited in bounded time and memory."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import launch, pbstk

from pbs_toolkit.endpoints import target as safety
from pbs_toolkit.endpoints.registry import EndpointEntry, read_endpoints, remove_endpoint, write_endpoint
from pbs_toolkit.errors import RegistryError

NEW = EndpointEntry("qwen", "Qwen/Qwen3-VL-2B-Instruct", "http://gpu01:8000/v1", "VLLM_KEY")
PY = 'ENDPOINTS = {\n    "other": {"model": "m", "url": "http://o:1/v1", "key": "K"},\n}\n'


def _refused(action: Callable[[], object], match: str, within: float = 5.0) -> RegistryError:
    """Run ``action`` in a daemon thread so that a regression that blocks (a FIFO) fails instead of hanging."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    begin = time.monotonic()
    worker.start()
    worker.join(within)
    assert not worker.is_alive(), f"still running after {within} s"
    assert time.monotonic() - begin < 2, "took more than 2 s to refuse"
    error = outcome[0]
    assert isinstance(error, RegistryError), repr(error)
    assert match in str(error), str(error)
    assert "\n" not in str(error)
    return error


@contextlib.contextmanager
def unix_socket(path: Path) -> Iterator[Path]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        yield path
    finally:
        server.close()


@contextlib.contextmanager
def mode(path: Path, bits: int) -> Iterator[Path]:
    old = stat.S_IMODE(path.stat().st_mode)
    os.chmod(path, bits)
    try:
        yield path
    finally:
        os.chmod(path, old)


def _release(fifo: Path) -> None:
    """Unblock a reader stuck opening ``fifo`` (only a regression gets there)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# ---------------------------------------------------------------- special files


def _null_device(path: Path) -> Path:
    """A character device like /dev/null at ``path``: a regression must replace this one, not the system's."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as exc:
        pytest.skip(f"cannot create a device node here: {exc.strerror}")
    return path


def test_device_is_refused_and_stays_a_device(tmp_path: Path) -> None:
    device = _null_device(tmp_path / "null")
    _refused(lambda: write_endpoint(device, NEW, fmt="py"), "is a character device")
    _refused(lambda: remove_endpoint(device, "qwen", fmt="py"), "is a character device")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "endpoints.py"
    os.mkfifo(fifo)
    try:
        _refused(lambda: write_endpoint(fifo, NEW), "FIFO")
        _refused(lambda: read_endpoints(fifo), "FIFO")
    finally:
        _release(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_socket_and_directory_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a short relative name: AF_UNIX paths are limited to about 100 bytes
    with unix_socket(Path("s.py")) as sock:
        _refused(lambda: write_endpoint(sock, NEW), "is a socket")
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    (tmp_path / "d.toml").mkdir()
    _refused(lambda: write_endpoint(tmp_path / "d.toml", NEW), "is a directory")
    assert (tmp_path / "d.toml").is_dir()


@pytest.mark.parametrize("path", ["/proc/x.py", "/proc/self/endpoints.yaml", "/sys/x.json"])
def test_pseudo_filesystem_paths_fail_at_once(path: str) -> None:
    error = _refused(lambda: write_endpoint(path, NEW), "kernel")
    assert "another process" not in str(error)


def test_pseudo_filesystems_are_recognised_wherever_mounted() -> None:
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo on this system")
    assert os.stat("/proc").st_dev in safety._pseudo_devices()


# ---------------------------------------------------------------- symlinks


def test_symlink_leaving_its_directory_is_refused_unless_followed(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "hostname.py"
    outside.write_text(PY)
    link = tmp_path / "mine" / "endpoints.py"
    link.symlink_to(outside)
    _refused(lambda: write_endpoint(link, NEW), "outside")
    assert outside.read_text() == PY
    # the explicit flag edits the regular file the link points to, and keeps the link
    write_endpoint(link, NEW, follow_symlink=True)
    assert link.is_symlink() and os.readlink(link) == str(outside)
    assert set(read_endpoints(outside)) == {"other", "qwen"}
    assert outside.read_text().startswith(PY[: -len("}\n")])


def test_followed_symlink_must_still_reach_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "elsewhere.fifo"
    os.mkfifo(fifo)
    (tmp_path / "mine").mkdir()
    to_device, to_fifo = tmp_path / "mine" / "null.py", tmp_path / "mine" / "fifo.py"
    to_device.symlink_to(_null_device(tmp_path / "null"))
    to_fifo.symlink_to(fifo)
    try:
        _refused(lambda: write_endpoint(to_device, NEW, follow_symlink=True), "character device")
        _refused(lambda: write_endpoint(to_fifo, NEW, follow_symlink=True), "FIFO")
    finally:
        _release(fifo)
    assert to_device.is_symlink() and stat.S_ISCHR(os.stat(to_device).st_mode)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---------------------------------------------------------------- writability and format


@pytest.mark.parametrize("fmt", ["py", "toml", "yaml", "json"])
def test_read_only_file_is_refused_even_for_root(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    write_endpoint(path, EndpointEntry("other", "m", "http://o:1/v1", "K"))
    before = path.read_bytes()
    with mode(path, 0o444):
        _refused(lambda: write_endpoint(path, NEW), "read-only")
        _refused(lambda: remove_endpoint(path, "other"), "read-only")
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert path.read_bytes() == before


def test_read_only_directory_is_refused_even_for_root(tmp_path: Path) -> None:
    directory = tmp_path / "configs"
    directory.mkdir()
    existing = directory / "endpoints.py"
    existing.write_text(PY)
    with mode(directory, 0o555):
        _refused(lambda: write_endpoint(directory / "new.py", NEW), "read-only")
        _refused(lambda: write_endpoint(existing, NEW), "read-only")
    assert sorted(p.name for p in directory.iterdir()) == ["endpoints.py"]
    assert existing.read_text() == PY


def test_format_must_agree_with_the_suffix_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints: {}\n")
    _refused(lambda: write_endpoint(path, NEW, fmt="py"), "does not match the suffix '.yaml'")
    assert path.read_text() == "endpoints: {}\n"
    write_endpoint(tmp_path / "endpoints.yml", NEW, fmt="yaml")  # agreeing names are fine
    forced = tmp_path / "forced.yaml"
    write_endpoint(forced, NEW, fmt="py", force_format=True)
    assert read_endpoints(forced, "py") == {"qwen": NEW}


# ---------------------------------------------------------------- a large endpoints.py


def _big_source(megabytes: float) -> str:
    lines = ["# a large registry\n", "ENDPOINTS = {\n"]
    size, index = 0, 0
    while size < megabytes * 1_000_000:
        line = (f'    "m-{index}": {{"model": "org/m-{index}", "url": "http://n{index:05d}:8000/v1", '
                f'"key": "K"}},  # entry {index}\n')
        lines.append(line)
        size, index = size + len(line), index + 1
    return "".join([*lines, "}\n", "\nOTHER = {'kept': [1, 2]}\n"])


# The child's own peak: VmHWM belongs to the process's memory map, which exec replaces. (ru_maxrss would carry
# the forking pytest process's high-water mark across exec: 209 MB measured in a full suite run.)
_CHILD = """
import re, sys, time
from pbs_toolkit.endpoints.registry import EndpointEntry, write_endpoint
start = time.monotonic()
write_endpoint(sys.argv[1], EndpointEntry("qwen", "Qwen/Qwen3-VL-2B-Instruct", "http://gpu01:8000/v1", "VLLM_KEY"))
hwm = re.search(r"^VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read(), re.M).group(1)
print(time.monotonic() - start, hwm)
"""


@pytest.mark.timeout(120)
def test_large_py_registry_is_edited_in_bounded_memory_and_keeps_every_other_byte(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    source = _big_source(4.0)
    path.write_text(source)
    # one upsert in a fresh interpreter, so that its peak RSS is the edit's own (libcst took 1.4 GB and 50 s)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(path)],  # noqa: S603 - argument list
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0, child.stderr
    seconds, peak_kb = child.stdout.split()
    assert int(peak_kb) < 200 * 1024, f"peak RSS {int(peak_kb) // 1024} MB"
    assert float(seconds) < 20, f"{float(seconds):.1f} s"
    added = (
        '    "qwen": {"model": "Qwen/Qwen3-VL-2B-Instruct", "url": "http://gpu01:8000/v1", "key": "VLLM_KEY"},\n'
    )
    closing = source.index("}\n\nOTHER")
    assert path.read_text() == source[:closing] + added + source[closing:]


def test_edits_across_parse_chunks_touch_only_their_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dict is parsed a chunk of elements at a time: replacing and removing entries on either side of the
    chunk boundaries changes exactly their bytes."""
    from pbs_toolkit.endpoints import py_locate

    monkeypatch.setattr(py_locate, "CHUNK_BYTES", 1000)  # about 10 entries a chunk

    def whole_file_parse(*args: object) -> None:
        raise AssertionError("fell back to the whole-file parse")

    monkeypatch.setattr(py_locate, "_slow", whole_file_parse)
    path = tmp_path / "endpoints.py"
    source = _big_source(0.01)
    path.write_text(source)
    expected = source
    for index in (0, 8, 9, 10, 11, 19, 20, 21, source.count("# entry ") - 1):
        old_value = f'{{"model": "org/m-{index}", "url": "http://n{index:05d}:8000/v1", "key": "K"}}'
        new_value = f'{{"model": "new/{index}", "url": "http://gpu02:1/v1", "key": "K2"}}'
        write_endpoint(path, EndpointEntry(f"m-{index}", f"new/{index}", "http://gpu02:1/v1", "K2"))
        expected = expected.replace(old_value, new_value)
        assert path.read_text() == expected
    assert remove_endpoint(path, "m-10") is True
    line = next(x for x in expected.splitlines(keepends=True) if x.startswith('    "m-10"'))
    assert path.read_text() == expected.replace(line, "")
    assert len(read_endpoints(path)) == source.count("# entry ") - 1


# ---------------------------------------------------------------- the CLI checks before it waits


def _one_error(result: object, code: int, message: str) -> None:
    exit_code, stderr = result.exit_code, result.stderr  # type: ignore[attr-defined]
    lines = stderr.strip().splitlines()
    assert exit_code == code, (exit_code, stderr)
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: ") and message in lines[0], lines


@pytest.mark.timeout(90)
def test_update_endpoint_refuses_unsafe_registries_before_waiting(
    fakepbs: Path, standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")  # a server that never gets ready
    job = launch().job_id
    (tmp_path / "mine").mkdir()
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "endpoints.py"
    outside.write_text(PY)
    link = tmp_path / "mine" / "endpoints.py"
    link.symlink_to(outside)
    read_only = tmp_path / "ro.py"
    read_only.write_text(PY)
    os.chmod(read_only, 0o444)
    locked_dir = tmp_path / "locked"
    locked_dir.mkdir(mode=0o555)
    os.chmod(locked_dir, 0o555)
    yaml_file = tmp_path / "endpoints.yaml"
    yaml_file.write_text("endpoints: {}\n")
    (tmp_path / "dir.py").mkdir()
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    monkeypatch.chdir(tmp_path)
    cases = []
    try:  # a device node of our own: a regression must replace this one, never the system's /dev/null
        os.mknod(tmp_path / "null.py", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        cases.append((["--registry", str(tmp_path / "null.py"), "--format", "py"], "character device"))
    except OSError:
        pass  # not root: the device case is covered by test_device_is_refused_and_stays_a_device's skip
    cases += [
        (["--registry", "/proc/x.py"], "kernel"),
        (["--registry", str(tmp_path / "dir.py")], "is a directory"),
        (["--registry", str(link)], "outside"),
        (["--registry", str(read_only)], "read-only"),
        (["--registry", str(locked_dir / "endpoints.py")], "read-only"),
        (["--registry", str(yaml_file), "--format", "py"], "does not match"),
        (["--registry", str(fifo)], "FIFO"),
    ]
    try:
        with unix_socket(Path("s.py")):
            cases.append((["--registry", "s.py"], "is a socket"))
            for args, message in cases:
                begin = time.monotonic()
                result = pbstk("update-endpoint", job, *args, "--timeout", "60")
                assert time.monotonic() - begin < 2, f"{args} waited for the server"
                _one_error(result, 8, message)
    finally:
        _release(fifo)
        os.chmod(locked_dir, 0o755)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    if (tmp_path / "null.py").exists():
        assert stat.S_ISCHR(os.lstat(tmp_path / "null.py").st_mode)
    assert outside.read_text() == PY and read_only.read_text() == PY and not os.listdir(locked_dir)
    assert yaml_file.read_text() == "endpoints: {}\n"
    # with the flags the pre-check passes, so the command waits for the (hung) server and times out
    for args in (["--registry", str(link), "--follow-symlink"],
                 ["--registry", str(yaml_file), "--format", "py", "--force-format"]):
        result = pbstk("update-endpoint", job, *args, "--timeout", "1")
        assert result.exit_code == 6 and "not ready after 1 s" in result.stderr, result.output
    assert outside.read_text() == PY and yaml_file.read_text() == "endpoints: {}\n"
