"""`pbstk serve A:name=a B:name=b --name pair` runs (issue 31, second slice): the packed jobs (local scheduler,
stand-in vLLM), the real vllm-router in its multi-model mode, the real keeper; one URL and one key, a request's
`model` picks the server.

Before: several models without --dry-run were refused ("planned, not running yet"), exit 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import pbstk, wait_for
from test_serve_models import checkpoint
from test_service import _stop_services

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def multi_profile(isolated_user: Path, monkeypatch: pytest.MonkeyPatch, name: str, own: str) -> Path:
    """Profile ``name`` of the multi-model tests (one 80 GB GPU a node, 2 CPUs, the real router; ``own``: its other
    YAML lines, the scheduler's first), the keeper looking every 0.5 s, the stand-in listening at once and
    answering a request for another model with vLLM's 404; returns where the tests write their checkpoints."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.yaml").write_text(
        f"name: {name}\n{own}nodes: 1\ngpus_per_node: 1\ngpu_memory_gb: 80\ncpus_per_node: 2\n"
        f"walltime: '00:10:00'\naddress: loopback\nbind_host: 127.0.0.1\nrouter_command: {ROUTER}\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_CHECK_MODEL", "1")
    return isolated_user / "m"


@pytest.fixture
def gpu_svc(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A local-scheduler profile of one 80 GB GPU (two small models share it), the real router; the keeper looks
    every 0.5 s; the stand-in answers a request for another model with vLLM's 404."""
    root = multi_profile(isolated_user, monkeypatch, "gpu1", "scheduler: local\nport: 8000\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    yield checkpoint(root, "alpha", 1_200_000_000), checkpoint(root, "beta", 3_400_000_000)
    _stop_services()


def chat(url: str, key: str | None, model: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return requests.post(url + "/chat/completions", json=body, headers=headers, timeout=20)


def argv_of(record: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in (record / "argv.jsonl").read_text().splitlines()]


def test_two_models_packed_in_one_job_behind_one_url(gpu_svc: Any, standins: Path, isolated_user: Path) -> None:
    alpha, beta = gpu_svc
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "pair", "--profile", "gpu1", "--wait",
                   "--timeout", "90")
    assert result.exit_code == 0, result.output
    assert "service pair: 2 models in 1 job(s) submitted" in result.stdout, result.output

    rec = records.find(JobStore(), "pair")
    url = rec.url
    assert url and rec.api_key
    wait_for(lambda: len(requests.get(url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 2, 30,
             "both models' servers in the router")
    # the one job started one vLLM per model: its own served name, memory share and GPUs
    starts = argv_of(standins)  # a start that lost its port to another test's server is made again: set()
    served = sorted({a[a.index("--served-model-name") + 1] for a in starts})
    assert served == ["a", "b"], starts
    for a in starts:  # one GPU given out whole: 0.90 between the two, in proportion to their needs (issue 42)
        assert a[a.index("--gpu-memory-utilization") + 1] == "0.45", a
    envs = [json.loads(line)["env"] for line in (standins / "argv.jsonl").read_text().splitlines()]
    assert {e.get("CUDA_VISIBLE_DEVICES") for e in envs} == {"0"}  # both planned on the job's GPU 0
    for model in ("a", "b", "a", "b"):
        answer = chat(url, rec.api_key, model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model  # the stand-in names the model it serves
    assert chat(url, None, "a").status_code == 401
    unknown = chat(url, rec.api_key, "nope")
    assert unknown.status_code == 404 and "The model `nope` does not exist." in unknown.text, unknown.text

    listed = requests.get(url + "/models", headers={"Authorization": f"Bearer {rec.api_key}"}, timeout=10)
    assert listed.status_code == 200, listed.text
    assert sorted(m["id"] for m in listed.json()["data"]) == ["a", "b"], listed.text
    assert listed.json()["object"] == "list"
    wrong = requests.get(url + "/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert wrong.status_code == 401, wrong.text  # each server checks the key, as for one model

    text = pbstk("status", "pair")
    assert text.exit_code == 0, text.output
    print(text.stdout)
    rows = {line.split()[0]: line.split() for line in text.stdout.splitlines()
            if line.split() and line.split()[0] in ("a", "b")}
    assert set(rows) == {"a", "b"}, text.stdout
    assert all("READY" in row for row in rows.values()), text.stdout
    doc = json.loads(pbstk("status", "pair", "--json").stdout)[0]
    models = {m["served_model_name"]: m for m in doc["models"]}
    assert set(models) == {"a", "b"} and all(m["state"] == "READY" for m in models.values()), doc["models"]
    assert models["a"]["job"] == models["b"]["job"] and models["a"]["server"] != models["b"]["server"]
    assert models["a"]["url"] == models["b"]["url"] == url
    assert models["a"]["gpus"] == [0] and models["a"]["gpu_memory_utilization"] == 0.45

    exports = pbstk("env", "pair").stdout.splitlines()  # no one model: all of them, as pbstk run gives COMMAND
    assert "export PBSTK_MODELS='b a'" in exports or "export PBSTK_MODELS='a b'" in exports, exports
    assert not any(line.startswith("export PBSTK_MODEL=") for line in exports), exports

    registry = isolated_user / "reg.yaml"
    upd = pbstk("update-endpoint", "pair", "--registry", str(registry))
    assert upd.exit_code == 0, upd.output
    print(upd.stdout)
    entries = json.loads(json.dumps(__import__("yaml").safe_load(registry.read_text())))["endpoints"]
    assert set(entries) == {"a", "b"}, entries
    assert {entries[k]["model"] for k in entries} == {"a", "b"}
    assert {entries[k]["url"] for k in entries} == {url}

    run_dir = Path(JobStore().find(models["a"]["job"]).run_dir)
    stop = pbstk("cancel", "pair")
    assert stop.exit_code == 0, stop.output
    assert __import__("yaml").safe_load(registry.read_text()).get("endpoints") in (None, {}), registry.read_text()
    marker = json.loads((run_dir / "server.json").read_text())
    wait_for(lambda: json.loads((run_dir / "server.json").read_text())["phase"] != "ready", 30, "the job ended")
    others = [int(p) for p in (marker.get("models") or "").replace("b@", "").replace("a@", "").split()]
    assert others, marker
    for port in others:  # the other model's server stopped with the job
        wait_for(lambda port=port: _refused(port), 30, f"the server on port {port} stopped")
    assert os.environ.get("PBSTK_TEST_STANDIN_CHECK_MODEL") == "1"


def _refused(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except requests.ConnectionError:
        return True
    return False


def pbs1_trio(isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """Profile ``pbs1`` (the fake PBS, one 80 GB GPU a node, the real router on this machine), the keeper looking
    every 0.5 s, the stand-in answering another model with vLLM's 404; and three checkpoints: a and b (1.2 GB
    each) share one GPU, c (3.4 GB, served with ``:preset=single``) takes a whole one: two jobs."""
    root = multi_profile(isolated_user, monkeypatch, "pbs1", "scheduler: pbs\nrouter: local\n")
    a, b, c = (checkpoint(root, n, size) for n, size in (("a", 1_200_000_000), ("b", 1_200_000_000),
                                                          ("c", 3_400_000_000)))
    return a, b, c


def test_three_models_in_two_pbs_jobs(isolated_user: Path, fakepbs: Path, standins: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake PBS runs the plan's two jobs: c (preset single) takes a whole GPU in one, a and b share the GPU of
    the other; the router here routes each model to its job's server."""
    a, b, c = pbs1_trio(isolated_user, monkeypatch)
    try:
        result = pbstk("serve", f"{a}:name=a", f"{b}:name=b", f"{c}:name=c:preset=single", "--name", "trio",
                       "--profile", "pbs1", "--wait", "--timeout", "120")
        assert result.exit_code == 0, result.output
        assert "service trio: 3 models in 2 job(s) submitted" in result.stdout, result.output
        rec = records.find(JobStore(), "trio")
        assert rec.url and all(s.current and s.current.endswith(".fakepbs") for s in rec.slots), rec.slots
        wait_for(lambda: len(requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 3, 30,
                 "three servers in the router")
        for model in ("c", "a", "b", "c"):
            answer = chat(rec.url, rec.api_key, model)
            assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        doc = json.loads(pbstk("status", "trio", "--json").stdout)[0]
        models = {m["served_model_name"]: m for m in doc["models"]}
        assert models["a"]["job"] == models["b"]["job"] != models["c"]["job"], doc["models"]
        assert (models["c"]["gpu_memory_utilization"], models["a"]["gpu_memory_utilization"]) == (0.95, 0.45)
        assert pbstk("cancel", "trio").exit_code == 0
    finally:
        _stop_services()


def test_a_two_model_job_script_is_shellcheck_clean_and_names_each_model(isolated_user: Path, tmp_path: Path) -> None:
    """The rendered start script of a multi-model job: models.sh before supervise.sh, each other model's
    settings in the header (its served name, GPUs and share in its arguments), and shellcheck finds nothing."""
    import subprocess

    from pbs_toolkit.jobs.render import RenderRequest, render

    profile = tmp_path / "gpu1.yaml"
    profile.write_text("name: gpu1\nscheduler: pbs\ngpus_per_node: 1\ngpu_memory_gb: 80\n")
    root = tmp_path / "m"
    a, b = checkpoint(root, "alpha", 1_200_000_000), checkpoint(root, "beta", 1_200_000_000)
    rows = [{"model": a, "preset": "auto", "served_model_name": "a", "gpus": [0], "share": 0.1},
            {"model": b, "preset": "auto", "served_model_name": "b", "gpus": [0], "share": 0.15}]
    job = render(RenderRequest(model=a, profile=str(profile), preset="auto", served_model_name="a", models=rows))
    text = job.start_script
    assert "CO_MODELS=1\n" in text and "CO_SERVED_1=b\n" in text and "MAIN_GPUS=0\n" in text, text
    assert text.index("# --- several models in one job") < text.index("# vLLM's output line by line")
    assert job.vllm_args[job.vllm_args.index("--gpu-memory-utilization") + 1] == "0.1"
    assert "  --gpu-memory-utilization 0.15\n" in text and "  --served-model-name b\n" in text
    script = tmp_path / "start_vllm.sh"
    script.write_text(text)
    proc = subprocess.run(["shellcheck", "-f", "gcc", str(script)], capture_output=True, text=True,  # noqa: S603,S607
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one = render(RenderRequest(model=a, profile=str(profile), preset="auto", served_model_name="a"))
    assert "several models" not in one.start_script and "CO_MODELS" not in one.start_script


def _server_pid(model_dir: str) -> int:
    """The pid of the stand-in vLLM serving ``model_dir`` (its argv names it)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if model_dir.encode() in argv and b"--served-model-name" in argv:
            return int(proc.name)
    return 0


def test_another_model_that_dies_ends_its_job_and_the_service_replaces_it(gpu_svc: Any) -> None:
    """The job's other model is supervised too: once its vLLM exits, the job ends (its log says why) and the
    keeper's restart policy launches a new job, in which both models serve again."""
    import signal

    alpha, beta = gpu_svc
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "heal", "--profile", "gpu1",
                   "--restart-backoff", "1s", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "heal")
    first = rec.slots[0].current
    assert first and rec.url
    run_dir = Path(JobStore().find(first).run_dir)
    os.kill(_server_pid(beta), signal.SIGKILL)
    wait_for(lambda: records.find(JobStore(), "heal").slots[0].current not in (None, first), 60,
             "a replacement job")
    assert "the vLLM of another model of this job" in (run_dir / "vllm.log").read_text()
    assert json.loads((run_dir / "server.json").read_text())["phase"] != "ready"
    wait_for(lambda: _answers(rec.url, rec.api_key, "b"), 90, "model b served again")
    assert chat(rec.url, rec.api_key, "a").json()["model"] == "a"


def test_the_service_lists_a_busy_model_at_once(gpu_svc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/models on a multi-model service lists every model the keeper keeps within a second or two, one whose
    server is too busy to answer included (on one H200 the look took 10 s and left the busy model out, issue 41):
    the front lists the router's registered models and asks their servers only to check the key."""
    import threading
    import time

    monkeypatch.setenv("PBSTK_TEST_STANDIN_SLOW_PROBES", "12")  # a full server answers /v1/models 12 s late
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SLOW_METRICS", "0")  # (the keeper still sees it busy, not dead)
    alpha, beta = gpu_svc
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "busy", "--profile", "gpu1",
                   "--vllm-arg=--max-num-seqs=1", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "busy")
    assert rec.url and rec.api_key
    headers = {"Authorization": f"Bearer {rec.api_key}"}
    first = requests.get(rec.url + "/models", headers=headers, timeout=30).json()["data"]
    assert sorted(m["id"] for m in first) == ["a", "b"], first
    body = {"model": "b", "prompt": "hi", "max_tokens": 2, "standin_delay_s": 15}
    hold = threading.Thread(target=lambda: requests.post(rec.url + "/completions", json=body, headers=headers,
                                                         timeout=60), daemon=True)
    hold.start()  # model b's one sequence slot is taken: its server's probes answer late
    wait_for(lambda: _running(rec.url, rec.api_key, "b"), 30, "model b's slot taken")
    began = time.monotonic()
    listed = requests.get(rec.url + "/models", headers=headers, timeout=30)
    took = time.monotonic() - began
    assert listed.status_code == 200, listed.text
    assert sorted(m["id"] for m in listed.json()["data"]) == ["a", "b"], listed.text
    assert took < 3.0, took
    assert listed.json()["data"] == first  # the busy one as its server listed it before
    wrong = requests.get(rec.url + "/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert wrong.status_code == 401, wrong.text  # model a's server still checks the key
    hold.join(60)


def _running(url: str, key: str, model: str) -> bool:
    """Whether ``model``'s server reports a request running (its own /metrics, on the job's node)."""
    job = records.find(JobStore(), "busy").slots[0].current
    marker = json.loads((Path(JobStore().find(job or "").run_dir) / "server.json").read_text())
    ports = [marker.get("port"), *(int(w.rsplit("@", 1)[1]) for w in (marker.get("models") or "").split())]
    for port in ports:
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except requests.RequestException:
            continue
        if any(line.startswith("vllm:num_requests_running") and f'model_name="{model}"' in line
               and not line.endswith(" 0.0") for line in text.splitlines()):
            return True
    return False


def _answers(url: str, key: str, model: str) -> bool:
    try:
        return chat(url, key, model).status_code == 200
    except requests.RequestException:  # the router between two jobs
        return False


def test_two_models_on_a_cpu_profile_share_one_job(isolated_user: Path, standins: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile without GPUs: both models in one job on the node's CPUs, no CUDA_VISIBLE_DEVICES and no memory
    share set for either, each answering to its own name through the one URL."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "cpu.yaml").write_text(
        "name: cpu\nscheduler: local\nnodes: 1\ngpus_per_node: 0\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nport: 8000\nrouter_command: {ROUTER}\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_CHECK_MODEL", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    root = isolated_user / "m"
    a, b = checkpoint(root, "alpha", 1_200_000_000), checkpoint(root, "beta", 1_200_000_000)
    try:
        result = pbstk("serve", f"{a}:name=a", f"{b}:name=b", "--name", "cpus", "--profile", "cpu", "--wait",
                       "--timeout", "90")
        assert result.exit_code == 0, result.output
        rec = records.find(JobStore(), "cpus")
        assert rec.url and len(rec.slots) == 1
        for model in ("a", "b"):
            assert chat(rec.url, rec.api_key, model).json()["model"] == model
        for line in (standins / "argv.jsonl").read_text().splitlines():
            start = json.loads(line)
            assert "--gpu-memory-utilization" not in start["argv"], start["argv"]
            assert not start["env"].get("CUDA_VISIBLE_DEVICES"), start["env"]
    finally:
        _stop_services()


def test_a_model_that_loses_its_port_to_another_process_starts_on_another(gpu_svc: Any, isolated_user: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A port is looked at, then bound by vLLM once its engine is up: another process may take it in between. The
    first start of each model exits "Address already in use" (the stand-in's knob): each is started again on
    another port, the job's other model as its first one always was, and the service serves both.
    Before: the other model's race failed the job ("exited before it was ready")."""
    alpha, beta = gpu_svc
    monkeypatch.setenv("PBSTK_TEST_STANDIN_LOSE_BIND_ONCE", f"{isolated_user / 'lost'}:a:b")
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "racy", "--profile", "gpu1", "--wait",
                   "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "racy")
    assert rec.url and rec.api_key
    assert (isolated_user / "lost.a").exists() and (isolated_user / "lost.b").exists()
    for model in ("a", "b"):
        answer = chat(rec.url, rec.api_key, model)
        assert answer.status_code == 200, answer.text
    job = rec.slots[0].current
    assert job is not None and rec.slots[0].jobs() == [job]  # the same job: no failure, no replacement
    log = (Path(JobStore().find(job).run_dir) / "vllm.log").read_text()
    assert "was taken while its vLLM started; trying another one" in log, log
    assert "was taken while vLLM started; trying another one" in log, log


def four_on_three_gpus(isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """Profile ``gpu3`` (local, three 80 GB GPUs, the real router) and four models' specs: the job's own model a and
    e each take a whole GPU, c and d (small) share the third; each stand-in vLLM listens 2 s after it starts."""
    root = multi_profile(isolated_user, monkeypatch, "gpu3", "scheduler: local\nport: 8000\n")
    profile = isolated_user / "config" / "pbstk" / "profiles" / "gpu3.yaml"
    profile.write_text(profile.read_text().replace("gpus_per_node: 1", "gpus_per_node: 3"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "2")
    a, e, c, d = (checkpoint(root, n, size) for n, size in (("a", 3_400_000_000), ("e", 3_400_000_000),
                                                            ("c", 1_200_000_000), ("d", 1_200_000_000)))
    return f"{a}:name=a:preset=single", f"{e}:name=e:preset=single", f"{c}:name=c", f"{d}:name=d"


def test_models_on_other_gpus_start_side_by_side_and_on_one_gpu_in_turn(isolated_user: Path, standins: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One job on three GPUs: the job's own model a on one, e on another, c and d (small) share the third. a, e
    and c start at once; d waits until c listens; the job is READY once all four listen. Before, every model waited
    for the one before it: a job paid the sum of its models' starts (on a lent H100 host 92-122 s each) where the
    longest was enough."""
    specs = four_on_three_gpus(isolated_user, monkeypatch)
    try:
        plan = json.loads(pbstk("serve", *specs, "--name", "four", "--profile", "gpu3", "--dry-run", "--json").stdout)
        gpus = {m["served_model_name"]: m["gpus"] for m in plan["models"]}
        assert len({m["job"] for m in plan["models"]}) == 1, plan
        assert plan["models"][0]["served_model_name"] == "a" and gpus["c"] == gpus["d"] != gpus["e"] != gpus["a"]
        result = pbstk("serve", *specs, "--name", "four", "--profile", "gpu3", "--wait", "--timeout", "120")
        assert result.exit_code == 0, result.output
        rec = records.find(JobStore(), "four")
        run_dir = Path(JobStore().find(rec.slots[0].current).run_dir)
        lines = [line for line in (run_dir / "vllm.log").read_text().splitlines() if line.startswith("pbstk:")]

        def at(text: str) -> int:
            return next(i for i, line in enumerate(lines) if text in line)

        started = max(at("model e: starting"), at("model c: starting"), at("attempt 1: starting vLLM"))
        assert started < min(at("model e is listening"), at("model c is listening")), lines  # side by side
        assert at("model c is listening") < at("model d: starting"), lines  # in turn on c's GPU
        assert at("model d is listening") < at("vLLM is listening"), lines  # READY once every model listens
        doc = json.loads(pbstk("status", "four", "--json").stdout)[0]
        assert {m["served_model_name"]: m["state"] for m in doc["models"]} == dict.fromkeys("aecd", "READY"), doc
        for model in ("a", "e", "c", "d"):
            answer = chat(rec.url, rec.api_key, model)
            assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        assert pbstk("cancel", "four").exit_code == 0
    finally:
        _stop_services()


def test_a_model_that_dies_beside_the_starting_first_model_fails_the_job_with_its_cause(
        isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """e dies at start (vLLM 0.22.1's KV-cache ValueError) while the job's own model a starts beside it: the job fails
    naming e's cause, and a's vLLM does not outlive it."""
    specs = four_on_three_gpus(isolated_user, monkeypatch)
    monkeypatch.setenv("PBSTK_TEST_STANDIN_KV_SHORT", "e")
    try:
        result = pbstk("serve", *specs, "--name", "four", "--profile", "gpu3", "--max-restarts", "0", "--wait",
                       "--timeout", "90")
        assert result.exit_code == 5, result.output
        assert "model e exited before it was ready: ValueError: To serve at least one request" in result.stderr
        run_dir = Path(JobStore().find(records.find(JobStore(), "four").slots[0].current).run_dir)
        log = (run_dir / "vllm.log").read_text()
        assert log.index("attempt 1: starting vLLM") < log.index("model e exited"), log  # a had started
        assert json.loads((run_dir / "server.json").read_text())["phase"] == "failed"
        pid = int(json.loads((run_dir / "server.json").read_text())["pid"])
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 20, "the first model's vLLM to end")
    finally:
        _stop_services()
