"""A multi-model service across walltimes (issue 31, item 4): `pbstk serve A:name=a B:name=b --name N --keep-alive`
gives each planned job a successor carrying ALL its models, the router gets every model's new worker before the
old job's workers leave, and a client sending to both models sees no failure during the handover. The local
scheduler, the stand-in vLLM, the real vllm-router (multi-model mode) and the real keeper.

Before: `--keep-alive` with several models was refused ("planned, not running yet"), exit 2.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import pbstk, wait_for
from test_serve_models_run import _refused, _server_pid, gpu_svc, pbs1_trio  # noqa: F401 - gpu_svc: the fixture
from test_service import Load, _stop_services, handed_over_from, records_dir

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def pair(gpu_svc: Any, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811 - the fixture, by name
    """``gpu_svc``'s 80 GB GPUs (both small models share one), the real router and keeper looking every 0.5 s;
    a predecessor is drained at most 3 s. Two GPUs of this machine: the successor books one of its own."""
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return gpu_svc


def workers(rec: records.ServiceRecord) -> list[str]:
    return sorted(requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"])


def job_urls(job: str) -> list[str]:
    """Every model's worker URL of a job, from its server.json (its own port and its other models')."""
    marker = json.loads(Path(JobStore().find(job).run_dir, "server.json").read_text())
    ports = [marker["port"], *(int(m.rsplit("@", 1)[1]) for m in (marker.get("models") or "").split())]
    return sorted(f"http://127.0.0.1:{p}" for p in ports)


def both_models(rec: records.ServiceRecord, timeout: float = 10) -> Any:
    """One chat completion per call through the service's URL with the `openai` client (no retries of its own),
    to `a` and `b` in turn; the answer must come from the model asked."""
    import openai

    client = openai.OpenAI(base_url=rec.url, api_key=rec.api_key, max_retries=0, timeout=timeout)
    turn = itertools.cycle("ab")

    def send() -> None:
        model = next(turn)
        answer = client.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user",
                                                                                       "content": "hi"}])
        if answer.model != model:
            raise RuntimeError(f"asked {model}, answered by {answer.model}")

    return send


def handed_over(name: str, first: str, rec: records.ServiceRecord, load: Load, more: int, within: float) -> str:
    """Under ``load``: the slot's current job is no longer ``first``; in the tick that handed over, every model's
    worker of ``first`` left the router (it drains now); the drain ends; ``more`` requests succeed after it
    (``within`` s). Returns the new current job."""
    now = wait_for(lambda: (c := records.find(JobStore(), name).slots[0].current) != first and c, 75,
                   "the takeover", interval=0.2)
    assert not set(job_urls(first)) & set(workers(rec)), (job_urls(first), workers(rec))
    wait_for(handed_over_from(name, first), 30, "the drain", interval=0.5)
    done = load.ok
    wait_for(lambda: load.ok >= done + more, within, "load to both models after the handover")
    return str(now)


def test_keep_alive_carries_both_models_across_the_walltime_with_zero_failures(pair: Any) -> None:
    alpha, beta = pair
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "kap", "--profile", "gpu1",
                   "--keep-alive", "--walltime", "00:01:00", "--handover", "45", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "kap")
    first = rec.slots[0].current
    assert first and rec.url and rec.keep_alive
    wait_for(lambda: workers(rec) == job_urls(first), 30, "both models of the first job in the router")

    with Load(both_models(rec), threads=2, limit_s=150) as load:
        # the successor is eligible 45 s before the 60 s walltime ends: about 15 s after the first started
        wait_for(lambda: records.find(JobStore(), "kap").slots[0].successor, 30, "a successor")
        handed_over("kap", first, rec, load, more=20, within=30)
    print(f"multi-model keep-alive handover under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
    assert load.failed == 0, load.errors
    assert load.ok >= 40

    slot = records.find(JobStore(), "kap").slots[0]
    now = slot.current
    assert now and now != first
    # the drained predecessor's URLs are forgotten (a keep-alive slot would otherwise gather one per walltime)
    assert first not in slot.urls and first not in slot.model_urls, (slot.urls, slot.model_urls)
    assert set(slot.model_urls[now].values()) == {"a", "b"}, slot.model_urls
    assert workers(rec) == job_urls(now), "only the successor's two workers are left in the router"
    wait_for(lambda: pbstk("status", first, "--json").exit_code == 0 and JobStore().find(first).final_state
             == "CANCELLED", 20, "the predecessor CANCELLED")
    for url in job_urls(first):  # both of the predecessor's servers stopped with it
        wait_for(lambda url=url: _refused(int(url.rsplit(":", 1)[1])), 30, f"{url} stopped")

    doc = json.loads(pbstk("status", "kap", "--json").stdout)[0]
    models = {m["served_model_name"]: m for m in doc["models"]}
    assert set(models) == {"a", "b"}, doc["models"]
    assert all(m["state"] == "READY" and m["job"] == now for m in models.values()), doc["models"]
    assert sorted(m["server"] for m in models.values()) == job_urls(now)
    log = (records_dir() / "kap" / "keeper.log").read_text()
    assert f"{now} took over from {first}" in log, log
    assert "not a replica of this service" not in log, log  # the old job's second worker left as ours, named
    assert pbstk("cancel", "kap").exit_code == 0


def test_the_death_of_a_second_model_is_named_in_the_keeper_log_and_the_job_replaced(pair: Any) -> None:
    """The job's second model (not its first) dies: the job fails naming that model (not "stopped by a signal",
    as if cancelled), the keeper's log names it and every worker it removes by model, and a new job serves both."""
    alpha, beta = pair
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "co", "--profile", "gpu1",
                   "--restart-backoff", "1s", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "co")
    first = rec.slots[0].current
    assert first and rec.url
    wait_for(lambda: workers(rec) == job_urls(first), 30, "both models in the router")
    marker = json.loads(Path(JobStore().find(first).run_dir, "server.json").read_text())
    second = next(m for m in marker["models"].split() if m.startswith(("a@", "b@")))
    served, port = second.rsplit("@", 1)
    os.kill(_server_pid(alpha if served == "a" else beta), signal.SIGKILL)
    wait_for(lambda: records.find(JobStore(), "co").slots[0].current not in (None, first), 60, "a replacement")
    log = (records_dir() / "co" / "keeper.log").read_text()
    print(log)
    failed = next(line for line in log.splitlines() if f"slot 0: failed: {first}" in line)
    assert f"another model of this job, {served} (port {port}), exited" in failed and "FAILED" in failed, failed
    assert "stopped by a signal" not in failed, failed
    removed = next(line for line in log.splitlines() if f"removed {first}" in line)
    assert f"{served} http://127.0.0.1:{port}" in removed, removed
    assert "not a replica of this service" not in log, log
    assert JobStore().find(first).final_state == "FAILED"
    wait_for(lambda: all(m["state"] == "READY" for m in json.loads(pbstk("status", "co", "--json").stdout)[0]
                         ["models"]), 60, "both models READY again")
    assert pbstk("cancel", "co").exit_code == 0


