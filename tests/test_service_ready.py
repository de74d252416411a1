"""READY means routable (docs/services.md "READY means routable"), on the real vllm-router, stand-in replicas on
the local scheduler and the real detached keeper: ``serve --wait`` returns only when a request through the
service URL is served, a replica joins the router about a second after it answers (not a keeper tick later),
``status`` counts what the router routes, and a keep-alive successor gets a free GPU."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import pbstk, wait_for
from test_service import ROUTER, chat, serve, service_json, svc_profile  # noqa: F401 - svc_profile: a fixture

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import keeper_alive, service_dir

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


class Watch:
    """A thread that notes, every 0.05 s, when replica ``job``'s server first answered ``/health`` and when the
    router first listed it (bounded; stopped by the test)."""

    def __init__(self, service: str, job: str) -> None:
        self.service, self.job = service, job
        self.up: float | None = None
        self.joined: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        store = JobStore()
        while not self._stop.is_set() and time.monotonic() < deadline and self.joined is None:
            try:
                rec = records.load(store, self.service)
                marker = json.loads(Path(store.find(self.job).run_dir, "server.json").read_text())
                worker = f"http://127.0.0.1:{marker['port']}"
                if self.up is None and requests.get(worker + "/health", timeout=1).status_code == 200:
                    self.up = time.monotonic()
                if rec is not None and rec.router and worker in requests.get(
                        f"http://127.0.0.1:{rec.router['port']}/list_workers", timeout=1).json()["urls"]:
                    self.joined = time.monotonic()
            except (OSError, ValueError, KeyError, requests.RequestException, Exception):  # noqa: BLE001 - not yet
                pass
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_serve_wait_returns_when_routable_and_a_replica_joins_within_2_s(svc_profile: str,  # noqa: F811
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper's default 15 s tick and a scheduler ramp of 1 s then 15 s: only the keeper's probe of the
    starting replica (and serve's cheap look at the router) can make this fast. The replica takes 4 s to answer,
    so the keeper's second look (1 s) sees it starting with its address. Also: power_of_two with one replica."""
    monkeypatch.delenv("PBSTK_SERVICE_POLL_S")  # the default: 15 s
    monkeypatch.setenv("PBSTK_POLL_INTERVALS", "1,15")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "4")
    watch = Watch("rt", "rt-r0")
    try:
        result = serve("--replicas", "1", "--name", "rt", "--policy", "power_of_two", "--wait", "--timeout", "60")
        returned = time.monotonic()
    finally:
        watch.stop()
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "rt")
    assert rec.url and chat(rec.url, rec.api_key).status_code == 200  # the first request is served, no 503
    assert watch.up is not None and watch.joined is not None, (watch.up, watch.joined)
    print(f"joined the router {watch.joined - watch.up:.2f} s after answering; serve returned "
          f"{returned - watch.joined:.2f} s after that")
    assert watch.joined - watch.up < 2.0
    assert returned - watch.joined < 2.0
    assert "ready: http://127.0.0.1:" in result.stdout and "READY 1/1 replicas" in result.stdout, result.output
    doc = service_json("rt")
    assert (doc["state"], doc["ready"], doc["route_status"], doc["policy"]) == ("READY", 1, 200, "power_of_two")
    assert len(doc["router_workers"]) == 1
    assert pbstk("cancel", "rt").exit_code == 0


def test_status_counts_what_the_router_routes_and_a_dead_router_is_down_0_of_n(svc_profile: str) -> None:  # noqa: F811
    result = serve("--replicas", "1", "--name", "dn", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "dn")
    base = f"http://127.0.0.1:{rec.router['port']}"
    wait_for(lambda: requests.get(base + "/list_workers", timeout=5).json()["urls"], 10, "the replica in the router")
    keeper = json.loads((service_dir("dn") / "keeper.json").read_text())["pid"]
    os.kill(keeper, signal.SIGKILL)  # nobody puts the replica back into the router
    wait_for(lambda: not keeper_alive("dn"), 10, "the keeper gone")
    (worker,) = requests.get(base + "/list_workers", timeout=5).json()["urls"]
    owner = {"X-Pbstk-Router-Token": rec.router["admin_token"]}  # the front lets only the owner change workers
    assert requests.post(base + "/remove_worker", params={"url": worker}, headers=owner, timeout=5).ok

    doc = service_json("dn")  # the job is READY, but nothing is routable through the URL
    assert doc["jobs"][0]["state"] == "READY"
    assert (doc["state"], doc["ready"], doc["router_workers"], doc["route_status"]) == ("DOWN", 0, [], 503), doc
    shown = pbstk("status", "dn").stdout
    assert shown.startswith("service dn: DOWN 0/1 replicas"), shown
    assert "0 worker(s), a request with the key: 503" in shown, shown

    os.killpg(rec.router["pid"], signal.SIGKILL)  # the router's wrapper leads its process group
    doc = wait_for(lambda: (d := service_json("dn"))["router_running"] is False and d, 10, "the router gone")
    assert (doc["state"], doc["ready"]) == ("DOWN", 0), doc
    assert "DOWN 0/1 replicas" in pbstk("status").stdout
    assert pbstk("cancel", "dn").exit_code == 0


def test_a_keep_alive_successor_gets_a_free_gpu_not_its_predecessors(svc_profile: str, standins: Path) -> None:  # noqa: F811
    """The local scheduler, 4 GPUs (the stand-in nvidia-smi), 1 GPU per replica: the successor overlaps its
    predecessor, so it books a GPU its predecessor does not hold (schedulers/local/gpus.py)."""
    result = serve("--replicas", "1", "--name", "gp", "--keep-alive", "--walltime", "00:01:10", "--handover", "60",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    slot = wait_for(lambda: (s := records.find(JobStore(), "gp").slots[0]).successor and s, 15, "a queued successor")

    def booked(job: str) -> str | None:  # what the local scheduler gave the job, once it started
        path = Path(JobStore().find(job).run_dir, ".local-job", "gpus")
        return path.read_text().strip() if path.exists() else None

    assert booked(slot.current or "") == "0"
    wait_for(lambda: booked(slot.successor or ""), 60, "the successor started (10 s before the handover)")
    assert booked(slot.successor or "") == "1"  # beside its predecessor, on a GPU of its own
    started = wait_for(lambda: len(s := [json.loads(line)["env"].get("CUDA_VISIBLE_DEVICES") for line in
                                         (standins / "argv.jsonl").read_text().splitlines()]) == 2 and s, 30,
                       "both servers started")
    assert started == ["0", "1"], started  # what each server really got
    assert pbstk("cancel", "gp").exit_code == 0

