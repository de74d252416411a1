"""Autoscaling services and ``--idle-cancel`` on a service, for real: replica jobs on the local scheduler running
the stand-in vLLM (``--max-num-seqs`` is its capacity; the rest wait and are reported as
``vllm:num_requests_waiting``), the real vllm-router, the real detached keeper. Loopback only, bounded waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import MODEL, pbstk, wait_for
from test_service import ROUTER, service_json, svc_profile  # noqa: F401 - the fixture

from pbs_toolkit.endpoints.registry import read_endpoints
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

pytestmark = [pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python"),
              pytest.mark.usefixtures("svc_profile")]


def serve(*args: str) -> Any:
    return pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", *args)


class Load:
    """``workers`` clients in closed loop through the router, each request taking ``delay`` s on a replica."""

    def __init__(self, url: str, key: str, workers: int, delay: float) -> None:
        self.url, self.key, self.delay = url, key, delay
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(workers)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "standin_delay_s": self.delay}
        while not self.stop.is_set():
            try:
                answer = requests.post(self.url + "/completions", json=body, timeout=60,
                                       headers={"Authorization": f"Bearer {self.key}"})
                good, why = answer.status_code == 200, f"HTTP {answer.status_code}: {answer.text[:100]}"
            except requests.RequestException as exc:
                good, why = False, str(exc)
            with self.lock:
                if good:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(why)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(70)


def test_an_autoscaling_service_grows_under_a_queue_and_shrinks_when_idle() -> None:
    # with keep-alive: every replica, the added one too, gets its successor (queued until its handover time)
    result = serve("--name", "auto", "--min-replicas", "1", "--max-replicas", "2", "--scale-up-waiting", "1",
                   "--scale-down-idle", "2s", "--vllm-arg=--max-num-seqs=2", "--keep-alive", "--handover", "5m",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    doc = service_json("auto")
    assert (doc["replicas"], doc["ready"]) == (1, 1) and doc["autoscale"]["spec"]["max_replicas"] == 2
    key = records.find(JobStore(), "auto").api_key
    assert key
    heavy = Load(doc["url"], key, workers=8, delay=0.5)  # 8 at once on a capacity of 2: 6 wait
    try:
        grown = wait_for(lambda: (d := service_json("auto"))["ready"] == 2 and d, 60, "a second replica in use")
    finally:
        heavy.finish()
    assert grown["replicas"] == 2 and grown["autoscale"]["last"]["action"] == "up", grown["autoscale"]
    assert "waiting" in grown["autoscale"]["last"]["reason"]
    assert [s["index"] for s in grown["slots"]] == [0, 1]
    shown = pbstk("status", "auto").stdout
    assert "autoscaling 1..2: target 2, 2 routable; last: up at" in shown, shown
    assert heavy.failed == 0 and heavy.ok > 8, heavy.errors[:3]

    light = Load(doc["url"], key, workers=1, delay=0.3)  # one at a time: spare capacity, it shrinks meanwhile
    try:
        shrunk = wait_for(lambda: (d := service_json("auto"))["replicas"] == 1 and len(d["slots"]) == 1 and d,
                          60, "the service back at one replica")
    finally:
        light.finish()
    assert shrunk["autoscale"]["last"]["action"] == "down", shrunk["autoscale"]
    assert "no request waiting" in shrunk["autoscale"]["last"]["reason"]
    assert light.failed == 0 and light.ok > 0, light.errors[:3]
    kept = {j for s in shrunk["slots"] for j in (s["current"], s["successor"]) if j}
    assert len(kept) == 2 and shrunk["slots"][0]["successor"], shrunk["slots"]  # the kept replica's successor
    gone = [j for j in JobStore().all() if j.name.startswith("auto-r") and j.job_id not in kept]
    assert {j.name for j in gone} == {"auto-r1", "auto-r1-g1"}, [j.name for j in gone]  # no replacement launched
    for job in gone:  # the serving one after its drain, its queued successor at once
        wait_for(lambda job=job: pbstk("status", job.job_id, "--json").stdout.count('"CANCELLED"'), 20,
                 f"the removed replica's job {job.name} cancelled")
    assert pbstk("cancel", "auto").exit_code == 0


def test_idle_cancel_on_a_service_ends_the_whole_service(isolated_user: Path) -> None:
    result = serve("--name", "lazy", "--replicas", "2", "--idle-cancel", "2s", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "lazy")
    assert rec.idle_cancel_s == 2
    for slot in rec.slots:  # the replicas do not watch themselves: the service's keeper does
        run_dir = JobStore().find(slot.current).run_dir
        assert "IDLE_CANCEL_S=0\n" in Path(run_dir, "start_vllm.sh").read_text()
    registry = isolated_user / "reg.yaml"
    assert pbstk("update-endpoint", "lazy", "--registry", str(registry)).exit_code == 0
    assert "lazy" in read_endpoints(registry)
    url = service_json("lazy")["url"]
    started = time.monotonic()
    for _ in range(4):  # requests keep it alive
        answer = requests.post(url + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                               headers={"Authorization": f"Bearer {rec.api_key}"}, timeout=30)
        assert answer.status_code == 200
        time.sleep(0.8)
    assert service_json("lazy")["state"] == "READY"
    done = wait_for(lambda: (d := service_json("lazy"))["state"] == "ENDED" and d, 40, "the service ended idle")
    assert time.monotonic() - started > 4.5
    assert done["end_reason"].startswith("idle: no request for"), done
    assert "lazy" not in read_endpoints(registry)
    for job in [j for j in JobStore().all() if j.name.startswith("lazy-r")]:
        wait_for(lambda job=job: pbstk("status", job.job_id, "--json").stdout.count('"CANCELLED"'), 20,
                 f"{job.job_id} cancelled")
    assert "ended: idle: no request for" in pbstk("status", "lazy").stdout


@pytest.mark.parametrize(("args", "words"), [
    (["--replicas", "2", "--max-replicas", "3"], "--replicas N keeps a fixed N"),
    (["--min-replicas", "3", "--max-replicas", "2"], "below --min-replicas"),
    (["--min-replicas", "2"], "needs --max-replicas"),
    (["--scale-down-idle", "5m"], "need --max-replicas"),
    (["--max-replicas", "2", "--scale-down-idle", "soon"], "--scale-down-idle"),
    (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas"),
    (["--max-replicas", "2", "--port", "8123"], "--port 8123 with --replicas 2 on the local scheduler"),
])
def test_bad_scaling_options_are_one_error_line(args: list[str], words: str) -> None:
    result = serve("--name", "bad", *args)
    assert result.exit_code == 2, result.output
    assert result.output.count("pbstk: error:") == 1 and words in result.output, result.output
    assert JobStore().all() == [] and records.load(JobStore(), "bad") is None
