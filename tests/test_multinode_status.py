"""status, wait, cancel and logs of a job over several nodes: every node's marker (``RUN_DIR/nodes/K.json``)
read from a real run directory, and a real fake-PBS job whose run directory the test gives node markers.

The markers and worker logs are written by hand here (the start script that writes them is tested in
test_multinode_run.py); what is tested is how pbstk reads them: READY only with every node up, STARTING
naming the node still loading, FAILED naming the worker that failed and quoting its log, ``wait`` failing
fast on it (exit 5), ``cancel`` writing ``RUN_DIR/stop``, ``logs --node K``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk, status_of, wait_for

from pbs_toolkit.client import Client
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.judge import judge
from pbs_toolkit.jobs.nodes import node_log_path, read_nodes, request_stop
from pbs_toolkit.jobs.rundir import RunDirView, look
from pbs_toolkit.jobs.status import ServerState
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import SchedulerJob, pbs
from pbs_toolkit.transports.http import Identity
from pbs_toolkit.transports.local import LocalRunner

NOW = 1_800_000_000.0
WORKER_OOM = [
    "pbstk: 02:38:27 attempt 1: starting vLLM on 127.0.0.3 (node 1 of 2, headless)",
    "INFO 11-22 02:38:29 [default_loader.py:1] Loading weights took 0.05 seconds",
    "ERROR 11-22 02:38:30 [core.py:1] EngineCore failed to start.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: Engine core initialization failed. See root cause above.",
]


def write_node(run_dir: Path, rank: int, phase: str, *, nnodes: int = 2, exit_code: int | None = None,
               attempt: int = 1, updated: float = NOW, pid: int | None = 4242) -> None:
    """``nodes/K.json`` as the start script writes it (contract: replaced atomically)."""
    (run_dir / "nodes").mkdir(exist_ok=True)
    data = {"rank": rank, "nnodes": nnodes, "host": f"fakenode{rank}", "address": f"127.0.0.{2 + rank}",
            "phase": phase, "pid": pid, "exit_code": exit_code, "attempt": attempt, "updated": updated}
    tmp = run_dir / "nodes" / f".{rank}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, run_dir / "nodes" / f"{rank}.json")


def write_server(run_dir: Path, phase: str, **more: Any) -> None:
    data = {"phase": phase, "job_id": "7.pbs01", "host": "fakenode0", "address": "127.0.0.2", "port": 8000,
            "pid": 4242, "attempt": 1, "eager_fallback": False, "exit_code": None, **more}
    (run_dir / "server.json").write_text(json.dumps(data))


def record(run_dir: Path) -> JobRecord:
    return JobRecord(job_id="7.pbs01", scheduler="pbs", profile="generic-pbspro", model="org/m",
                     served_model_name="org/m", preset="dp8", name="m", run_dir=str(run_dir))


def sched(raw: str = "R", exit_status: int | None = None) -> SchedulerJob:
    info: dict[str, Any] = {"job_state": raw, "exec_host": "fakenode0/0*4+fakenode1/0*4"}
    if exit_status is not None:
        info["Exit_status"] = exit_status
    return pbs._job("7.pbs01", info)


def judged(run_dir: Path, job: SchedulerJob | None = None, *, ours: bool = False) -> Any:
    """Read the run directory for real; the head's HTTP answer is given (``ours``: /v1/models proved it)."""
    rec = record(run_dir)
    view = look(LocalRunner(), rec, job or sched())
    if ours:
        view.health, view.identity = 200, Identity(True)
    return judge(rec, job or sched(), view)[0]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    (path / "vllm.log").write_text("pbstk: 02:38:20 attempt 1: starting vLLM on 127.0.0.2:8000\n"
                                   "INFO 11-22 02:38:25 [api_server.py:1] Starting vLLM API server on http://x\n")
    return path


# -- status from the markers --------------------------------------------------------------------------------