def test_keep_alive_of_several_models_needs_room_for_each_jobs_successor(pair: Any, isolated_user: Path) -> None:
    """The one-model refusals hold per planned job: a queue limit of 1 running job cannot overlap the job of the
    two models with its successor (one line, exit 2, nothing written); autoscaling several models stays refused."""
    from test_serve_models import refused

    alpha, beta = pair
    profile = isolated_user / "config" / "pbstk" / "profiles" / "gpu1.yaml"
    profile.write_text(profile.read_text() + "max_running_jobs: 1\n")
    refused(pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "kx", "--profile", "gpu1", "--keep-alive"),
            "--keep-alive needs 2 jobs running at once", "max_running_jobs")
    refused(pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "kx", "--profile", "gpu1",
                  "--min-replicas", "1", "--max-replicas", "2"), "several models")


def test_on_pbs_each_planned_job_gets_its_successor_and_three_models_see_no_failure(
        isolated_user: Path, fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three models in two jobs of the fake OpenPBS (which holds a ``qsub -a`` job in ``W`` and kills a job at its
    walltime): each job gets its own successor, the same planned job (c alone on its GPU; a and b sharing the
    other), submitted with ``qsub -a``; both hand over before the walltime with 0 failed requests to a, b and c."""
    from conftest import read_calls

    a, b, c = pbs1_trio(isolated_user, monkeypatch)
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "3")
    try:
        result = pbstk("serve", f"{a}:name=a", f"{b}:name=b", f"{c}:name=c:preset=single", "--name", "pk3",
                       "--profile", "pbs1", "--keep-alive", "--walltime", "00:01:00", "--handover", "45", "--wait",
                       "--timeout", "60")
        assert result.exit_code == 0, result.output
        rec = records.find(JobStore(), "pk3")
        firsts = [s.current for s in rec.slots]
        assert len(firsts) == 2 and all(j and j.endswith(".fakepbs") for j in firsts), rec.slots
        wait_for(lambda: len(workers(rec)) == 3, 30, "three servers in the router")
        client_turns = itertools.cycle("abc")
        import openai

        client = openai.OpenAI(base_url=rec.url, api_key=rec.api_key, max_retries=0, timeout=10)

        def send() -> None:
            model = next(client_turns)
            answer = client.chat.completions.create(model=model, max_tokens=3,
                                                    messages=[{"role": "user", "content": "hi"}])
            if answer.model != model:
                raise RuntimeError(f"asked {model}, answered by {answer.model}")

        with Load(send, threads=2, limit_s=150) as load:
            wait_for(lambda: all(s.current not in firsts and s.draining is None
                                 for s in records.find(JobStore(), "pk3").slots), 90, "both handovers",
                     interval=0.5)
            done = load.ok
            wait_for(lambda: load.ok >= done + 30, 30, "load to the three models after the handovers")
        print(f"PBS multi-model keep-alive: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
        assert load.failed == 0, load.errors
        nows = [s.current or "" for s in records.find(JobStore(), "pk3").slots]
        assert workers(rec) == sorted(u for j in nows for u in job_urls(j))
        qsubs = read_calls(fakepbs, "qsub")
        assert sum("-a" not in argv for argv in qsubs) == 2, qsubs  # the two first jobs; every successor: -a
        doc = json.loads(pbstk("status", "pk3", "--json").stdout)[0]
        models = {m["served_model_name"]: m for m in doc["models"]}
        assert all(m["state"] == "READY" and m["job"] in nows for m in models.values()), doc["models"]
        assert models["a"]["job"] == models["b"]["job"] != models["c"]["job"], doc["models"]
        for job in firsts:
            wait_for(lambda job=job: pbstk("status", job, "--json").exit_code == 0
                     and JobStore().find(job).final_state == "CANCELLED", 20, f"{job} CANCELLED (qdel, not walltime)")
        assert pbstk("cancel", "pk3").exit_code == 0
    finally:
        _stop_services()
