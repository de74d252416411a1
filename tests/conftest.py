"""Shared fixtures: an isolated user (XDG dirs, runs root), the fake PBS on PATH, stand-in executables,
the real sshd on loopback, a real Slurm cluster (tests/slurm_cluster.py).

Every test runs with its own XDG config/state/data directories and no PBSTK_* variables from the caller,
so a developer's ~/.config/pbstk never leaks in.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent

# A suite started as a script's background job (`bash .ci/run &`, a CI runner's wrapper) inherits SIGINT ignored
# (POSIX: a non-interactive shell's asynchronous commands ignore it), and so would every process the tests start:
# the Ctrl-C tests would then hang or prove nothing. Restored here, in pytest's process and in each xdist worker,
# before any test starts one.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
FAKEPBS_BIN = TESTS / "fakepbs" / "bin"
STANDINS = TESTS / "standins"
sys.path.insert(0, str(TESTS))

from slurm_cluster import slurm_cluster  # noqa: E402,F401  (session fixture: a real two-node Slurm on loopback)
from sshd import SshdInfo, sshd_server, start_sshd  # noqa: E402,F401  (sshd_server: fixture re-exported)

# --- parallel runs (pytest-xdist: scripts/test.sh runs -n N --dist loadgroup) ------------------------------------
#: node-id prefix -> a group of tests that run on one worker, one after the other: they share a costly session or
#: module fixture that would otherwise start once per worker (the Slurm cluster; the render matrix: ~100 renders,
#: bash -n and shellcheck). ``xdist_group`` marks cannot do this with pytest 9.2: xdist's loadgroup is silently
#: ignored there (pytest-dev/pytest-xdist#1386), so the scheduler below reads this table instead.
ONE_WORKER = {
    "tests/test_slurm_real.py::": "slurm",
    "tests/test_slurm_cluster.py::": "slurm",
    # the other users of the session's Slurm cluster: on the same worker, so one cluster starts per run
    "tests/test_service_router_job.py::test_router_job_on_a_real_slurm": "slurm",
    "tests/test_bench_status_calls.py::test_vec_inf_replay": "slurm",
    "tests/test_idle.py::test_idle_reclaim_on_a_real_slurm": "slurm",
    "tests/test_render.py::": "render",  # the whole module: more than the test_matrix_* tests read the matrix
}
#: tests that start first (real vLLM, minutes each): at the end of the queue they would be the tail of the run
FIRST = ("tests/test_e2e_vllm.py::",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: every test is a unit of its own except the groups of ``ONE_WORKER``; the groups
    (most tests first) then the ``FIRST`` tests are handed out first."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in ONE_WORKER.items() if nodeid.startswith(prefix)), nodeid)

    return Scheduler(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``FIRST`` tests first (a stable sort: every worker collects the same order, as xdist requires)."""
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


#: (nodeid, the failed attempt's error lines) of each test run again (``--reruns``): pytest-rerunfailures names them
#: at the end ("RERUN ...") but prints no traceback, so a flaky test on CI could not be read, only guessed at
_RERUNS: list[tuple[str, list[str]]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun" and report.longrepr is not None:
        lines = report.longreprtext.splitlines()
        errors = [line for line in lines if line.startswith("E ")][:12]
        _RERUNS.append((report.nodeid, [*errors, *lines[-1:]]))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Why each rerun test failed its first attempt(s): its ``E`` lines and where it failed."""
    if _RERUNS:
        terminalreporter.section("failed attempts of rerun tests")
        for nodeid, lines in _RERUNS:
            terminalreporter.write_line(f"{nodeid}:")
            for line in lines:
                terminalreporter.write_line(f"    {line[:300]}")


@pytest.fixture(scope="session", autouse=True)
def direct_python3(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``python3`` on PATH is this run's interpreter itself, first, and starts without the base interpreter's
    site-packages: the stand-ins and the fake PBS tools (``#!/usr/bin/env python3``) start thousands of times a
    run. A version manager's shim in front of the interpreter (pyenv's: a dozen bash processes a call) made each
    start cost 2.4x its CPU; the base interpreter's ``.pth`` files (a sandbox's certifi hook, setuptools'
    distutils hack) were 24 of its 37 ms of CPU (``python3 -c pass``, 20 starts). So: a venv of this run's
    own (``pyvenv.cfg`` beside a ``bin/python3`` link to the base interpreter), whose one ``.pth`` names the
    test venv's site-packages: the packages pbstk itself runs with (PyYAML for the stand-in vLLM's
    ``--config``), and their ``.pth`` files are not run. Nothing else on PATH moves."""
    real = Path(sys.base_prefix) / "bin" / "python3"
    if not real.exists():
        return
    root = tmp_path_factory.mktemp("python3-on-path")
    (root / "bin").mkdir()
    (root / "bin" / "python3").symlink_to(real)
    (root / "pyvenv.cfg").write_text(f"home = {real.parent}\ninclude-system-site-packages = false\n")
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (site / "test-venv.pth").write_text("".join(f"{path}\n" for path in own_site_packages()))
    os.environ["PATH"] = f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}"