def test_ready_needs_the_heads_answer_and_every_node(run_dir: Path) -> None:
    write_server(run_dir, "ready", nnodes=2)
    write_node(run_dir, 0, "ready")
    write_node(run_dir, 1, "ready")
    st = judged(run_dir, ours=True)
    assert st.state is ServerState.READY and (st.nnodes, st.nodes_ready) == (2, 2)
    assert st.nodes_text == "2/2 nodes"
    doc = st.to_dict()
    assert doc["nnodes"] == 2 and doc["nodes_ready"] == 2 and doc["failed_node"] is None
    assert doc["nodes"][1] == {"rank": 1, "host": "fakenode1", "address": "127.0.0.3", "phase": "ready",
                               "pid": 4242, "exit_code": None}
    # the head's answer alone is not enough: a node without a marker keeps the job STARTING
    (run_dir / "nodes" / "1.json").unlink()
    st = judged(run_dir, ours=True)
    assert st.state is ServerState.STARTING and st.phase == "1/2 nodes up (node 1: no marker yet)"


def test_starting_names_the_node_still_loading(run_dir: Path) -> None:
    write_server(run_dir, "starting")  # no nnodes in server.json: the count comes from nodes/0.json
    write_node(run_dir, 0, "ready")
    write_node(run_dir, 1, "starting")
    (run_dir / "vllm.node1.log").write_text(
        "pbstk: 02:38:27 attempt 1: starting vLLM on 127.0.0.3 (node 1 of 2, headless)\n"
        "INFO 11-22 02:38:28 [default_loader.py:1] Loading weights\n")
    st = judged(run_dir)  # the head does not answer yet
    assert st.state is ServerState.STARTING
    assert st.phase == "1/2 nodes up (node 1 (fakenode1): loading weights)"
    write_node(run_dir, 1, "setup")
    assert judged(run_dir).phase == "1/2 nodes up (node 1 (fakenode1): waiting for the head)"


def test_a_failed_worker_fails_the_job_while_the_head_still_answers(run_dir: Path) -> None:
    write_server(run_dir, "ready", nnodes=2)
    write_node(run_dir, 0, "ready")
    write_node(run_dir, 1, "failed", exit_code=1)
    (run_dir / "vllm.node1.log").write_text("\n".join(WORKER_OOM) + "\n")
    st = judged(run_dir, ours=True)
    # until the head reacts (within a second: it writes `stop` and fails) the verdict is not confirmed
    assert st.state is ServerState.FAILED and not st.confirmed and not st.restart_expected
    (run_dir / "stop").write_text("")
    st = judged(run_dir, ours=True)
    assert st.state is ServerState.FAILED and st.confirmed and st.failed_node == 1
    assert st.reason.startswith("node 1 (fakenode1) failed with exit 1: ")
    assert "CUDA out of memory" in st.reason
    assert any("CUDA out of memory" in line for line in st.log_excerpt)
    assert st.log_file == f"{run_dir}/vllm.node1.log"
    assert st.nodes_ready == 1


def test_the_node_that_failed_first_is_named(run_dir: Path) -> None:
    """The head fails after the worker (it noticed and stopped); node 2 was stopped (143) on the same second."""
    write_server(run_dir, "failed", nnodes=3, exit_code=1)
    write_node(run_dir, 0, "failed", nnodes=3, exit_code=1, updated=NOW + 2)
    write_node(run_dir, 1, "failed", nnodes=3, exit_code=137, updated=NOW)
    write_node(run_dir, 2, "failed", nnodes=3, exit_code=143, updated=NOW)
    died = "pbstk: 09:28:31 vLLM exited with code 137 before it was ready"  # the start script's own line
    (run_dir / "vllm.node1.log").write_text(f"INFO loading\n{died}\n")
    st = judged(run_dir, sched("F", 1))
    assert st.state is ServerState.FAILED and st.failed_node == 1
    assert st.reason == "node 1 (fakenode1) failed with exit 137: vLLM exited with code 137 before it was ready"
    assert st.log_excerpt == ["INFO loading", died]


