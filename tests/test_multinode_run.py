"""Several nodes, execution side: rendered start scripts run by real bash, one copy per node, under the fake PBS
(fakenode0..N-1 on 127.0.0.2..; its `mpiexec`/`pbsdsh` start each node's copy with that node's identity) or the
local launcher, with the stand-in `vllm` (and `ray`) behaving like vLLM's multi-node engines.

The multi-node header variables are added by hand to a single-node render (the renderer's multi-node presets are
another part of issue 14); everything else is the real rendered script.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pbs_toolkit.jobs.render import RenderRequest, render, start_body

FAKEPBS = Path(__file__).parent / "fakepbs"
FINAL = ("failed", "exited", "cancelled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MultiJob:
    run_dir: Path
    record: Path
    nnodes: int
    proc: subprocess.Popen[bytes] | None = None
    job_id: str = ""
    pids: set[int] = field(default_factory=set)

    def read(self, name: str) -> dict[str, Any]:
        path = self.run_dir / name
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}

    def node(self, k: int) -> dict[str, Any]:
        return self.read(f"nodes/{k}.json")

    def log(self, k: int = 0) -> str:
        path = self.run_dir / ("vllm.log" if k == 0 else f"vllm.node{k}.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def all_logs(self) -> str:
        return "\n".join(f"--- node {k}:\n{self.log(k)}" for k in range(self.nnodes))

    def starts(self, name: str = "argv.jsonl") -> list[dict[str, Any]]:
        path = self.record / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait(self, what: str, check: Any, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.remember_pids()
            if check():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; server.json {self.read('server.json')}\n"
                             f"markers {[self.node(k) for k in range(self.nnodes)]}\n{self.all_logs()}")

    def wait_ready(self, timeout: float = 60) -> None:  # an event wait: generous, a loaded machine is slow
        self.wait("every node ready", lambda: all(self.node(k).get("phase") == "ready" for k in range(self.nnodes))
                  and self.read("server.json").get("phase") == "ready", timeout)

    def remember_pids(self) -> None:
        for k in range(self.nnodes):
            pid = self.node(k).get("pid")
            if isinstance(pid, int) and pid > 0:
                self.pids.add(pid)

    def alive_pids(self) -> list[int]:
        alive = []
        for pid in self.pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            alive.append(pid)
        return alive


def _multinode_script(start_script: str, header: dict[str, str]) -> str:
    """The rendered single-node script with the multi-node settings added in front of the static body."""
    body = start_body()
    assert start_script.endswith(body)
    lines = "".join(f"{key}={value}\n" for key, value in header.items())
    return start_script[: -len(body)] + lines + body


@pytest.fixture
def make_multi(standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0.1")
    monkeypatch.setenv("PATH", f"{FAKEPBS / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKEPBS_HOME", str(tmp_path / "fakepbs"))
    monkeypatch.setenv("FAKEPBS_KILL_DELAY", "3")
    monkeypatch.setenv("FAKEPBS_EXITING_DELAY", "0.2")
    (tmp_path / "fakepbs").mkdir()
    jobs: list[MultiJob] = []

    def make(nnodes: int, engine: str = "dp", launcher: str = "pbsdsh", *, profile: str = "generic-pbspro",
             tp: int = 1, pp: int = 1, dp_local: int = 4, args: tuple[str, ...] = ()) -> MultiJob:
        run_dir = tmp_path / f"run{len(jobs)}"
        rendered = render(RenderRequest(model="Qwen/Qwen3-0.6B", run_dir=str(run_dir), profile=profile,
                                        preset="single", port=_free_port()))
        dp = dp_local * nnodes if engine == "dp" else 1
        header = {"NNODES": str(nnodes), "NODE_ENGINE": engine, "TP": str(tp), "PP": str(pp), "DP": str(dp),
                  "DP_LOCAL": str(dp_local if engine == "dp" else 1), "NODE_LAUNCHER": launcher,
                  "NCCL_IFNAME": "lo", "GLOO_IFNAME": "lo"}
        # a one-GPU preset's API servers (settings/front_servers.py) are not a DP head's: peers.sh sets those
        script = _multinode_script(rendered.start_script.replace("\n  --api-server-count 4\n", "\n"), header)
        if args:
            script = script.replace("VLLM_ARGS=(\n", "VLLM_ARGS=(\n  " + " ".join(args) + "\n", 1)
        run_dir.mkdir()
        # a multi-node render's own lines: the chunks, one host each (PBS's default place=free would pack them)
        job_script = re.sub(r"#PBS -l select=\S+", f"#PBS -l select={nnodes}:ncpus=8:ngpus=4\n#PBS -l place=scatter",
                            rendered.job_script)
        for name, text in (("job.pbs", job_script), ("start_vllm.sh", script)):
            (run_dir / name).write_text(text)
            (run_dir / name).chmod(0o755)
        job = MultiJob(run_dir, standins, nnodes)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        if job.job_id:
            subprocess.run(["qdel", job.job_id], capture_output=True, check=False)  # noqa: S603,S607
        if job.proc is not None and job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(timeout=5)
        time.sleep(0.2)
        for pid in job.alive_pids():
            os.kill(pid, signal.SIGKILL)


def qsub(job: MultiJob, **env: str) -> None:
    result = subprocess.run(["qsub", str(job.run_dir / "job.pbs")], capture_output=True, text=True,  # noqa: S603,S607
                            env={**os.environ, **env}, check=True)
    job.job_id = result.stdout.strip()


def qstat(job: MultiJob) -> dict[str, Any]:
    out = subprocess.run(["qstat", "-x", "-f", "-F", "json", job.job_id], capture_output=True, text=True,  # noqa: S603,S607
                         check=False).stdout
    return dict(json.loads(out)["Jobs"][job.job_id])


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _models(address: str, port: int) -> int:
    with urllib.request.urlopen(f"http://{address}:{port}/v1/models", timeout=5) as resp:  # noqa: S310
        return int(resp.status)


@pytest.mark.parametrize(("nnodes", "launcher"), [(2, "pbsdsh"), (3, "mpiexec")])
def test_native_dp_every_node_starts_with_its_rank_then_cancel_stops_all(
        make_multi: Any, nnodes: int, launcher: str) -> None:
    job = make_multi(nnodes, "dp", launcher)
    qsub(job)
    job.wait_ready()
    head = job.read("head.json")
    server = job.read("server.json")
    assert server["nnodes"] == nnodes and server["address"] == "127.0.0.2" and server["host"] == "fakenode0"
    assert head["address"] == "127.0.0.2" and head["port"] == server["port"] and head["attempt"] == 1
    assert _models(server["address"], server["port"]) == 200
    starts = {s["env"]["PBSTK_NODE_RANK"]: s for s in job.starts()}
    assert sorted(starts) == [str(k) for k in range(nnodes)]
    for k in range(nnodes):
        argv, env, marker = starts[str(k)]["argv"], starts[str(k)]["env"], job.node(k)
        address = f"127.0.0.{2 + k}"
        assert marker["rank"] == k and marker["host"] == f"fakenode{k}" and marker["address"] == address
        assert env["VLLM_HOST_IP"] == address
        assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert _flag(argv, "--data-parallel-address") == "127.0.0.2"
        assert _flag(argv, "--data-parallel-rpc-port") == str(head["rpc_port"])
        assert _flag(argv, "--data-parallel-size") == str(4 * nnodes)
        assert _flag(argv, "--data-parallel-size-local") == "4"
        assert ("--headless" in argv) == (k > 0)
        assert _flag(argv, "--data-parallel-start-rank") == (str(4 * k) if k else None)
        # one API server per DP rank on the head (else one process serves every node); workers refuse the flag
        assert _flag(argv, "--api-server-count") == (str(4 * nnodes) if k == 0 else None)
        assert ("--port" in argv) == (k == 0)
    subprocess.run(["qdel", job.job_id], check=True)  # noqa: S603,S607
    job.wait("every node cancelled", lambda: all(job.node(k).get("phase") == "cancelled" for k in range(nnodes)))
    job.wait("no vLLM left", lambda: not job.alive_pids(), timeout=10)
    job.wait("the job finished", lambda: qstat(job)["job_state"] == "F")


def test_tp_pp_across_nodes_with_nnodes_flags(make_multi: Any) -> None:
    job = make_multi(2, "nnodes", "mpiexec", tp=4, pp=2)
    qsub(job)
    job.wait_ready()
    rpc = job.read("head.json")["rpc_port"]
    starts = {s["env"]["PBSTK_NODE_RANK"]: s["argv"] for s in job.starts()}
    for k in (0, 1):
        argv = starts[str(k)]
        assert _flag(argv, "--tensor-parallel-size") == "4" and _flag(argv, "--pipeline-parallel-size") == "2"
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == str(k)
        assert _flag(argv, "--master-addr") == "127.0.0.2" and _flag(argv, "--master-port") == str(rpc)
        assert ("--headless" in argv) == (k == 1)


def test_a_worker_killed_mid_startup_fails_the_job_naming_it(make_multi: Any) -> None:
    job = make_multi(2, "dp", "pbsdsh")
    qsub(job, PBSTK_TEST_STANDIN_MODE_NODE1="hang")
    job.wait("the worker's vLLM", lambda: job.node(1).get("phase") == "starting" and "Loading weights" in job.log(1))
    killed_at = time.monotonic()
    os.kill(job.node(1)["pid"], signal.SIGKILL)
    job.wait("the head failed", lambda: job.read("server.json").get("phase") == job.node(0).get("phase") == "failed",
             timeout=15)
    assert time.monotonic() - killed_at < 15
    server, head = job.read("server.json"), job.node(0)
    assert head["phase"] == "failed"
    assert head["reason"].startswith("node 1 (host fakenode1) failed: ")
    assert "Loading weights took" in head["reason"]  # the worker's own log lines
    assert server["reason"] == head["reason"]
    assert job.node(1)["phase"] == "failed" and job.node(1)["exit_code"] == 137
    assert "error: node 1 (host fakenode1) failed" in job.log(0)
    job.wait("the job finished non-zero", lambda: qstat(job).get("Exit_status") not in (None, 0), timeout=15)
    job.wait("no vLLM left", lambda: not job.alive_pids(), timeout=10)


def test_a_dead_head_stops_the_workers(make_multi: Any) -> None:
    job = make_multi(2, "dp", "mpiexec")
    qsub(job)
    job.wait_ready()
    os.kill(job.node(0)["pid"], signal.SIGKILL)
    job.wait("the worker stopped", lambda: job.node(1).get("phase") in FINAL, timeout=15)
    job.wait("the head marker final", lambda: job.node(0).get("phase") in FINAL)
    job.wait("no vLLM left", lambda: not job.alive_pids(), timeout=10)
    job.wait("the job finished non-zero", lambda: qstat(job).get("Exit_status") not in (None, 0), timeout=15)


def test_missing_launcher_fails_the_head_marker_with_one_reason(make_multi: Any) -> None:
    job = make_multi(2, "dp", "mpiexec")
    qsub(job, FAKEPBS_MISSING_TOOLS="mpiexec")
    job.wait("the head marker failed", lambda: job.node(0).get("phase") == "failed")
    reason = job.node(0)["reason"]
    assert reason.startswith("mpiexec not found on fakenode0")
    assert job.read("server.json")["phase"] == "failed" and job.read("server.json")["exit_code"] == 127
    assert job.starts() == []
    job.wait("the job finished", lambda: qstat(job).get("Exit_status") == 127)


@pytest.mark.parametrize("failing", ["0", "1"])
def test_a_compile_error_on_any_node_restarts_every_node_eager(make_multi: Any, failing: str) -> None:
    job = make_multi(2, "dp", "pbsdsh")
    qsub(job, **{f"PBSTK_TEST_STANDIN_MODE_NODE{failing}": "compile-fail-once"})
    job.wait_ready(timeout=120)  # two starts of two nodes each: on a loaded machine this took over 30 s
    assert job.read("head.json")["attempt"] == 2 and job.read("head.json")["eager"] is True
    by_rank: dict[str, list[list[str]]] = {}
    for s in job.starts():
        by_rank.setdefault(s["env"]["PBSTK_NODE_RANK"], []).append(s["argv"])
    assert [("--enforce-eager" in a) for a in by_rank["0"]] == [False, True]
    assert [("--enforce-eager" in a) for a in by_rank["1"]] == [False, True]
    assert job.read("server.json")["eager_fallback"] is True and job.node(1)["attempt"] == 2


def test_ray_engine_forms_the_cluster_then_serves(make_multi: Any) -> None:
    job = make_multi(2, "ray", "pbsdsh", tp=4, pp=2)
    qsub(job)
    job.wait_ready()
    rays = [s["argv"][1:] for s in job.starts("ray.jsonl")]
    rpc = job.read("head.json")["rpc_port"]
    assert ["start", "--head", "--node-ip-address=127.0.0.2", f"--port={rpc}", "--block"] in rays
    assert ["start", f"--address=127.0.0.2:{rpc}", "--node-ip-address=127.0.0.3", "--block"] in rays
    (head,) = job.starts()
    assert _flag(head["argv"], "--distributed-executor-backend") == "ray"
    assert _flag(head["argv"], "--tensor-parallel-size") == "4"


def test_local_launcher_gives_each_node_its_gpu_slice_and_address(make_multi: Any, tmp_path: Path) -> None:
    job = make_multi(2, "dp", "local", profile="local-gpu", dp_local=2)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    job.proc = subprocess.Popen(["bash", str(job.run_dir / "job.pbs")], env=env, start_new_session=True,  # noqa: S603,S607
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job.wait_ready()
    starts = {s["env"]["PBSTK_NODE_RANK"]: s for s in job.starts()}
    assert starts["0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert starts["1"]["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert starts["1"]["env"]["VLLM_HOST_IP"] == "127.0.0.3"
    server = job.read("server.json")
    assert server["address"] == "127.0.0.2" and _models("127.0.0.2", server["port"]) == 200
    os.killpg(job.proc.pid, signal.SIGTERM)
    assert job.proc.wait(timeout=15) != 0
    job.wait("no vLLM left", lambda: not job.alive_pids(), timeout=10)


def test_rendered_multinode_script_is_shellcheck_clean(make_multi: Any) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    job = make_multi(2, "dp", "pbsdsh")
    result = subprocess.run(["shellcheck", "-s", "bash", str(job.run_dir / "start_vllm.sh")],  # noqa: S603,S607
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


# --- the stand-in refuses inconsistent ranks the way vLLM does ---
STANDIN = Path(__file__).parent / "standins" / "vllm"


def _standin(*args: str, **env: str) -> subprocess.Popen[str]:
    """The stand-in vLLM as one node's process (each one a node of its own: its own stand-in GPUs)."""
    return subprocess.Popen([str(STANDIN), "serve", "m", *args], text=True,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0,
                            env={**os.environ, "PBSTK_TEST_STANDIN_DELAY": "0",
                                 "PBSTK_TEST_GPU_NODE": f"node-{next(_NODES)}", **env})


