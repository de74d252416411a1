"""GPUs as resources (issue 42): the plan is what runs, the job asks for what it uses, the local scheduler books
GPUs, packing fills them. Real parts: the rendered job and start scripts run by bash under the fake PBS or the
local scheduler, the stand-in vLLM on the stand-in GPUs (tests/standins/gpus.py: a world larger than its visible
GPUs, or a share the memory left cannot hold, fails as vLLM does), the real vllm-router, the real keeper.

Before (pbstk 1a9bcc9): on a node of 2 or 4 GPUs each packed model got the node's DP layout with one GPU visible
and died (``World size (4) is larger than the number of available GPUs (1)``); the job asked PBS for the first
model's GPUs only; two one-GPU local jobs both got every GPU; a packed 0.6B and 1.7B got 0.10 of a GPU each.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import pbstk, status_of, wait_for
from test_serve_models import checkpoint
from test_serve_models_run import ROUTER
from test_service import _stop_services

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.models import packing

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def _profile(isolated_user: Path, name: str, text: str) -> None:
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.yaml").write_text(
        f"name: {name}\n{text}cpus_per_node: 2\nwalltime: '00:10:00'\naddress: loopback\nbind_host: 127.0.0.1\n"
        f"router_command: {ROUTER}\n")


@pytest.fixture
def trio(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """1.2, 3.4 and 8 GB checkpoints; the keeper looking every 0.5 s; the stand-in listening at once."""
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    root = isolated_user / "m"
    yield [checkpoint(root, name, size) for name, size in (("small", 1_200_000_000), ("mid", 3_400_000_000),
                                                             ("q4b", 8_000_000_000))]
    _stop_services()


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_the_plan_is_what_runs_on_nodes_of_1_2_and_4_gpus(gpus: int, trio: Any, isolated_user: Path, fakepbs: Path,
                                                          standins: Path) -> None:
    """Three models planned on nodes of ``gpus`` GPUs of 80 GB, then served under the fake PBS: each vLLM runs
    with exactly its row's GPUs (CUDA_VISIBLE_DEVICES), share and layout (its own GPUs', never the node's), and
    each job asks PBS for every GPU its rows use."""
    _profile(isolated_user, f"pbs{gpus}", f"scheduler: pbs\nrouter: local\nnodes: 1\ngpus_per_node: {gpus}\n"
                                          "gpu_memory_gb: 80\n")
    specs = [f"{path}:name=g{gpus}-{Path(path).name}" for path in trio]
    common = ("--name", f"e{gpus}", "--profile", f"pbs{gpus}")
    plan = json.loads(pbstk("serve", *specs, *common, "--dry-run", "--json").stdout)
    rows = {m["served_model_name"]: m for m in plan["models"]}
    served = pbstk("serve", *specs, *common, "--wait", "--timeout", "120")
    assert served.exit_code == 0, served.output
    starts = {a[a.index("--served-model-name") + 1]: (a, e) for a, e in _starts(standins)}
    assert set(starts) == set(rows), (starts.keys(), rows.keys())
    for name, row in rows.items():
        argv, env = starts[name]
        assert env.get("CUDA_VISIBLE_DEVICES") == ",".join(str(g) for g in row["gpus"]), (name, row, env)
        assert float(_flag(argv, "--gpu-memory-utilization")) == row["gpu_memory_utilization"], (name, row, argv)
        assert _flag(argv, "--data-parallel-size") is None, (name, argv)  # its layout, not the node's
        assert int(_flag(argv, "--tensor-parallel-size") or 1) == len(row["gpus"]), (name, row, argv)
    rec = records.find(JobStore(), f"e{gpus}")
    for slot in rec.slots:
        script = (Path(JobStore().find(slot.current or "").run_dir) / "job.pbs").read_text()
        used = {g for row in rows.values() if row["job"] == slot.index + 1 for g in row["gpus"]}
        assert f"ngpus={max(used) + 1}" in script, (slot.index, used, script[:400])
    doc = json.loads(pbstk("status", f"e{gpus}", "--json").stdout)[0]
    assert {m["state"] for m in doc["models"]} == {"READY"}, doc["models"]
    # the packed GPUs are given out whole: the shares on one GPU add up to the cap, not to the needs
    for (job, gpu), shares in _shares_by_gpu(rows).items():
        assert round(sum(shares), 2) == packing.SHARE_CAP, (job, gpu, shares)
    assert pbstk("cancel", f"e{gpus}").exit_code == 0


def _starts(record: Path) -> list[tuple[list[str], dict[str, str]]]:
    """Each stand-in start's argv and environment (the last start of a served name wins in a dict)."""
    return [(json.loads(line)["argv"], json.loads(line)["env"])
            for line in (record / "argv.jsonl").read_text().splitlines()]


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _shares_by_gpu(rows: dict[str, Any]) -> dict[tuple[int, int], list[float]]:
    out: dict[tuple[int, int], list[float]] = {}
    for row in rows.values():
        if len(row["gpus"]) == 1:
            out.setdefault((row["job"], row["gpus"][0]), []).append(row["gpu_memory_utilization"])
    return out