def test_a_worker_that_exits_is_a_failure_while_the_job_runs(run_dir: Path) -> None:
    write_server(run_dir, "ready", nnodes=2)
    write_node(run_dir, 0, "ready")
    write_node(run_dir, 1, "exited", exit_code=2)
    assert judged(run_dir, ours=True).reason.startswith("node 1 (fakenode1) exited with exit 2: (nothing in")
    write_node(run_dir, 1, "exited", exit_code=0)  # even exit 0: the head is left alone
    assert judged(run_dir, ours=True).reason.startswith("node 1 (fakenode1) exited with exit 0: ")
    write_server(run_dir, "exited", nnodes=2, exit_code=0)
    assert judged(run_dir, sched("F", 0)).state is ServerState.FINISHED


def test_an_earlier_attempts_failure_is_not_the_jobs(run_dir: Path) -> None:
    """The eager fallback restarts every node with a new attempt: the worker's old marker is about to change."""
    write_server(run_dir, "starting", nnodes=2, attempt=2, eager_fallback=True)
    write_node(run_dir, 0, "starting", attempt=2)
    write_node(run_dir, 1, "failed", exit_code=1, attempt=1)
    st = judged(run_dir)
    assert st.state is ServerState.STARTING and st.failed_node is None


def test_a_worker_compile_failure_waits_for_the_eager_restart(run_dir: Path) -> None:
    write_server(run_dir, "starting", nnodes=2)
    write_node(run_dir, 0, "starting")
    write_node(run_dir, 1, "failed", exit_code=1)
    (run_dir / "vllm.node1.log").write_text("torch._dynamo.exc.BackendCompilerFailed: inductor failed\n")
    st = judged(run_dir)
    assert st.state is ServerState.FAILED and st.restart_expected and not st.confirmed
    # the head's own compile failure: its workers lose it and fail with another error; a restart is coming too
    (run_dir / "vllm.node1.log").write_text("RuntimeError: connection to the head lost\n")
    with (run_dir / "vllm.log").open("a") as log:
        log.write("torch._dynamo.exc.BackendCompilerFailed: inductor failed\n")
    assert judged(run_dir).restart_expected
    st = judged(run_dir, sched("F", 1))  # the job ended: no restart to wait for
    assert st.state is ServerState.FAILED and st.confirmed and not st.restart_expected


def test_the_heads_own_reason_when_no_worker_failed(run_dir: Path) -> None:
    """The launcher could not start a node: the head's marker says why (no worker marker ever failed)."""
    write_server(run_dir, "failed", nnodes=2, exit_code=1, reason="mpiexec not found on fakenode0")
    write_node(run_dir, 0, "failed", exit_code=1)
    st = judged(run_dir, sched("F", 1))
    assert st.state is ServerState.FAILED and st.reason == "mpiexec not found on fakenode0"
    assert st.failed_node is None and st.log_file == f"{run_dir}/vllm.log"


def test_a_cancelled_job_stays_cancelled(run_dir: Path) -> None:
    write_server(run_dir, "cancelled", nnodes=2, exit_code=143)
    write_node(run_dir, 0, "cancelled", exit_code=143)
    write_node(run_dir, 1, "failed", exit_code=143)
    st = judged(run_dir, sched("F", 271))
    assert st.state is ServerState.CANCELLED and st.failed_node is None


def test_single_node_jobs_are_unchanged(run_dir: Path) -> None:
    write_server(run_dir, "ready")
    assert read_nodes(LocalRunner(), str(run_dir), json.loads((run_dir / "server.json").read_text())) is None
    st = judged(run_dir, ours=True)
    assert st.state is ServerState.READY and (st.nnodes, st.nodes_ready, st.nodes) == (1, None, [])
    write_node(run_dir, 0, "ready", nnodes=1)
    write_server(run_dir, "ready", nnodes=1)
    assert judged(run_dir, ours=True).nodes_text is None


