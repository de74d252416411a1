"""`pbstk serve A B --max-awake 1` swaps models on one GPU by vLLM's sleep mode (issue 31, item 3): the planner
puts two models that do not fit awake together on one GPU, the job starts both with sleep mode and the guard of
their development endpoints, and the swapper beside them wakes the one a request asks for (the request waits; it
is never refused) after putting the other to sleep. The stand-in vLLM (sleep mode as vLLM serves it, `--middleware`
run on every request), the real vllm-router in its multi-model mode, the real keeper, the local scheduler.

Before: `--max-awake` did not exist (exit 2), and two such models were planned into two jobs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import pbstk, wait_for
from test_serve_models import checkpoint
from test_serve_models_run import ROUTER, argv_of, chat, multi_profile
from test_service import _stop_services

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def swap_svc(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One 80 GB GPU (local scheduler), two models of 40 and 28 GB of weights: 0.75 and 0.50 of it, too much for
    both awake; the real router; waking takes 0.3 s."""
    root = multi_profile(isolated_user, monkeypatch, "gpu1", "scheduler: local\nport: 8000\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_WAKE_S", "0.3")
    yield checkpoint(root, "big", 40_000_000_000), checkpoint(root, "mid", 28_000_000_000)
    _stop_services()


def swap_view(name: str) -> dict[str, Any]:
    doc = json.loads(pbstk("status", name, "--json").stdout)[0]
    return {m["served_model_name"]: m.get("swap") or {} for m in doc["models"]}


def awake(name: str) -> set[str]:
    return {served for served, view in swap_view(name).items() if view.get("awake")}


def test_two_models_swap_on_one_gpu_and_a_request_wakes_its_model(swap_svc: Any, standins: Path) -> None:
    big, mid = swap_svc
    plan = pbstk("serve", f"{big}:name=big", f"{mid}:name=mid", "--name", "sw", "--profile", "gpu1",
                 "--max-awake", "1", "--dry-run", "--json")
    assert plan.exit_code == 0, plan.output
    rows = {m["served_model_name"]: m for m in json.loads(plan.stdout)["models"]}
    assert {m["job"] for m in rows.values()} == {1} and all(m["swap"] for m in rows.values()), rows
    # either awake beside the other asleep (2.5 GB) fits in 0.90 of the GPU, each with its need and the rest
    assert (rows["big"]["gpu_memory_utilization"], rows["mid"]["gpu_memory_utilization"]) == (0.86, 0.61)

    result = pbstk("serve", f"{big}:name=big", f"{mid}:name=mid", "--name", "sw", "--profile", "gpu1",
                   "--max-awake", "1", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "sw")
    assert rec.url and rec.api_key
    starts = [json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines()]
    for start in starts:  # sleep mode, its development endpoints, and their guard: in every model's vLLM
        argv, env = start["argv"], start["env"]
        assert "--enable-sleep-mode" in argv and argv[argv.index("--middleware") + 1] == "pbstk_dev_guard.DevGuard"
        assert "--api-server-count" not in argv  # the guard counts requests in one process (front_servers.py)
        assert env.get("VLLM_SERVER_DEV_MODE") == "1" and env.get("PBSTK_DEV_GUARD_KEY_FILE", "").endswith("api_key")
    assert sorted(a[a.index("--served-model-name") + 1] for a in argv_of(standins)) == ["big", "mid"]
    wait_for(lambda: awake("sw") == {"big"}, 30, "the swapper's first view: the job's own model awake, mid asleep")

    for model in ("mid", "big", "mid", "mid", "big"):  # a client that retries nothing
        answer = chat(rec.url, rec.api_key, model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
        assert awake("sw") == {model}  # at most one awake, and the one just asked for
    views = swap_view("sw")
    assert views["mid"]["wakes"] >= 2 and views["big"]["sleeps"] >= 2, views
    assert 0.3 <= views["mid"]["last_wake_s"] < 30 and views["big"]["last_sleep_s"] is not None, views
    table = pbstk("status", "sw")
    assert "AWAKE" in table.stdout and "asleep" in table.stdout, table.stdout

    # both models asked at once, from several clients: every request answered, none refused
    failures: list[str] = []

    def client(model: str) -> None:
        for _ in range(4):
            answer = chat(rec.url, rec.api_key, model)
            if answer.status_code != 200:
                failures.append(f"{model}: {answer.status_code} {answer.text[:200]}")

    threads = [threading.Thread(target=client, args=(m,)) for m in ("big", "mid", "big", "mid")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == [] and not any(t.is_alive() for t in threads), failures

    # the development endpoints sleep mode needs answer only with the service's key; the probes stay open
    doc = json.loads(pbstk("status", "sw", "--json").stdout)[0]
    server = next(m["server"] for m in doc["models"] if m["served_model_name"] == "mid")
    for path in ("/sleep?level=1", "/wake_up"):
        assert requests.post(server + path, timeout=10).status_code == 401
        assert requests.post(server + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert requests.get(server + "/is_sleeping", timeout=10).status_code == 401
    mine = requests.get(server + "/is_sleeping", headers={"Authorization": f"Bearer {rec.api_key}"}, timeout=10)
    assert mine.status_code == 200 and "is_sleeping" in mine.json()
    assert requests.get(server + "/health", timeout=10).status_code == 200
    assert requests.get(server + "/metrics", timeout=10).status_code == 200

    run_dir = Path(JobStore().find(doc["models"][0]["job"]).run_dir)
    events = [json.loads(line) for line in (run_dir / "models.events.jsonl").read_text().splitlines()]
    assert {e["model"] for e in events} == {"big", "mid"} and {e["event"] for e in events} == {"awake", "asleep"}
    assert pbstk("cancel", "sw").exit_code == 0
    wait_for(lambda: not _swapper_running(run_dir), 30, "the swapper ended with its job")


def _swapper_running(run_dir: Path) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"pbstk_swapper.py") for part in cmdline) and str(run_dir).encode() in b" ".join(cmdline):
            return True
    return False


def test_a_model_whose_memory_grows_asleep_has_its_job_replaced(swap_svc: Any, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """vLLM's sleep-mode leak (vllm#36651): each sleep of the stand-in leaves 1.5 GiB more behind; past 2 GiB over
    a model's first sleep the swapper ends the job, and the service's restart policy replaces it."""
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SLEEP_LEAK_GIB", "1.5")
    big, mid = swap_svc
    result = pbstk("serve", f"{big}:name=big", f"{mid}:name=mid", "--name", "leaky", "--profile", "gpu1",
                   "--max-awake", "1", "--restart-backoff", "1s", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "leaky")
    first = rec.slots[0].current
    run_dir = Path(JobStore().find(first).run_dir)
    for model in ("mid", "big", "mid", "big", "mid"):  # big: asleep at 1.0 + 1.5 (start), then + 1.5 each time
        if records.find(JobStore(), "leaky").slots[0].current != first:
            break
        try:
            chat(rec.url, rec.api_key, model)
        except requests.RequestException:
            pass  # the last ones may meet the job ending: its replacement answers later
    wait_for(lambda: "vLLM's sleep-mode leak; ending the job" in (run_dir / "vllm.log").read_text(), 60,
             "the swapper names the leak")
    wait_for(lambda: records.find(JobStore(), "leaky").slots[0].current not in (None, first), 90,
             "the service replaced the job")
    ended = json.loads(pbstk("status", first, "--json").stdout)[0]
    assert ended["state"] == "FAILED", ended  # a failure the service heals, not a cancel
    assert "the model swapper" in (run_dir / "vllm.log").read_text()
