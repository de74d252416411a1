#!/usr/bin/env python3
"""Watches a service started by benchmarks/gpu/run_service_ready.sh (bounded loops, loopback only).

    watch_service.py ready NAME            every 0.05 s: when each replica's server first answered /health and
                                           when the router first listed it (one line per replica, epoch seconds)
    watch_service.py report WATCH RETURNED the delays from those lines and the time serve --wait returned
    watch_service.py handover NAME         a 2-thread request loop through the service URL across the keep-alive
                                           handover; the GPUs each job got; ok/failed counts
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from pbs_toolkit.jobs.store import JobStore  # noqa: E402
from pbs_toolkit.services import record as records  # noqa: E402


def _port(store: JobStore, job: str) -> int | None:
    try:
        return int(json.loads(Path(store.find(job).run_dir, "server.json").read_text())["port"])
    except Exception:  # noqa: BLE001 - not there yet
        return None


def ready(name: str, limit_s: float = 600.0) -> None:
    store = JobStore()
    up: dict[str, float] = {}
    joined: dict[str, float] = {}
    deadline = time.time() + limit_s
    while time.time() < deadline:
        rec = records.load(store, name)
        if rec is not None and rec.router:
            try:
                workers = requests.get(f"http://127.0.0.1:{rec.router['port']}/list_workers", timeout=1).json()["urls"]
            except Exception:  # noqa: BLE001
                workers = []
            for slot in rec.slots:
                job = slot.current
                port = _port(store, job) if job else None
                if not job or port is None:
                    continue
                url = f"http://127.0.0.1:{port}"
                if job not in up:
                    try:
                        if requests.get(url + "/health", timeout=1).status_code == 200:
                            up[job] = time.time()
                    except requests.RequestException:
                        pass
                if job not in joined and url in workers:
                    joined[job] = time.time()
            if len(joined) == rec.replicas and all(j in up for j in joined):
                break
        time.sleep(0.05)
    for job in sorted(set(up) | set(joined)):
        print(f"{job} up={up.get(job, 0):.3f} joined={joined.get(job, 0):.3f}", flush=True)


def report(watch: str, returned_file: str) -> None:
    returned = float(Path(returned_file).read_text())
    ups, joins = [], []
    for line in Path(watch).read_text().splitlines():
        m = re.match(r"(\S+) up=([0-9.]+) joined=([0-9.]+)", line)
        if not m:
            continue
        job, up, joined = m.group(1), float(m.group(2)), float(m.group(3))
        ups.append(up)
        joins.append(joined)
        print(f"replica {job}: in the router {joined - up:.2f} s after its server first answered /health")
    if ups:
        print(f"serve --wait returned {returned - max(joins):.2f} s after the last replica joined the router, "
              f"{returned - max(ups):.2f} s after the last server answered")


def _gpus(store: JobStore, job: str) -> str:
    text = Path(store.find(job).run_dir, "start_vllm.sh").read_text()
    m = re.search(r"CUDA_VISIBLE_DEVICES=([0-9,]+)", text)
    return m.group(1) if m else "(all)"


def handover(name: str, limit_s: float = 480.0) -> None:
    store = JobStore()
    rec = records.find(store, name)
    first = rec.slots[0].current
    assert first and rec.url and rec.api_key
    counts = {"ok": 0, "failed": 0}
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    body = {"model": rec.served_model_name, "prompt": "Once upon a time", "max_tokens": 16}

    def loop() -> None:
        session = requests.Session()
        while not stop.is_set():
            try:
                r = session.post(rec.url + "/completions", json=body, timeout=60,
                                 headers={"Authorization": f"Bearer {rec.api_key}"})
                ok = r.status_code == 200
                err = "" if ok else f"{r.status_code} {r.text[:100]}"
            except requests.RequestException as exc:
                ok, err = False, type(exc).__name__
            with lock:
                counts["ok" if ok else "failed"] += 1
                if err and len(errors) < 5:
                    errors.append(err)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    start = time.time()
    successor = None
    done = None
    while time.time() - start < limit_s:
        slot = records.find(store, name).slots[0]
        successor = successor or slot.successor
        if slot.current != first and slot.draining is None:
            done = time.time()
            break
        time.sleep(0.5)
    time.sleep(5)
    stop.set()
    for t in threads:
        t.join(70)
    print(f"predecessor {first} on GPU {_gpus(store, first)}; successor {successor} on GPU "
          f"{_gpus(store, successor) if successor else '-'}")
    if successor:
        args = Path(store.find(successor).run_dir, "start_vllm.sh").read_text()
        util = re.findall(r"gpu-memory-utilization[= ']+([0-9.]+)", args)
        shown = util or "not set (vLLM's default, 0.9)"
        print(f"successor's --gpu-memory-utilization: {shown}")
    print(f"handover {'done' if done else 'NOT done'} {done - start if done else limit_s:.0f} s into the loop; "
          f"requests: {counts['ok']} ok, {counts['failed']} failed {errors}")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "ready":
        ready(sys.argv[2])
    elif command == "report":
        report(sys.argv[2], sys.argv[3])
    elif command == "handover":
        handover(sys.argv[2])
    else:
        raise SystemExit(__doc__)