def test_garbled_markers_spoil_only_their_node(run_dir: Path) -> None:
    write_server(run_dir, "starting", nnodes=2)
    write_node(run_dir, 0, "ready")
    (run_dir / "nodes" / "1.json").write_text("{not json")
    st, _ = judge(record(run_dir), sched(), RunDirView())  # nothing read: single-node view, unchanged
    assert st.nnodes == 1
    st = judged(run_dir)
    assert st.state is ServerState.STARTING and st.nodes[1]["phase"] is None


def test_stop_is_written_only_into_a_multinode_run_dir(run_dir: Path, tmp_path: Path) -> None:
    runner = LocalRunner()
    assert not request_stop(runner, str(tmp_path / "gone"))  # a run directory that is gone is not recreated
    assert not (tmp_path / "gone").exists()
    write_server(run_dir, "ready")
    assert not request_stop(runner, str(run_dir)) and not (run_dir / "stop").exists()  # single-node
    write_node(run_dir, 0, "ready")
    assert request_stop(runner, str(run_dir)) and (run_dir / "stop").read_text() == ""
    assert request_stop(runner, str(run_dir))  # again: replaced, harmless


def test_node_logs_before_the_job_started(tmp_path: Path) -> None:
    """No marker yet: the node count is not known, any node is taken (``-f`` waits for its file)."""
    runner = LocalRunner()
    assert node_log_path(runner, str(tmp_path), "7.pbs01", 3) == f"{tmp_path}/vllm.node3.log"
    assert node_log_path(runner, str(tmp_path), "7.pbs01", 0) == f"{tmp_path}/vllm.log"
    with pytest.raises(UsageError, match="--node must be 0"):
        node_log_path(runner, str(tmp_path), "7.pbs01", -1)


# -- a real fake-PBS job --------------------------------------------------------------------------------------


@pytest.fixture
def job(fakepbs: Path, standins: Path) -> tuple[str, Path]:
    """A READY single-node job (stand-in vLLM under the fake PBS); the test makes it a 2-node one."""
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                   "--name", "mn", "--wait", "--timeout", "30")
    assert result.exit_code == 0, result.output
    job_id = result.stdout.splitlines()[0].split()[1]
    run_dir = Path(JobStore().find(job_id).run_dir)
    # READY is pbstk's answer from the server; the start script sees the port up to a second later and logs on
    # ("compile cache filled", "vLLM is listening"): the tests compare reads of a log that no longer grows
    wait_for(lambda: "vLLM is listening" in (run_dir / "vllm.log").read_text(), 15, "the start script's READY line")
    return job_id, run_dir


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, check=False)


