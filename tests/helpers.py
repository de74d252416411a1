"""Plain helpers shared by the end-to-end test modules: pollers, the ``pbstk`` CLI through click's runner, and
the job queries built on it. Import them by name (``from helpers import until``): tests/ is on ``sys.path``."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from pbs_toolkit.cli.main import cli
from pbs_toolkit.jobs.store import JobRecord, JobStore

MODEL = "Qwen/Qwen3-VL-2B-Instruct"

# -- polling ---------------------------------------------------------------------------------------------------


def until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """``predicate()`` every 0.05 s until it is truthy (returned) or ``timeout`` has passed (AssertionError);
    it is not called again once the deadline has passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition", *,
             interval: float = 0.15) -> Any:
    """``check()`` every ``interval`` s until it is truthy (returned); after ``timeout`` the last check made
    past the deadline decides, then AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# -- PATH ------------------------------------------------------------------------------------------------------


def path_without(directory: Path, *missing: str) -> str:
    """A PATH of one new ``directory`` holding a symlink to every program the current PATH finds, except the
    ``missing`` names: the tools a job needs stay, and ``missing`` is absent whatever the host has installed (a
    Slurm host ships its own ``/usr/bin/qsub``, so ``/usr/bin:/bin`` proves nothing)."""
    directory.mkdir(parents=True)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry):
            continue
        for program in sorted(os.listdir(entry)):
            link = directory / program
            target = Path(entry, program)
            if program in missing or os.path.lexists(link) or not (target.is_file() and os.access(target, os.X_OK)):
                continue  # an earlier PATH entry wins, as it does in a shell
            link.symlink_to(target)
    for name in missing:
        assert not (directory / name).exists(), name
    return str(directory)


# -- tune results ----------------------------------------------------------------------------------------------


def _measured(run: dict[str, Any], concurrency: int) -> float | None:
    values = [r["output_throughput"] for r in run.get("results") or []
              if r["concurrency"] == concurrency and r.get("completed")]
    return float(values[0]) if values else None


def check_tune_report(doc: dict[str, Any], stdout: str) -> None:
    """What ``tune`` printed agrees with the results it saved (``doc``), recomputed here rather than through
    ``pbs_toolkit.tune``: the recommendation is the preset with the best output tokens/s at the highest
    concurrency, and every row's tokens/s and ratio-to-baseline cells are that run's measurements."""
    top = max(doc["concurrencies"])
    measured = {run["preset"]: v for run in doc["runs"] if (v := _measured(run, top)) is not None}
    assert measured, doc
    best = max(measured, key=measured.__getitem__)
    assert doc["recommended"] == best, (doc["recommended"], measured)
    assert f"recommended: {best} (highest output tokens/s at c={top})" in stdout.splitlines(), stdout
    baseline = next(run for run in doc["runs"] if run["preset"] == doc["baseline"])
    rows = {cells[0]: cells for cells in (line.split() for line in stdout.splitlines()) if cells}
    for run in doc["runs"]:
        if any(_measured(run, c) is None for c in doc["concurrencies"]):
            continue  # a failed run's row says so; its cells are not measurements
        expected = []
        for c in doc["concurrencies"]:
            value, base = _measured(run, c), _measured(baseline, c)
            assert value is not None
            expected += [f"{value:.1f}", f"{value / base:.2f}" if base else "-"]
        assert rows[run["preset"]][-1 - len(expected):-1] == expected, (run["preset"], stdout)


# -- the CLI ---------------------------------------------------------------------------------------------------


def pbstk(*args: str) -> Result:
    """``pbstk ARGS`` in this process; an exception becomes ``result.exception`` (exit code 1)."""
    return CliRunner().invoke(cli, list(args))


def pbstk_raising(*args: str) -> Result:
    """``pbstk ARGS`` in this process; an exception propagates into the test."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def launch(*extra: str) -> JobRecord:
    """Launch MODEL (dp4, generic PBS Pro, port auto, plus ``extra``); the new job's record."""
    result = pbstk_raising("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                           *extra)
    assert result.exit_code == 0, result.output
    return JobStore().find(None)


def launched_id(result: Result) -> str:
    """The job id from a successful ``launch``'s first line."""
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()[0].split()[1]


def marker(record: JobRecord) -> dict[str, Any]:
    """The job's ``server.json`` (written by the start script), or ``{}`` while it is missing or partial."""
    try:
        return json.loads(Path(record.run_dir, "server.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def status_of(job: str) -> dict[str, Any]:
    """``pbstk status JOB --json``, which must succeed, as a dict."""
    result = pbstk("status", job, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout)[0])


def wait_recorded(job: str, state: str, timeout: float = 15.0, *, interval: float = 0.15) -> dict[str, Any]:
    """Poll ``status`` until the job store records ``state`` (only once the scheduler says F)."""

    def check() -> dict[str, Any] | None:
        st = status_of(job)
        return st if JobStore().find(job).final_state == state else None

    return dict(wait_for(check, timeout, f"{job} recorded as {state}", interval=interval))


def set_faults(home: Path, **faults: Any) -> None:
    """The fake PBS's faults (tests/fakepbs/README.md) for the server in ``home``."""
    (home / "faults.json").write_text(json.dumps(faults))


def fake_jobs(home: Path) -> dict[str, str]:
    """id -> state of every job the fake PBS in ``home`` has."""
    out = {}
    for path in (home / "jobs").glob("*.json"):
        data = json.loads(path.read_text())
        out[data["id"]] = data["attrs"]["job_state"]
    return out


class HealthOnly(http.server.BaseHTTPRequestHandler):
    """A worker that answers ``/health`` and nothing else (a foreign worker someone adds to a router)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def kill_started_job(proc: subprocess.Popen[bytes] | None, server_pid: int) -> None:
    """A test's leftovers of a job script run by hand: its process group (``start_new_session``) and the vLLM
    stand-in its ``server.json`` names (``server_pid`` 0: none), both with SIGKILL; gone already is fine."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)
    if server_pid > 0:
        try:
            os.kill(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- processes and services --------------------------------------------------------------------------------------

def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (a zombie does not: an orphan waits for init to reap it,
    which takes seconds on some machines)."""
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(entry))
    return found


@contextmanager
def interrupting(proc: subprocess.Popen[str], timeout: float) -> Iterator[Callable[[], str]]:
    """``with interrupting(proc, 60) as interrupt:`` wait for the moment, then ``err = interrupt()``: SIGINT to
    ``proc`` and its stderr once it ended (``timeout`` seconds at most). A process still running when the block
    ends (a wait that failed) is killed."""
    def interrupt() -> str:
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=timeout)[1]

    try:
        yield interrupt
    finally:
        if proc.poll() is None:
            proc.kill()


def local_service_profile(user: Path, router: Path | str, name: str = "svc") -> str:
    """Write the user profile ``name`` (the ``isolated_user`` layout): the local scheduler, one GPU a replica,
    loopback, and ``router`` as the service's vllm-router. Returns the profile's name."""
    profiles = user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.yaml").write_text(
        f"name: {name}\nscheduler: local\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nport: 8000\nrouter_command: {router}\n")
    return name
