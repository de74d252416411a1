"""Everything that works for one model works per model (issue 31 item 4): `logs NAME --model M`, `metrics NAME`
per model, `usage` per model, `--idle-cancel` of a multi-model service, with the real parts of
tests/test_serve_models_run.py (local scheduler, stand-in vLLM, the real vllm-router and keeper).

Before: `logs`/`metrics` had no `--model` (exit 2, "no such option"), `metrics NAME` and the keeper's idle check
read each job's first model only, `usage` had no per-model part, and `--idle-cancel` with several models was
refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import pbstk, wait_for
from test_serve_models_run import ROUTER, chat, gpu_svc, pbs1_trio  # noqa: F401 - gpu_svc: the fixture

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

assert ROUTER  # the module's skip (no vllm-router) comes with the fixture's module


def _own_and_other(name: str) -> tuple[str, str, Path]:
    """(the job's own model, its other model, the job's run directory) of a one-job two-model service."""
    rec = records.find(JobStore(), name)
    job = JobStore().find(rec.slots[0].current)
    own = job.served_model_name
    other = next(m["served_model_name"] for m in rec.models if m["served_model_name"] != own)
    return own, other, Path(job.run_dir)


def _tail(path: Path, n: int) -> str:
    return "".join(path.read_text().splitlines(keepends=True)[-n:])


def _one_error_line(result: Any, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pbstk: error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_logs_metrics_and_usage_of_each_model(gpu_svc: Any) -> None:  # noqa: F811
    alpha, beta = gpu_svc
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "pm", "--profile", "gpu1", "--wait",
                   "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "pm")
    wait_for(lambda: len(requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 2, 30,
             "both models' servers in the router")
    own, other, run_dir = _own_and_other("pm")

    # logs --model: each model's own vLLM log, of the job holding it
    for model, path in ((other, run_dir / "vllm.model2.log"), (own, run_dir / "vllm.log")):
        shown = pbstk("logs", "pm", "--model", model, "-n", "5")
        assert shown.exit_code == 0, shown.output
        assert shown.stdout == _tail(path, 5) and shown.stdout, (model, shown.stdout)
    assert pbstk("logs", "pm", "--model", other, "-n", "5").stdout != pbstk("logs", "pm", "--model", own,
                                                                            "-n", "5").stdout
    _one_error_line(pbstk("logs", "pm", "--model", "nope"), "nope", "a, b")
    _one_error_line(pbstk("logs", "pm", "--model", other, "--replica", "1"), "leave --replica out")
    from pbs_toolkit.client import Client

    with Client() as c:  # follow mode hands out the same file's lines
        lines = c.service_log("pm", 2, True, model=other, final_every=0.5)
        first = next(lines)
        lines.close()
    assert first == _tail(run_dir / "vllm.model2.log", 2).splitlines()[0]

    # metrics: a row per model, each from its own /metrics; --model picks one
    for _ in range(3):
        assert chat(rec.url, rec.api_key, other).status_code == 200
    doc = json.loads(pbstk("metrics", "pm", "--json", "--interval", "0.2").stdout)
    models = {m["model"]: m for m in doc["models"]}
    assert set(models) == {"a", "b"}, doc
    assert models[other]["totals"]["requests_success"] == 3 and models[own]["totals"]["requests_success"] == 0
    assert doc["aggregate"]["models"] == 2 and doc["replicas"][0]["totals"]["requests_success"] == 3, doc
    picked = json.loads(pbstk("metrics", "pm", "--json", "--model", other, "--interval", "0.2").stdout)
    assert [m["model"] for m in picked["models"]] == [other], picked
    text = pbstk("metrics", "pm", "--interval", "0.2")
    print(text.stdout)
    assert text.exit_code == 0 and f"model {other} (r0 " in text.stdout and f"model {own} (r0 " in text.stdout
    _one_error_line(pbstk("metrics", "pm", "--model", "nope"), "nope", "a, b")

    # usage: without events both models are awake all along and share the GPU by memory (0.1 each: halves)
    plain = json.loads(pbstk("usage", "pm", "--json").stdout)["services"][0]
    parts = {m["model"]: m for m in plain["models"]}
    assert parts["a"]["node_hours"] and parts["a"]["node_hours"] == parts["b"]["node_hours"], parts
    assert parts["a"]["awake_s"] is None and parts["a"]["jobs"] == 1
    # with events (what the swapping job writes): other asleep from the start, own awake: own gets it all
    (run_dir / "models.events.jsonl").write_text(
        "\n".join(json.dumps(e) for e in ({"t": 1.0, "model": own, "event": "awake"},
                                          {"t": 1.0, "model": other, "event": "awake"},
                                          {"t": 2.0, "model": other, "event": "asleep"})) + "\n")
    doc = json.loads(pbstk("usage", "pm", "--json").stdout)
    parts = {m["model"]: m for m in doc["services"][0]["models"]}
    replica = next(r for r in doc["jobs"] if r["kind"] == "replica")
    assert parts[other]["node_hours"] == 0.0 and parts[own]["node_hours"] == replica["node_hours"], (parts, replica)
    assert parts[other]["awake_s"] == 0.0 and parts[own]["awake_s"] >= 1.0, parts
    assert replica["requests"] == 3, replica  # the job's requests are every model's (3 to the other one only)
    table = pbstk("usage", "pm")
    print(table.stdout)
    assert f"model {own}" in table.stdout and "awake" in table.stdout, table.stdout
    assert pbstk("cancel", "pm").exit_code == 0


def test_idle_cancel_sees_every_model(gpu_svc: Any) -> None:  # noqa: F811
    """Only the job's other model is busy (a slow request to its own server): the service stays; then both are
    idle: the keeper ends it."""
    alpha, beta = gpu_svc
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "idl", "--profile", "gpu1",
                   "--idle-cancel", "3s", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "idl")
    assert rec.idle_cancel_s == 3
    _, other, _ = _own_and_other("idl")
    status = json.loads(pbstk("status", "idl", "--json").stdout)[0]
    server = next(m["server"] for m in status["models"] if m["served_model_name"] == other)
    started = time.monotonic()
    slow = requests.post(server + "/v1/completions", json={"model": other, "prompt": "x", "max_tokens": 1,
                                                             "standin_delay_s": 10},
                         headers={"Authorization": f"Bearer {rec.api_key}"}, timeout=60)
    assert slow.status_code == 200, slow.text
    assert time.monotonic() - started >= 9  # the request ran its 10 s, three idle times
    doc = json.loads(pbstk("status", "idl", "--json").stdout)[0]
    assert doc["state"] == "READY", doc  # busy on its second model: not cancelled
    done = wait_for(lambda: (d := json.loads(pbstk("status", "idl", "--json").stdout)[0])["state"] == "ENDED" and d,
                    60, "the service ended idle")
    assert done["end_reason"].startswith("idle: no request for"), done


def test_each_model_of_two_pbs_jobs(isolated_user: Path, fakepbs: Path, standins: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Three models in two fake-PBS jobs (c alone on its GPU in one, a and b sharing the other's): each model's
    log is found in its own job, metrics has a line per model over both replicas, usage splits each job's
    GPU-hours among its own models only."""
    from test_service import _stop_services

    a, b, c = pbs1_trio(isolated_user, monkeypatch)
    try:
        result = pbstk("serve", f"{a}:name=a", f"{b}:name=b", f"{c}:name=c:preset=single", "--name", "trio",
                       "--profile", "pbs1", "--wait", "--timeout", "120")
        assert result.exit_code == 0, result.output
        rec = records.find(JobStore(), "trio")
        wait_for(lambda: len(requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 3, 30,
                 "three servers in the router")
        jobs = {m["served_model_name"]: m["job"] for m in rec.models}
        shared = JobStore().find(rec.slots[jobs["a"] - 1].current)
        second = "b" if shared.served_model_name == "a" else "a"
        alone = JobStore().find(rec.slots[jobs["c"] - 1].current)
        for model, path in (("c", Path(alone.run_dir) / "vllm.log"),
                            (second, Path(shared.run_dir) / "vllm.model2.log"),
                            (shared.served_model_name, Path(shared.run_dir) / "vllm.log")):
            shown = pbstk("logs", "trio", "--model", model, "-n", "3")
            assert shown.exit_code == 0 and shown.stdout == _tail(path, 3), (model, shown.output)

        assert chat(rec.url, rec.api_key, second).status_code == 200
        doc = json.loads(pbstk("metrics", "trio", "--json", "--interval", "0.2").stdout)
        got = {m["model"]: (m["job_id"], m["totals"]["requests_success"]) for m in doc["models"]}
        assert got == {"c": (alone.job_id, 0), second: (shared.job_id, 1), shared.served_model_name:
                       (shared.job_id, 0)}, doc["models"]
        assert doc["aggregate"]["replicas"] == 2 and doc["aggregate"]["models"] == 3

        usage = json.loads(pbstk("usage", "trio", "--json").stdout)
        parts = {m["model"]: m for m in usage["services"][0]["models"]}
        hours = {r["job_id"]: r["gpu_hours"] for r in usage["jobs"] if r["kind"] == "replica"}
        assert parts["c"]["gpu_hours"] == hours[alone.job_id] and parts["c"]["jobs"] == 1, (parts, hours)
        assert hours[alone.job_id] and hours[shared.job_id], hours  # GPU time there to split
        assert parts["a"]["gpu_hours"] == parts["b"]["gpu_hours"], parts  # shares 0.1 and 0.1 of one GPU
        assert parts["a"]["gpu_hours"] == pytest.approx(hours[shared.job_id] / 2, abs=1e-4), (parts, hours)
        assert pbstk("cancel", "trio").exit_code == 0
    finally:
        _stop_services()
