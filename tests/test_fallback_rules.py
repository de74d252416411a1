"""The eager-fallback trigger, checked on real vLLM logs (tests/data/vllm-cpu, recorded from vLLM 0.32 CPU).

The start script greps with the same expression (POSIX ERE) that Python uses in ``wait``; both must agree,
and only a graph/compile failure may trigger the restart (not OOM, a missing model, a taken port, ...).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pbs_toolkit.vllm.startup import COMPILE_ERROR_RE, PORT_IN_USE_RE, is_compile_failure

LOGS = sorted((Path(__file__).parent / "data" / "vllm-cpu").glob("*.log"))
COMPILE_FAILURES = {"fatal-compile-no-cxx.log"}
PORT_FAILURES = {"fatal-port-in-use.log"}


def grep(pattern: str, path: Path) -> bool:
    return subprocess.run(["grep", "-Eq", pattern, str(path)], check=False).returncode == 0  # noqa: S603,S607


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.name)
def test_only_compile_failures_trigger_the_eager_restart(log: Path) -> None:
    expected = log.name in COMPILE_FAILURES
    assert is_compile_failure(log.read_text().splitlines()) is expected
    assert grep(COMPILE_ERROR_RE, log) is expected


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.name)
def test_port_race_is_recognised(log: Path) -> None:
    assert grep(PORT_IN_USE_RE, log) is (log.name in PORT_FAILURES)


def test_torch_messages_seen_on_gpus_match() -> None:
    for line in (
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
        "RuntimeError: CUDA error: operation not permitted when stream is capturing",
        "torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ compiler found",
    ):
        assert is_compile_failure([line]), line
    for line in ("torch.OutOfMemoryError: CUDA out of memory.", "RuntimeError: Engine core initialization failed."):
        assert not is_compile_failure([line]), line


@pytest.mark.parametrize(("eager", "expected"), [(False, True), (True, False)])
def test_wait_expects_the_eager_restart_only_when_one_will_come(eager: bool, expected: bool) -> None:
    from pbs_toolkit.jobs.spec import LaunchSpec
    from pbs_toolkit.jobs.status import ServerState, combine
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.schedulers import SchedState, SchedulerJob

    record = JobRecord(job_id="1.local", scheduler="local", profile="local", model="m", served_model_name="m",
                       preset="cpu", name="m", run_dir="/nonexistent", spec=LaunchSpec(eager=eager))
    lines = (Path(__file__).parent / "data" / "vllm-cpu" / "fatal-compile-no-cxx.log").read_text().splitlines()
    marker = {"phase": "starting", "port": 8000, "address": "127.0.0.1", "attempt": 1, "eager_fallback": False}
    st = combine(record, SchedulerJob("1.local", SchedState.RUNNING, "R"), marker, lines, None)
    assert st.state is ServerState.FAILED and not st.confirmed
    assert st.restart_expected is expected
