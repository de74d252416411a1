"""Swapping and keep-alive together (issue 31, items 3 and 4): `pbstk serve A B --max-awake 1 --keep-alive` on the
local scheduler. The successor is the same planned job: both models, and a swapper of its own (at most 1 awake on
its GPU), on GPUs its predecessor does not hold (the predecessor's sleepers still hold memory there). A client
sending to both models in turn sees no failed request across the handover. The stand-in vLLM's sleep mode, the real
vllm-router (multi-model mode), the real keeper.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import pbstk, wait_for
from test_serve_models import refused
from test_serve_models_keepalive import both_models, handed_over, job_urls, workers
from test_serve_models_run import chat
from test_serve_models_swap import ROUTER, swap_svc  # noqa: F401 - swap_svc: the fixture
from test_service import Load

from pbs_toolkit.client import Client
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper import slots as keeper_slots
from pbs_toolkit.services.record import Slot

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def swap_json(job: str) -> dict[str, Any]:
    """The job's swapper's view (RUN_DIR/swap.json): each model's awake, wakes, sleeps; {} before its first write."""
    path = Path(JobStore().find(job).run_dir, "swap.json")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc.get("models", doc) if isinstance(doc, dict) else {}


def awake_in(job: str) -> list[str]:
    return sorted(m for m, view in swap_json(job).items() if isinstance(view, dict) and view.get("awake"))


def gpus_of(standins: Path, job: str) -> set[str]:
    """The CUDA_VISIBLE_DEVICES of every vLLM the job started (the stand-in records each start)."""
    starts = [json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines()]
    run_dir = str(JobStore().find(job).run_dir)
    return {s["env"].get("CUDA_VISIBLE_DEVICES", "") for s in starts if run_dir in json.dumps(s)}


def both_named(first: str, successor: str) -> str | None:
    """`pbstk status ksw` while both jobs run (the successor started, the first still current): its table."""
    out = pbstk("status", "ksw").stdout
    started = any(line.split()[1:4] in (["successor", successor, "ksw-r0-g1"],) and line.split()[4] != "PENDING"
                  for line in out.splitlines() if line.startswith("r0 "))
    return out if started and records.find(JobStore(), "ksw").slots[0].current == first else None


def turns(rec: records.ServiceRecord) -> Any:
    """``both_models`` with room for a swap: each call may wait for a sleep and a wake, never be refused."""
    return both_models(rec, timeout=30)


