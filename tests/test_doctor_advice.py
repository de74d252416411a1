"""``doctor``'s advice: no "remove --enforce-eager" where eager is by design or pbstk's own fallback, no "server
failed" for a READY job, and a recommended command that keeps the launch's options and never repeats what runs.

Jobs run under the fake PBS with the stand-in vLLM.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.perf.doctor import DoctorContext, diagnose

EAGER_RESTART = "pbstk: vLLM failed before it was ready with a graph/compile error (exit 1); restarting once with " \
                "--enforce-eager"
COMPILE_FAILED = "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: injected failure"


def _codes(ctx: DoctorContext) -> dict[str, str]:
    return {f.code: f"{f.severity} {f.title} {f.fix}" for f in diagnose(ctx)}


def test_cpu_preset_is_eager_by_design() -> None:
    assert "eager-mode" in _codes(DoctorContext(vllm_args=["--enforce-eager"], vllm_version="0.22.1"))
    assert _codes(DoctorContext(vllm_args=["--enforce-eager"], vllm_version="0.22.1", device="cpu")) == {}


def test_eager_fallback_is_named_with_its_cause_not_as_a_flag_to_remove() -> None:
    log = ["INFO starting", COMPILE_FAILED, EAGER_RESTART, "pbstk: attempt 2: starting vLLM on n:8000: vllm serve",
           "WARNING [cuda.py:1] Cudagraph is disabled under eager mode"]
    found = {f.code: f for f in diagnose(DoctorContext(vllm_args=["--enforce-eager"], log_lines=log,
                                                       eager_fallback=True, state=ServerState.READY))}
    assert set(found) == {"eager-fallback"}
    assert COMPILE_FAILED in found["eager-fallback"].evidence
    assert "Remove --enforce-eager" not in found["eager-fallback"].fix


def test_ready_job_has_no_server_failed_finding() -> None:
    log = [COMPILE_FAILED, "RuntimeError: Engine core initialization failed. See root cause above."]
    assert "server-failed" in _codes(DoctorContext(log_lines=log, state=ServerState.FAILED))
    assert "server-failed" not in _codes(DoctorContext(log_lines=log, state=ServerState.READY))


def _doctor(job: str) -> dict[str, object]:
    result = pbstk("doctor", job, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def _launch(*args: str) -> str:
    result = pbstk("launch", MODEL, "--profile", "generic-pbspro", "--port", "auto", "--wait", *args)
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()[0].split()[1]


def test_recommended_command_keeps_the_launch_options(fakepbs: Path, standins: Path) -> None:
    job = _launch("--preset", "tp2", "--account", "proj-x", "--queue", "workq", "--walltime", "00:30:00",
                  "--vllm-arg=--max-model-len=4096", "--env", "MY_SETTING=1", "--name", "doc")
    d = _doctor(job)
    assert d["recommended_preset"] == "dp2", d
    argv = shlex.split(str(d["launch"]))
    assert argv[:5] == ["pbstk", "launch", MODEL, "--preset", "dp2"]
    for option in (["--account", "proj-x"], ["--queue", "workq"], ["--walltime", "00:30:00"],
                   ["--env", "MY_SETTING=1"], ["--name", "doc"], ["--profile", "generic-pbspro"]):
        assert any(argv[i:i + 2] == option for i in range(len(argv))), (option, argv)
    assert "--vllm-arg=--max-model-len=4096" in argv
    pbstk("cancel", job)
    # what doctor recommends, launched: no advice to launch it again
    rerun = pbstk(*argv[1:5], "--profile", "generic-pbspro", "--port", "auto", "--wait", "--account", "proj-x",
                  "--name", "doc2")
    assert rerun.exit_code == 0, rerun.output
    again = rerun.stdout.splitlines()[0].split()[1]
    d2 = _doctor(again)
    assert d2["recommended_preset"] is None and d2["launch"] is None, d2
    pbstk("cancel", again)


def test_eager_fallback_job_is_not_told_to_remove_eager(fakepbs: Path, standins: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "compile-fail-once")
    job = _launch("--preset", "dp2", "--name", "fellback")
    d = _doctor(job)
    assert d["state"] == "READY"
    codes = {f["code"]: f for f in d["findings"]}  # type: ignore[attr-defined]
    assert "server-failed" not in codes and "eager-mode" not in codes, codes
    assert "BackendCompilerFailed" in codes["eager-fallback"]["evidence"]
    assert d["launch"] is None, d  # dp2 is what auto picks for a 2B model: nothing to relaunch
    text = pbstk("doctor", job).stdout
    assert "[high] The server failed" not in text and "Remove --enforce-eager" not in text, text
    pbstk("cancel", job)


def test_a_kv_cache_too_small_for_one_request_is_named_with_its_fix() -> None:
    """vLLM 0.22.1's log of a model whose KV cache cannot hold one request of its max length: doctor names the
    engine core's ValueError (not the API server's "See root cause above") and says which flags to change.
    Before: the finding quoted the wrapper and said "Read the log around this line"."""
    log = (Path(__file__).parent / "data" / "observe" / "startup-0.22.1-kv-short.log").read_text().splitlines()
    found = {f.code: f for f in diagnose(DoctorContext(log_lines=log, state=ServerState.FAILED))}
    failed = found["server-failed"]
    assert failed.evidence.startswith("log: ValueError: To serve at least one request with the model's max seq len "
                                      "(40960)"), failed.evidence
    assert "raise --gpu-memory-utilization or lower --max-model-len" in failed.fix, failed.fix
