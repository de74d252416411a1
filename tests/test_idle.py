"""Idle reclaim (``--idle-cancel``, docs/idle.md): the job watches its own ``/metrics`` and stops its server once
nothing has run, waited or finished for the duration; ``status`` reports FINISHED ``ended idle`` (JSON ``ended:
"idle"``) and the job's registry entry goes with it. Real bash, the stand-in vLLM (which reports running and
waiting requests and the success counter like vLLM), the local scheduler and the fake PBS."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk, status_of, wait_recorded
from test_slurm_real import cli as slurm_cli  # noqa: F401 - a fixture: pbstk with the cluster's environment

from pbs_toolkit.durations import parse
from pbs_toolkit.endpoints.registry import read_endpoints
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.idle import idle_seconds
from pbs_toolkit.jobs.store import JobStore

LOCAL = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto"]


def _post(st: dict[str, object], key: str | None, delay: float = 0.0) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "standin_delay_s": delay}).encode()
    request = urllib.request.Request(f"{st['url']}/completions", data=body,  # noqa: S310 - loopback
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
        assert answer.status == 200


def _launch(*args: str) -> str:
    result = pbstk(*args)
    assert result.exit_code == 0, result.output
    return result.stdout.split()[1]


def _idle_run(job: str, registry: Path) -> None:
    """READY, registered, kept busy past the idle time by requests, then left alone: it must end idle."""
    result = pbstk("wait", job, "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert pbstk("update-endpoint", job, "--registry", str(registry), "--timeout", "30").exit_code == 0
    assert read_endpoints(registry), "nothing registered"
    st = status_of(job)
    key = JobStore().find(job).api_key
    started = time.monotonic()
    _post(st, key, delay=3.0)  # running for longer than the idle time: not idle
    for _ in range(2):  # a new request every second: not idle either
        _post(st, key)
        time.sleep(1.0)
    log = Path(JobStore().find(job).run_dir, "vllm.log")
    assert "ended idle" not in log.read_text(), "stopped while requests came in"
    st = wait_recorded(job, "FINISHED", timeout=40)
    assert time.monotonic() - started > 5.0
    assert st["ended"] == "idle" and st["reason"].startswith("ended idle after 2s"), st
    assert st["exit_status"] == 0
    assert read_endpoints(registry) == {}, "the registry entry stayed"
    assert "ended idle: no request for 2s" in log.read_text()
    assert Path(JobStore().find(job).run_dir, "ended_idle").is_file()


def test_idle_reclaim_on_the_local_scheduler(standins: Path, tmp_path: Path) -> None:
    job = _launch(*LOCAL, "--name", "idle", "--idle-cancel", "2s")
    _idle_run(job, tmp_path / "endpoints.json")
    assert "idle reclaim: vLLM is stopped after 2s without a request" in Path(
        JobStore().find(job).run_dir, "vllm.log").read_text()


def test_idle_reclaim_under_the_fake_pbs_from_the_profile(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    # the default comes from config.yaml (a profile key like any other), not from a flag
    config = Path(tmp_path / "user" / "config" / "pbstk")
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.yaml").write_text("idle_cancel: 2s\n")
    job = _launch("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto")
    _idle_run(job, tmp_path / "endpoints.json")


def test_without_idle_cancel_a_server_keeps_running(standins: Path, tmp_path: Path) -> None:
    job = _launch(*LOCAL, "--name", "busy", "--idle-cancel", "off")
    assert pbstk("wait", job, "--timeout", "30").exit_code == 0
    run_dir = JobStore().find(job).run_dir
    assert "IDLE_CANCEL_S=0\n" in Path(run_dir, "start_vllm.sh").read_text()
    assert "idle reclaim" not in Path(run_dir, "vllm.log").read_text()  # no watcher was started
    assert status_of(job)["state"] == "READY"
    assert pbstk("cancel", job).exit_code == 0
    assert wait_recorded(job, "CANCELLED")["ended"] is None


@pytest.mark.parametrize("text", ["5x", "-3m", "nan", "1e400s", "0"])
def test_a_bad_duration_is_one_error_line(standins: Path, text: str) -> None:
    result = pbstk(*LOCAL, "--idle-cancel", text)
    if text == "0":  # 0 is off
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert result.output.count("pbstk: error:") == 1 and "idle" in result.output and "Traceback" not in result.output
    assert JobStore().all() == []


def test_durations_and_the_log_line() -> None:
    assert parse("30m", "x") == 1800 and parse("90", "x") == 90 and parse("1.5h", "x") == 5400
    assert parse("off", "x", off=True) == 0
    with pytest.raises(UsageError):
        parse("off", "x")
    assert idle_seconds(["pbstk: 10:00:00 ended idle: no request for 1800s; stopping vLLM (pid 7)"]) == 1800
    assert idle_seconds(["vllm: ended idle: no request for 1800s"]) is None


# -- a real Slurm (tests/slurm_cluster.py; in conftest's ONE_WORKER "slurm" group) --------------------------------


def test_idle_reclaim_on_a_real_slurm(slurm_cluster: Any, slurm_cli: Any, tmp_path: Path) -> None:  # noqa: F811
    import yaml

    cli = slurm_cli

    profile = tmp_path / "slurm-idle.yaml"
    profile.write_text(yaml.safe_dump({
        "scheduler": "slurm", "slurm": {"queue": slurm_cluster.partition}, "nodes": 1,
        "gpus_per_node": slurm_cluster.gpus_per_node, "cpus_per_node": 1, "walltime": "00:10:00",
        "address": "loopback", "bind_host": "127.0.0.1", "vllm_version": "0.11.0", "idle_cancel": "3s"}))
    result = cli("launch", MODEL, "--profile", str(profile), "--preset", "single", "--port", "auto", "--wait",
                 "--timeout", "90")
    assert result.returncode == 0, result.stdout + result.stderr
    job = result.stdout.splitlines()[0].split()[1]
    registry = tmp_path / "endpoints.json"
    assert cli("update-endpoint", job, "--registry", str(registry)).returncode == 0
    assert read_endpoints(registry)
    deadline = time.monotonic() + 60
    while True:
        st = json.loads(cli("status", job, "--json").stdout)[0]
        if st["state"] != "READY" or time.monotonic() > deadline:
            break
        time.sleep(1)
    if st["state"] != "FINISHED":  # the scheduler may say COMPLETING for a moment
        time.sleep(3)
        st = json.loads(cli("status", job, "--json").stdout)[0]
    assert st["state"] == "FINISHED" and st["ended"] == "idle", st
    assert st["reason"] == "ended idle after 3s without a request", st
    assert st["scheduler_state"] == "COMPLETED", st
    assert read_endpoints(registry) == {}
