"""``pbstk wait``: readiness from /health and /v1/models, progress lines, and failing fast with the cause.

Jobs run for real under the fake PBS with the stand-in vLLM (``tests/standins/vllm``). "Fast" is measured:
the command must exit within ``FAIL_FAST_S`` of the event (qdel, a killed server, walltime).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launch, marker, until
from helpers import pbstk_raising as pbstk
from sshd import SshdInfo

from pbs_toolkit.jobs.store import JobRecord, JobStore

FAIL_FAST_S = 8.0


def started(record: JobRecord) -> dict[str, Any]:
    """The marker once the stand-in runs (phase starting, pid set)."""
    return until(lambda: (m := marker(record)).get("phase") == "starting" and m.get("pid") and m,
                 what="the server process to start")


def wait_cli(*args: str) -> subprocess.Popen[str]:
    """``pbstk wait`` as a real process, so the test can act while it waits and time its exit."""
    return subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit.cli.main", "wait", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str, str, float]:
    """(rc, stdout, stderr, monotonic time of exit)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.monotonic()


@pytest.fixture
def mode(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def set_mode(name: str, delay: float | None = None) -> None:
        monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", name)
        if delay is not None:
            monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", str(delay))

    return set_mode


def test_progress_lines_then_ready(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch,
                                   mode: Callable[..., None]) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "1.2")
    mode("ok", delay=1.0)
    record = launch()
    result = pbstk("wait", record.job_id, "--timeout", "30")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    # queued: the scheduler's state and comment; then the startup phase; then ready, each with elapsed s
    assert any("PENDING" in x and "(PBS Q) Not Running: Not enough free nodes available" in x for x in lines), lines
    assert any("STARTING" in x for x in lines), lines
    assert lines[-1].split("]", 1)[1].split() == ["READY", "ready"]
    assert all(x.startswith("[") and "s]" in x for x in lines)
    m = marker(record)
    assert result.stdout == f"{record.job_id} ready: http://{m['address']}:{m['port']}/v1 (model {MODEL})\n"
    assert "0.0.0.0" not in result.stdout


def test_json_is_quiet(fakepbs: Path, standins: Path) -> None:
    record = launch()
    result = pbstk("wait", "--json", "--timeout", "30")  # no JOB: the newest
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["job_id"] == record.job_id and data["state"] == "READY"
    assert data["url"] == f"http://{data['address']}:{data['port']}/v1"
    assert JobStore().find(record.job_id).extra["ready_after_s"] >= 0


def _assert_fast_failure(rc: int, err: str, event: float, exited: float, state: str) -> None:
    assert rc == 5, err
    assert exited - event < FAIL_FAST_S, f"exited {exited - event:.1f} s after the event"
    first = err.splitlines()
    errors = [x for x in first if x.startswith("pbstk: error:")]
    assert errors and f"is {state}" in errors[0], err
    assert any(x.startswith("  | ") for x in first), "the last log lines are shown"


def test_qdel_during_startup_fails_fast(fakepbs: Path, standins: Path, mode: Callable[..., None]) -> None:
    mode("hang")
    record = launch()
    started(record)
    proc = wait_cli(record.job_id, "--timeout", "60")
    time.sleep(1.0)  # let it settle into the STARTING loop
    event = time.monotonic()
    assert pbstk("cancel", record.job_id).exit_code == 0
    rc, _, err, exited = finish(proc)
    _assert_fast_failure(rc, err, event, exited, "CANCELLED")
    assert "Starting to load model" in err or "Compiling a graph" in err  # the log's last lines
    assert JobStore().find(record.job_id).final_state == "CANCELLED"


def test_server_process_dies_during_startup(fakepbs: Path, standins: Path, mode: Callable[..., None]) -> None:
    mode("hang")
    record = launch()
    pid = int(started(record)["pid"])
    proc = wait_cli(record.job_id, "--timeout", "60")
    time.sleep(1.0)
    event = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    rc, _, err, exited = finish(proc)
    _assert_fast_failure(rc, err, event, exited, "FAILED")


