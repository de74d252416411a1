"""launch -> status -> cancel through a real sshd on loopback playing the login node.

Each test starts its own sshd, because what the "login node" offers (the fake PBS on PATH, FAKEPBS_HOME, the
stand-in's mode) reaches its commands only through the ``environment=`` options sshd reads at login.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import helpers
import pytest
from click.testing import Result
from conftest import read_calls
from helpers import MODEL, launched_id, pbstk, status_of
from sshd import SshdInfo, start_sshd

from pbs_toolkit.jobs.store import JobRecord, JobStore

pytestmark = pytest.mark.ssh

PBS = ["--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto"]
LOCAL = ["--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto"]
StartLogin = Callable[..., SshdInfo]
wait_for = partial(helpers.wait_for, interval=0.2)  # the poll interval these tests have always used
wait_recorded = partial(helpers.wait_recorded, interval=0.2)


@pytest.fixture
def login_node(fakepbs: Path, standins: Path, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[StartLogin]:
    """``start(**env)``: an sshd whose sessions see PATH (fake PBS + stand-ins), FAKEPBS_* and PBSTK_TEST_*
    as set in this test now, plus ``env``; the client side (PBSTK_SSH_CONFIG/KNOWN_HOSTS) points at it."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with ExitStack() as stack:
        count = 0

        def start(**env: str) -> SshdInfo:
            nonlocal count
            count += 1
            passed = {k: v for k, v in os.environ.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))}
            info = stack.enter_context(start_sshd(tmp_path / f"login{count}", {**passed, **env}))
            monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
            monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
            return info

        yield start


def launch(name: str, *extra: str, host: str = "pbstk-test") -> Result:
    return pbstk("launch", MODEL, "--ssh", host, "--name", name, *extra)


def logins(info: SshdInfo) -> int:
    return info.log.read_text(errors="replace").count("Accepted publickey")


# -- end to end -------------------------------------------------------------------------------------


def test_pbs_over_ssh_launch_wait_status_cancel(login_node: StartLogin, fakepbs: Path) -> None:
    info = login_node()
    result = launch("remote", *PBS, "--wait", "--timeout", "30")
    job = launched_id(result)
    assert "ready: http://" in result.stdout
    record = JobStore().find(job)
    assert record.transport == "pbstk-test" and record.scheduler == "pbs"
    assert read_calls(fakepbs, "qsub")  # it went through the login node's qsub

    before = logins(info)
    st = status_of(job)  # /health through a direct-tcpip channel of the same connection
    assert st["state"] == "READY" and st["transport"] == "pbstk-test"
    assert logins(info) - before == 1

    assert pbstk("cancel", job).stdout.strip() == f"{job}: cancelled"
    st = wait_recorded(job, "CANCELLED")
    assert st["scheduler_state"] == "F"


def test_one_connection_and_one_qstat_per_status(login_node: StartLogin, fakepbs: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    info = login_node()
    jobs = [launched_id(launch(f"batch{i}", *PBS)) for i in range(3)]
    calls, before = len(read_calls(fakepbs, "qstat")), logins(info)
    result = pbstk("status", "--json")
    assert result.exit_code == 0, result.output
    assert [s["state"] for s in json.loads(result.stdout)] == ["PENDING"] * 3
    assert logins(info) - before == 1
    assert read_calls(fakepbs, "qstat")[calls:] == [["-x", "-f", "-F", "json", *reversed(jobs)]]

    before = logins(info)  # a second job of an active name is refused, over the launch's own connection
    result = launch("batch1", *PBS)
    assert result.exit_code == 2 and "already active" in result.stderr
    assert logins(info) - before == 1


def test_failures_over_ssh_read_the_remote_log(login_node: StartLogin, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")
    login_node()
    job = launched_id(launch("oom", *PBS))
    st = wait_recorded(job, "FAILED")
    assert "CUDA out of memory" in st["reason"]
    assert any("Engine core initialization failed" in line for line in st["log_excerpt"])


def test_local_scheduler_over_ssh_outlives_the_channel(login_node: StartLogin) -> None:
    login_node()
    job = launched_id(launch("viassh", *LOCAL, "--wait", "--timeout", "30"))
    assert job.endswith(".local")
    record = JobStore().find(job)
    server_pid = json.loads(Path(record.run_dir, "server.json").read_text())["pid"]
    st = status_of(job)  # new connection: the job was not tied to the launching one
    assert st["state"] == "READY"
    assert pbstk("cancel", job).stdout.strip() == f"{job}: cancelled"
    wait_for(lambda: not Path(f"/proc/{server_pid}").exists(), 10, "the server process to be gone")
    wait_recorded(job, "CANCELLED")


# -- bad input: one clear line, exit 4 (or 3), nothing lost from the job store ----------------------


@pytest.fixture
def kept_record() -> JobRecord:
    record = JobRecord(job_id="41.pbs01", scheduler="pbs", profile="generic-pbspro", model="org/m",
                       served_model_name="org/m", preset="dp4", name="kept", run_dir="/runs/kept",
                       transport="elsewhere", api_key="k", final_state="FINISHED")
    JobStore().add(record)
    return record


def _store() -> list[dict[str, Any]]:
    return [r.public() for r in JobStore().all()]


def _fails_cleanly(result: Result, code: int, *texts: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.stderr
    for text in texts:
        assert text in lines[0], lines[0]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_host(kept_record: JobRecord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(f"Host deadhost\n    HostName 127.0.0.1\n    Port {_closed_port()}\n")
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(config))
    before = _store()
    _fails_cleanly(launch("nowhere", *PBS, host="deadhost"), 4, "cannot reach 127.0.0.1:", "connection refused")
    assert _store() == before


def test_unknown_host_key(kept_record: JobRecord, login_node: StartLogin, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    login_node()
    known = tmp_path / "empty_known_hosts"
    known.write_text("")
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(known))
    before = _store()
    _fails_cleanly(launch("stranger", *PBS), 4, "not known", "--accept-new-host-key")
    assert _store() == before
    assert known.read_text() == ""  # refused keys are not written

    job = launched_id(launch("stranger", *PBS, "--accept-new-host-key"))
    assert "[127.0.0.1]:" in known.read_text()
    assert pbstk("cancel", job).exit_code == 0  # the key is known now: no flag needed


def test_wrong_key(kept_record: JobRecord, login_node: StartLogin, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    info = login_node()
    wrong = tmp_path / "wrong_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)],  # noqa: S603,S607
                   check=True, capture_output=True)
    config = tmp_path / "wrong_config"
    config.write_text(info.ssh_config.read_text().replace(str(info.user_key), str(wrong)))
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(config))
    before = _store()
    _fails_cleanly(launch("intruder", *PBS), 4, "authentication to pbstk-test failed", str(wrong))
    assert _store() == before


def test_qsub_missing_on_the_login_node(kept_record: JobRecord, login_node: StartLogin, tmp_path: Path) -> None:
    login_node(PATH=helpers.path_without(tmp_path / "bin", "qsub", "qstat", "qdel"))  # stand-ins kept, no PBS
    before = _store()
    _fails_cleanly(launch("nosub", *PBS), 3, "qsub not found on PATH on pbstk-test")
    assert _store() == before
    runs = Path(os.environ["PBSTK_RUNS_ROOT"])
    assert not [p for p in runs.iterdir() if p.name.startswith("nosub-")]  # removed over SSH too