def test_one_model_dry_run_shows_the_layout_its_replicas_run(trio: Any, isolated_user: Path) -> None:
    """``serve mid --dry-run`` on nodes of 4 GPUs: each replica's job as it runs (``auto`` sized for the node:
    DP4 on GPUs 0-3 at 0.95), not a packed model's share of one GPU."""
    _profile(isolated_user, "pbs4", "scheduler: pbs\nnodes: 1\ngpus_per_node: 4\ngpu_memory_gb: 80\n")
    plan = json.loads(pbstk("serve", trio[1], "--profile", "pbs4", "--replicas", "2", "--dry-run", "--json").stdout)
    assert [(m["job"], m["gpus"], m["gpu_memory_utilization"]) for m in plan["models"]] == [
        (1, [0, 1, 2, 3], 0.95), (2, [0, 1, 2, 3], 0.95)], plan
    assert plan["models"][0]["preset"] == "auto (DP4)", plan
    rendered = pbstk("launch", trio[1], "--profile", "pbs4", "--dry-run", "--json")
    assert "--data-parallel-size" in json.loads(rendered.stdout)["vllm_args"], rendered.stdout


def test_packing_gives_each_gpu_out_whole() -> None:
    """On one GPU of 140 GB, a 0.6B and a 1.7B got 0.10 each (0.8 of the GPU unused, KV cache neither could
    use); now the GPU's cap is shared in proportion to what each needs."""
    res = packing.Resources(gpus_per_node=1, gpu_memory_gb=140)
    needs = [packing.ModelNeed("a", "a", "auto", params_b=0.6), packing.ModelNeed("b", "b", "auto", params_b=1.7),
             packing.ModelNeed("c", "c", "auto", params_b=8.0)]
    shares = {p.served: p.share for p in packing.pack(needs[:2], res).placements}
    assert shares == {"a": 0.45, "b": 0.45}, shares
    three = {p.served: p.share for p in packing.pack(needs, res).placements}
    assert three["c"] > max(three["a"], three["b"]) and abs(three["a"] - three["b"]) <= 0.011, three
    assert round(sum(three.values()), 2) == packing.SHARE_CAP, three


def test_the_local_scheduler_books_gpus(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two one-GPU launches where the submitting shell leaves one GPU (CUDA_VISIBLE_DEVICES=2 of four): the first
    gets GPU 2, the second waits QUEUED with the reason (``jobs`` and ``status`` say it), and starts on GPU 2 once
    the first has ended. Before, both got every GPU the shell named. (``pbstk jobs`` reads only the job store,
    never the scheduler: it shows the job as recorded.)"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    launch = ("--profile", "local-gpu", "--preset", "single", "--port", "auto", "--json")
    first = json.loads(pbstk("launch", "Qwen/Qwen3-0.6B", "--name", "one", *launch).stdout)["job_id"]
    wait_for(lambda: status_of(first)["state"] == "READY", 60, "the first job READY")
    second = json.loads(pbstk("launch", "Qwen/Qwen3-0.6B", "--name", "two", *launch).stdout)["job_id"]
    # the supervisor's first word, "waiting for 1 free GPU(s)", becomes the booking's reason within its first look
    reason = re.compile(rf"waiting for 1 free GPU of 1 \(held by {re.escape(first)}\)")
    wait_for(lambda: (st := status_of(second))["state"] == "PENDING" and reason.search(st.get("comment") or ""), 30,
             "the second job queued with the booking's reason")
    listed = pbstk("status")  # every active job, the queued one with its reason
    assert "waiting for 1 free GPU of 1" in listed.stdout, listed.stdout
    assert pbstk("cancel", first).exit_code == 0
    wait_for(lambda: status_of(second)["state"] == "READY", 60, "the second job READY once the GPU is free")
    envs = [e for _a, e in _starts(standins)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "2"], envs
    assert pbstk("cancel", second).exit_code == 0


def test_local_gpus_count_and_memory_come_from_the_machine(isolated_user: Path, standins: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A local profile that does not say its GPUs gets this machine's (the stand-in nvidia-smi: 4 of 81559 MiB,
    79 GiB), and its sources say so; one that says them keeps its own."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _profile(isolated_user, "ws", "scheduler: local\nnodes: 1\n")
    doc = json.loads(pbstk("config", "show", "--profile", "ws", "--json").stdout)
    values = {k: (v["value"], v["source"]) for k, v in doc["settings"].items()} if "settings" in doc else {}
    assert values.get("gpus_per_node", (None,))[0] == 4 and "this machine" in values["gpus_per_node"][1], doc
    assert values.get("gpu_memory_gb", (None,))[0] == 79 and "this machine" in values["gpu_memory_gb"][1], doc
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    doc = json.loads(pbstk("config", "show", "--profile", "ws", "--json").stdout)
    assert doc["settings"]["gpus_per_node"]["value"] == 2, doc
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