def test_status_wait_logs_cancel_on_a_real_job(job: tuple[str, Path], tmp_path: Path) -> None:
    job_id, run_dir = job
    write_node(run_dir, 0, "ready", updated=time.time())
    write_node(run_dir, 1, "setup", updated=time.time())
    st = status_of(job_id)
    assert st["state"] == "STARTING" and st["phase"] == "1/2 nodes up (node 1 (fakenode1): waiting for the head)"

    write_node(run_dir, 1, "ready", updated=time.time())
    (run_dir / "vllm.node1.log").write_text("worker line 1\nworker line 2\n")
    st = status_of(job_id)
    assert st["state"] == "READY" and st["nodes_ready"] == 2 and st["nnodes"] == 2
    assert [n["host"] for n in st["nodes"]] == ["fakenode0", "fakenode1"]
    row = next(line for line in pbstk("status").stdout.splitlines() if line.startswith(job_id))
    assert "READY" in row and row.rstrip().endswith("2/2 nodes")

    # logs --node K: the worker's own log; the head's by default; an unknown node is one error line
    assert _cli("logs", job_id, "--node", "1").stdout == "worker line 1\nworker line 2\n"
    head = _cli("logs", job_id, "--node", "0").stdout
    assert head == _cli("logs", job_id).stdout and "starting vLLM" in head
    bad = _cli("logs", job_id, "--node", "2")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"pbstk: error: job {job_id} has 2 nodes (0 to 1): there is no node 2\n"
    bad = _cli("logs", job_id, "--node", "1", "--stream", "sched-out")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--node" in bad.stderr

    # wait fails fast when a worker's marker says failed while the head still answers
    write_node(run_dir, 1, "setup", updated=time.time())  # the head answers, the worker has not joined: waiting
    progress = tmp_path / "wait.err"
    with progress.open("w") as err:
        waiter = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "wait", job_id, "--timeout", "60"],  # noqa: S603
                                  stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:  # STARTING, 1/2 nodes up: the wait goes on
        wait_for(lambda: "1/2 nodes up (node 1 (fakenode1): waiting for the head)" in progress.read_text(),
                 30, "wait's progress line")
        assert waiter.poll() is None
        (run_dir / "vllm.node1.log").write_text("\n".join(WORKER_OOM) + "\n")
        write_node(run_dir, 1, "failed", exit_code=1, updated=time.time())
        started = time.monotonic()
        time.sleep(1.0)
        (run_dir / "stop").write_text("")  # the head's reaction (it checks its workers each second)
        waiter.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    stderr = progress.read_text()
    assert waiter.returncode == 5, stderr
    lines = stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("pbstk: error:")]
    assert len(errors) == 1, stderr  # (progress lines come before it)
    first, details = lines[errors[0]], lines[errors[0] + 1:]
    assert details and all(line.startswith("  | ") for line in details), stderr
    assert first.startswith(f"pbstk: error: job {job_id} is FAILED: node 1 (fakenode1) failed with exit 1: ")
    assert first.endswith(f"(log: {run_dir}/vllm.node1.log)")
    assert any("CUDA out of memory" in line for line in details)
    assert took < 20, took  # the marker ends the wait, not its 60 s timeout (a loaded CI host took over 5 s once)
    print(f"wait failed {took:.2f} s after the worker's marker (the head's `stop` came after 1 s)")
    registry = tmp_path / "endpoints.py"
    result = _cli("update-endpoint", job_id, "--registry", str(registry), "--timeout", "60")
    assert result.returncode == 5 and "node 1 (fakenode1) failed" in result.stderr and not registry.exists()
    st = status_of(job_id)
    assert st["state"] == "FAILED" and st["failed_node"] == 1 and not JobStore().find(job_id).final_state

    with Client() as c:  # logs --node 1 -f: the worker's log, followed
        followed = c.logs(job_id, 2, follow=True, node=1)
        assert [next(followed), next(followed)] == WORKER_OOM[-2:]
        followed.close()

    # cancel: the scheduler's cancel, plus RUN_DIR/stop for nodes started over ssh; again: still fine
    (run_dir / "stop").unlink()  # (the head's, above)
    assert pbstk("cancel", job_id).exit_code == 0
    assert (run_dir / "stop").read_text() == ""  # empty: text in it would be a failure's reason
    (run_dir / "stop").unlink()
    again = pbstk("cancel", job_id)
    assert again.exit_code == 0 and again.stdout.strip() in (f"{job_id}: cancelled", f"{job_id}: already ended")
    wait_for(lambda: status_of(job_id)["state"] == "CANCELLED", what="CANCELLED")


def test_cancel_of_a_single_node_job_writes_no_stop(job: tuple[str, Path]) -> None:
    job_id, run_dir = job
    assert pbstk("cancel", job_id).exit_code == 0
    assert not (run_dir / "stop").exists()
    bad = _cli("logs", job_id, "--node", "1")
    assert bad.returncode == 2
    assert bad.stderr == f"pbstk: error: job {job_id} runs on 1 node (node 0 only): there is no node 1\n"