def test_fatal_log_line(fakepbs: Path, standins: Path, mode: Callable[..., None]) -> None:
    mode("fatal")
    record = launch()
    begin = time.monotonic()
    proc = wait_cli(record.job_id, "--timeout", "60")
    rc, _, err, exited = finish(proc)
    _assert_fast_failure(rc, err, begin, exited, "FAILED")
    assert "CUDA out of memory" in err


def test_walltime_during_startup(fakepbs: Path, standins: Path, mode: Callable[..., None]) -> None:
    mode("hang")
    begin = time.monotonic()
    record = launch("--walltime", "00:00:03")
    proc = wait_cli(record.job_id, "--timeout", "60")
    rc, _, err, exited = finish(proc)
    event = begin + 3.0  # the walltime ends at the latest 3 s after qsub
    _assert_fast_failure(rc, err, event, exited, "FAILED")
    assert "walltime exceeded" in err


def test_timeout_exits_6(fakepbs: Path, standins: Path, mode: Callable[..., None]) -> None:
    mode("hang")
    record = launch()
    begin = time.monotonic()
    result = pbstk("wait", record.job_id, "--timeout", "1.5")
    took = time.monotonic() - begin
    assert result.exit_code == 6, result.output
    assert f"job {record.job_id} was not ready after 1.5 s (state STARTING" in result.stderr
    assert 1.5 <= took < 5


def test_wrong_key_is_a_clear_401(fakepbs: Path, standins: Path) -> None:
    record = launch()
    assert pbstk("wait", record.job_id, "--timeout", "30").exit_code == 0
    record.api_key = "not-the-key"
    JobStore().remove(record)  # add never replaces a record
    JobStore().add(record)
    result = pbstk("wait", record.job_id, "--timeout", "30")
    assert result.exit_code == 5, result.output
    assert "rejected the API key (401)" in result.stderr


def test_api_key_never_exposed(fakepbs: Path, standins: Path) -> None:
    record = launch()
    assert pbstk("wait", record.job_id, "--timeout", "30").exit_code == 0
    key = record.api_key
    assert key
    pid = int(marker(record)["pid"])
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        assert b"standins/vllm" in fh.read()  # it is the stand-in
    for proc_dir in Path("/proc").iterdir():  # no process on the machine has the key in its argv
        try:
            assert key.encode() not in (proc_dir / "cmdline").read_bytes(), proc_dir
        except (OSError, ValueError):
            continue
    run_dir = Path(record.run_dir)
    for name in ("vllm.log", "pbs.out", "pbs.err", "job.pbs", "start_vllm.sh", "server.json", "render.json"):
        assert key not in (run_dir / name).read_text(), name
    assert (run_dir / "api_key").stat().st_mode & 0o777 == 0o600
    m = marker(record)
    url = f"http://{m['address']}:{m['port']}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)  # noqa: S310 - loopback test server
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310
        assert json.loads(answer.read())["data"][0]["id"] == MODEL


# -- over SSH: the probe goes through the SSH connection ------------------------------------------------


@pytest.mark.ssh
def test_wait_over_ssh_probes_through_the_connection(login_node: SshdInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs_toolkit.jobs.readiness import wait_until_ready
    from pbs_toolkit.transports.ssh import SSHRunner

    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    record = launch("--ssh", login_node.alias)
    assert record.transport == login_node.alias

    class CountingRunner(SSHRunner):
        """The real SSH runner, counting the direct-tcpip channels it opens."""

        channels: list[tuple[str, int]] = []

        def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
            channel = super().open_connection(host, port, timeout)
            self.channels.append((host, port))
            return channel

    runner = CountingRunner(login_node.alias)
    with runner:
        st = wait_until_ready(record, timeout=30, runner=runner, poll=0.2)
        assert st.state.value == "READY"
        assert runner.connections_opened == 1
        # /health and /v1/models went through direct-tcpip channels of the one SSH connection
        assert len(runner.channels) >= 2 and set(runner.channels) == {(st.address, st.port)}
    result = pbstk("wait", "--json", "--timeout", "30")  # and the CLI over SSH
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["transport"] == login_node.alias
    assert pbstk("cancel", record.job_id).exit_code == 0