_NODES = itertools.count()


def test_standin_second_head_on_the_same_rpc_port_fails(standins: Path) -> None:
    rpc, api = _free_port(), _free_port()
    flags = ("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(rpc))
    started = [_standin(*flags, "--port", str(api))]
    try:
        time.sleep(0.5)
        second = _standin(*flags, "--port", str(_free_port()))
        started.append(second)
        out, _ = second.communicate(timeout=10)
        assert second.returncode == 1 and "cannot bind the data parallel RPC port" in out
        worker = _standin(*flags, "--headless", "--data-parallel-start-rank", "1")
        started.append(worker)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the head opens its API only once the worker joined
            try:
                assert _models("127.0.0.1", api) == 200
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("the head never opened its API port")
        os.killpg(started[0].pid, signal.SIGKILL)  # the head and its engine core
        started[0].wait()
        out, _ = worker.communicate(timeout=10)
        assert worker.returncode == 1 and "connection to the head was lost" in out
    finally:
        for proc in started:  # each one with its engine core (a process group of its own)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_standin_rank_outside_the_layout_fails_and_a_lone_worker_gives_up(standins: Path) -> None:
    bad = _standin("--nnodes", "2", "--node-rank", "2", "--headless", "--master-addr", "127.0.0.1")
    out, _ = bad.communicate(timeout=10)
    assert bad.returncode == 1 and "node_rank (2) must be less than nnodes (2)" in out
    lone = _standin("--nnodes", "2", "--node-rank", "1", "--headless", "--master-addr", "127.0.0.1",
                    "--master-port", str(_free_port()), PBSTK_TEST_STANDIN_CONNECT_S="1")
    started = time.monotonic()
    out, _ = lone.communicate(timeout=10)
    assert lone.returncode == 1 and "could not connect to the head" in out and time.monotonic() - started >= 1


# --- end to end through the CLI: render (the node plan), submit, READY with every node, answer, cancel ---
def _pbstk(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          env=env, timeout=120, check=False)


def _answer_and_cancel(job_id: str, env: dict[str, str] | None = None) -> None:
    launched = json.loads(_pbstk("status", job_id, "--json", env=env).stdout)
    record = launched[0] if isinstance(launched, list) else launched
    run_dir = Path(next(v for k, v in _walk(record) if k == "run_dir"))
    server = json.loads((run_dir / "server.json").read_text())
    deadline = time.monotonic() + 5  # a worker sees the head's READY within its next poll (1 s)
    while time.monotonic() < deadline:
        markers = [json.loads((run_dir / "nodes" / f"{k}.json").read_text()) for k in (0, 1)]
        if [m["phase"] for m in markers] == ["ready", "ready"]:
            break
        time.sleep(0.1)
    assert [m["phase"] for m in markers] == ["ready", "ready"]
    assert [m["address"] for m in markers] == ["127.0.0.2", "127.0.0.3"]
    key = (run_dir / "api_key").read_text()
    request = urllib.request.Request(f"http://{server['address']}:{server['port']}/v1/models",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310
        assert resp.status == 200
    pids = [m["pid"] for m in markers]
    assert _pbstk("cancel", job_id, env=env).returncode == 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        phases = [json.loads((run_dir / "nodes" / f"{k}.json").read_text())["phase"] for k in (0, 1)]
        alive = [p for p in pids if _alive(p)]
        if phases == ["cancelled", "cancelled"] and not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"nodes {phases}, vLLM pids still alive: {alive}")


def _walk(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _walk(value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_dp8_on_two_fake_pbs_nodes_end_to_end(fakepbs: Path, standins: Path,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0.1")
    result = _pbstk("launch", "Qwen/Qwen3-0.6B", "-P", "generic-pbspro", "--nodes", "2", "--preset", "dp8",
                    "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted (\S+)", result.stdout + result.stderr).group(1)  # type: ignore[union-attr]
    _answer_and_cancel(job_id)


def test_launch_on_the_local_scheduler_as_two_nodes(standins: Path, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0.1")
    monkeypatch.setenv("PBSTK_TEST_GPUS", "8")  # the machine's 8 GPUs, two "nodes" of 4 each
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    result = _pbstk("launch", "Qwen/Qwen3-0.6B", "-P", "generic-pbspro", "--scheduler", "local", "--nodes", "2",
                    "--preset", "dp8", "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted (\S+)", result.stdout + result.stderr).group(1)  # type: ignore[union-attr]
    starts = {s["env"]["PBSTK_NODE_RANK"]: s["env"] for s in
              (json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines())}
    assert starts["0"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and starts["1"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    _answer_and_cancel(job_id)


def test_tp4pp2_over_two_nodes_reports_both_registers_one_url_and_cancel_takes_it_back(
        fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 14's "done when" for a TP/PP preset, through pbstk only: READY with both nodes reporting, the URL
    update-endpoint registers answers with the job's key, and cancel stops every node and takes the entry back."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0.1")
    result = _pbstk("launch", "Qwen/Qwen3-0.6B", "-P", "generic-pbspro", "--nodes", "2", "--preset", "tp4pp2",
                    "--name", "big", "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted (\S+)", result.stdout).group(1)  # type: ignore[union-attr]
    deadline = time.monotonic() + 10  # the worker marks itself ready within a poll of the head's READY
    while True:
        (st,) = json.loads(_pbstk("status", job_id, "--json").stdout)
        if st["nodes_ready"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st["state"] == "READY" and st["nnodes"] == 2 and st["nodes_ready"] == 2, st
    assert [n["address"] for n in st["nodes"]] == ["127.0.0.2", "127.0.0.3"]
    assert "2/2 nodes" in _pbstk("status", job_id).stdout
    registry = tmp_path / "endpoints.yaml"
    reg = _pbstk("update-endpoint", job_id, "--registry", str(registry), "--json")
    assert reg.returncode == 0, reg.stderr
    text = registry.read_text()
    assert st["url"] in text and "big" in text
    key = (Path(st["run_dir"]) / "api_key").read_text()
    request = urllib.request.Request(f"{st['url']}/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
    records = [json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines()]
    starts = {s["env"]["PBSTK_NODE_RANK"]: s["argv"] for s in records}
    # the key: the head's API server reads it from a 0600 --config file; no node has VLLM_API_KEY or it in argv
    assert _flag(starts["0"], "--config") == str(Path(st["run_dir"]) / "vllm_api_key.yaml")
    assert "--config" not in starts["1"]
    assert not any("VLLM_API_KEY" in s["env"] or key in " ".join(s["argv"]) for s in records)
    for rank, argv in starts.items():
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == rank
        assert _flag(argv, "--tensor-parallel-size") == "4" and _flag(argv, "--pipeline-parallel-size") == "2"
    assert _pbstk("cancel", job_id).returncode == 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        phases = [n["phase"] for n in json.loads(_pbstk("status", job_id, "--json").stdout)[0]["nodes"]]
        if phases == ["cancelled", "cancelled"]:
            break
        time.sleep(0.3)
    assert phases == ["cancelled", "cancelled"]
    assert st["url"] not in registry.read_text()  # the entry left with its job