def own_site_packages() -> list[str]:
    """This venv's own site-packages directories (not the base interpreter's)."""
    import site

    return [path for path in site.getsitepackages() if path.startswith(sys.prefix)]


@pytest.fixture(autouse=True)
def isolated_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for key in list(os.environ):
        if key.startswith(("PBSTK_", "FAKEPBS_")) or key in ("VLLM_API_KEY",):
            monkeypatch.delenv(key)
    home = tmp_path / "user"
    for sub in ("config", "state", "data", "runs"):
        (home / sub).mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("PBSTK_RUNS_ROOT", str(home / "runs"))
    monkeypatch.setenv("PBSTK_JIT_DIR", str(home / "jit"))  # start scripts' node-local JIT caches (not /tmp)
    # a home of the test's own: nothing under the real ~ (a profile's vllm_cache_root: ~/.cache/pbstk-vllm, which
    # a job's start script creates; vLLM's and matplotlib's own caches)
    (home / "home").mkdir()
    monkeypatch.setenv("HOME", str(home / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "home" / ".cache"))
    monkeypatch.setenv("PBSTK_POLL_INTERVALS", "0.3,0.5,1")
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "0")  # no background SSH holders unless a test asks (test_ssh_holder)
    monkeypatch.setenv("PBSTK_HUB_LOOKUP", "0")  # never the Hub from a test: test_auto_size serves one on loopback
    yield home
    _stop_local_jobs()


def _stop_local_jobs() -> None:
    """A test that failed before its own ``pbstk cancel`` must not leave a local job's server running: stop every
    local job still recorded as active in this test's store (the scheduler checks the job's token first)."""
    import contextlib

    from pbs_toolkit.jobs.launch import cancel
    from pbs_toolkit.jobs.store import JobStore

    with contextlib.suppress(Exception):
        for record in JobStore().all():
            if record.scheduler == "local" and not record.transport and not record.final_state:
                with contextlib.suppress(Exception):
                    cancel(record)


@pytest.fixture
def orphans() -> Iterator[list[int]]:
    """Process groups a test leaves running on purpose (a killed ``pbstk run``'s COMMAND, which nothing reaps):
    append each one's pgid; they are killed at the end."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def standins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Stand-in `vllm` and `nvidia-smi` first on PATH; returns the directory where `vllm` records its argv. The
    stand-in GPUs (tests/standins/gpus.py: 4 of 80 GB unless PBSTK_TEST_GPUS/PBSTK_TEST_GPU_MIB say otherwise) are
    this test's own: what its stand-in vLLMs hold, nvidia-smi shows, and a vLLM that finds too little free
    refuses to start, as a real one does."""
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("PATH", f"{STANDINS}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PBSTK_TEST_RECORD", str(record))
    monkeypatch.setenv("PBSTK_TEST_GPU_DIR", str(tmp_path / "gpus"))
    return record


@pytest.fixture
def fakepbs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The fake qsub/qstat/qdel first on PATH with a fresh server directory; deletes leftover jobs at the end."""
    import subprocess

    home = tmp_path / "fakepbs"
    home.mkdir()
    monkeypatch.setenv("FAKEPBS_HOME", str(home))
    monkeypatch.setenv("FAKEPBS_KILL_DELAY", "1")
    monkeypatch.setenv("FAKEPBS_EXITING_DELAY", "0.2")
    monkeypatch.setenv("PATH", f"{FAKEPBS_BIN}{os.pathsep}{os.environ['PATH']}")
    yield home
    jobs = home / "jobs"
    if jobs.is_dir():
        ids = [p.stem for p in jobs.glob("*.json")]
        if ids:
            subprocess.run([str(FAKEPBS_BIN / "qdel"), *ids], capture_output=True, check=False)  # noqa: S603


@pytest.fixture(scope="module")
def login_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdInfo]:
    """A login node (real sshd, one per test module) whose commands find the fake PBS and the stand-ins, with
    their own FAKEPBS_HOME; leftover jobs are deleted at the end. Modules that need another kind of login node
    (test_launch_ssh, test_ssh_transport, test_tunnel) define their own ``login_node``, which wins."""
    import subprocess

    name = request.module.__name__.removeprefix("test_")
    home = tmp_path_factory.mktemp(f"{name}-fakepbs")
    path = os.pathsep.join([str(FAKEPBS_BIN), str(STANDINS), os.environ["PATH"]])
    env = {"PATH": path, "FAKEPBS_HOME": str(home), "FAKEPBS_KILL_DELAY": "1", "FAKEPBS_EXITING_DELAY": "0.2"}
    with start_sshd(tmp_path_factory.mktemp(f"{name}-login"), env) as info:
        yield info
    jobs = [p.stem for p in (home / "jobs").glob("*.json")] if (home / "jobs").is_dir() else []
    if jobs:
        subprocess.run([str(FAKEPBS_BIN / "qdel"), *jobs], env={**os.environ, **env}, capture_output=True, check=False)  # noqa: S603


def read_calls(home: Path, tool: str) -> list[list[str]]:
    """argv of every call of ``tool`` that the fake PBS logged."""
    import json

    path = home / "calls.log"
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [c["argv"] for c in calls if c["tool"] == tool]