def test_keep_alive_of_swapping_models_hands_over_with_zero_failures(swap_svc: Any, standins: Path,  # noqa: F811
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs on this machine, one a job: the successor swaps on the other GPU, its own swapper keeps at most
    one model awake there, status names both jobs while they overlap, and 0 requests fail."""
    big, mid = swap_svc
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "3")
    result = pbstk("serve", f"{big}:name=a", f"{mid}:name=b", "--name", "ksw", "--profile", "gpu1",
                   "--max-awake", "1", "--keep-alive", "--walltime", "00:01:00", "--handover", "45", "--wait",
                   "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "ksw")
    first = rec.slots[0].current
    assert first and rec.url and rec.keep_alive
    wait_for(lambda: workers(rec) == job_urls(first), 30, "both models of the first job in the router")
    wait_for(lambda: len(swap_json(first)) == 2, 30, "the first job's swapper")

    with Load(turns(rec), threads=2, limit_s=150) as load:
        wait_for(lambda: records.find(JobStore(), "ksw").slots[0].successor, 30, "a successor")
        successor = records.find(JobStore(), "ksw").slots[0].successor
        assert successor
        overlap = wait_for(lambda: both_named(first, successor), 45, "status naming both jobs running",
                           interval=0.05)
        wait_for(lambda: len(swap_json(successor)) == 2, 60, "the successor's swapper")
        assert handed_over("ksw", first, rec, load, more=10, within=60) == successor
    print(f"swapping keep-alive handover under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
    print(overlap)
    rows = {line.split()[1]: line.split()[2] for line in overlap.splitlines() if line.startswith("r0 ")}
    assert rows == {"current": first, "successor": successor}, overlap  # the replica table: both jobs
    assert load.failed == 0, load.errors
    assert load.ok >= 20

    # the successor swaps too: its own swapper, at most one awake on its GPU, both models switched under the load
    assert len(awake_in(successor)) <= 1, swap_json(successor)
    assert all(view["wakes"] >= 1 for view in swap_json(successor).values()), swap_json(successor)
    # ... on the other GPU: the predecessor's sleeper still held memory on GPU 0
    assert gpus_of(standins, first) == {"0"} and gpus_of(standins, successor) == {"1"}, (
        gpus_of(standins, first), gpus_of(standins, successor))
    doc = json.loads(pbstk("status", "ksw", "--json").stdout)[0]
    models = {m["served_model_name"]: m for m in doc["models"]}
    assert set(models) == {"a", "b"} and all(m["job"] == successor for m in models.values()), doc["models"]
    assert sum(bool((m.get("swap") or {}).get("awake")) for m in models.values()) <= 1, doc["models"]
    table = pbstk("status", "ksw").stdout
    assert "AWAKE" in table and "asleep" in table, table
    assert workers(rec) == job_urls(successor)
    wait_for(lambda: pbstk("status", first, "--json").exit_code == 0 and JobStore().find(first).final_state
             == "CANCELLED", 20, "the predecessor CANCELLED")
    assert pbstk("cancel", "ksw").exit_code == 0


def test_keep_alive_of_swapping_models_without_gpus_for_the_successor_is_refused(
        swap_svc: Any) -> None:  # noqa: F811
    """One GPU on this machine: the successor would start beside its predecessor's models on the same GPU, whose
    swap set fills it (the sleeper's 2.5 GB and the awake model's share); on real GPUs its vLLM could not start.
    One line, exit 2, nothing written or started. With two GPUs (the test above) it is served."""
    big, mid = swap_svc
    refused(pbstk("serve", f"{big}:name=a", f"{mid}:name=b", "--name", "k1", "--profile", "gpu1", "--max-awake",
                  "1", "--keep-alive", "--walltime", "00:01:00", "--handover", "45"),
            "needs 2 GPU(s) of this machine at once", "keep-alive successor overlap", "it has 1",
            "CUDA_VISIBLE_DEVICES")


def test_a_request_held_for_a_sleeping_model_keeps_its_job_from_being_drained(
        swap_svc: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A handed-over (or scaled-down) job is cancelled once its servers run no request. A request held for a
    sleeping model (waiting for its wake: up to seconds on GPUs) is in none of vLLM's metrics; its guard counts it.
    The keeper's drain (keeper_slots.drain, as its tick calls it) waits for it, and cancels the job once answered.
    Before, the drain cut it off (a streaming answer is not retried by the router)."""
    monkeypatch.setenv("PBSTK_TEST_STANDIN_WAKE_S", "6")  # b's wake: longer than the drain's first look (2 s)
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "60")
    big, mid = swap_svc
    result = pbstk("serve", f"{big}:name=a", f"{mid}:name=b", "--name", "hd", "--profile", "gpu1", "--max-awake",
                   "1", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "hd")
    job = rec.slots[0].current
    assert job and rec.url
    wait_for(lambda: awake_in(job) == ["a"], 30, "a awake, b asleep")
    run_dir = Path(JobStore().find(job).run_dir)
    answers: list[int] = []
    sender = threading.Thread(target=lambda: answers.append(chat(rec.url or "", rec.api_key, "b").status_code))
    sender.start()
    wait_for(lambda: any("a request is held" in p.read_text() for p in run_dir.glob("vllm*.log")), 30,
             "the request for b held by its sleeping engine")
    slot = Slot(0, draining=job, drain_started=time.time() - 3)  # past the drain's first 2 s
    with Client(on_removal=lambda r: None) as client:
        session = client.service_session()

        def drained() -> bool:
            keeper_slots.drain(session, slot, {job: session.status([JobStore().find(job)])[0]})
            return slot.draining is None

        assert not drained() and awake_in(job) != ["b"], "drained while b's request waited for its wake"
        sender.join(60)
        assert answers == [200], answers
        wait_for(drained, 30, "the drain, once b's request was answered")
    wait_for(lambda: pbstk("status", job, "--json").exit_code == 0 and JobStore().find(job).final_state
             == "CANCELLED", 20, "the drained job CANCELLED")
    assert pbstk("cancel", "hd").exit_code == 0
