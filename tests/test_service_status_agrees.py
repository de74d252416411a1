"""`pbstk status NAME` agrees with itself (issue 44, item 4): a multi-model service's line and its rows come from
the same facts, the router's check says what a completion gets, an ended service's rows read ENDED (or each job's
final state), and a job and a service of one name resolve to the active one.

Real components: the local scheduler, the stand-in vLLM, the real vllm-router and keeper, on loopback.

Before: the rows read READY from the jobs alone while the line counted the router (`DOWN 2/2 models` over two
READY rows once the router had no worker), the router's line said `a request with the key: 200` with 0 workers
(the multi-model front listed no model with 200) while completions got 503, an ended service's rows read PENDING,
and `status NAME` / `cancel NAME` acted on an ended job of that name while the service of that name ran, with no
word at `serve`.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import requests
from helpers import MODEL, pbstk, wait_for
from test_serve_models_run import chat, gpu_svc  # noqa: F401 - gpu_svc: the fixture
from test_service import serve, service_json, svc_profile  # noqa: F401 - svc_profile: the fixture

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper_process import keeper_alive, service_dir


def _kill_keeper(name: str) -> None:
    """SIGKILL the service's keeper (this test's serve started it): nobody puts a worker back into the router."""
    os.kill(json.loads((service_dir(name) / "keeper.json").read_text())["pid"], signal.SIGKILL)
    wait_for(lambda: not keeper_alive(name), 10, "the keeper gone")


def _remove(rec: records.ServiceRecord, worker: str) -> None:
    owner = {"X-Pbstk-Router-Token": rec.router["admin_token"]}  # the front lets only the owner change workers
    base = f"http://127.0.0.1:{rec.router['port']}"
    assert requests.post(base + "/remove_worker", params={"url": worker}, headers=owner, timeout=5).ok


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["served_model_name"]: m for m in doc["models"]}


def _serve_pair(checkpoints: Any) -> tuple[records.ServiceRecord, Any]:
    alpha, beta = checkpoints
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "pair", "--profile", "gpu1", "--wait",
                   "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "pair")
    assert rec.url and rec.api_key
    return rec, result


def test_the_line_and_the_rows_of_a_multi_model_service_agree(gpu_svc: Any) -> None:  # noqa: F811
    rec, result = _serve_pair(gpu_svc)
    doc = service_json("pair")  # --wait returned: every model routable, not only the job's first
    assert (doc["state"], [m["state"] for m in doc["models"]]) == ("READY", ["READY", "READY"]), doc["models"]
    assert "READY 2/2 models" in result.stdout, result.output
    servers = {name: m["server"] for name, m in _rows(doc).items()}
    assert sorted(doc["router_workers"]) == sorted(servers.values()), doc

    _kill_keeper("pair")
    _remove(rec, servers["b"])  # b's server still answers, but requests for b reach nothing
    doc = service_json("pair")
    rows = _rows(doc)
    assert (rows["a"]["state"], rows["b"]["state"], doc["state"]) == ("READY", "STARTING", "DEGRADED"), doc
    assert rows["b"]["url"] is None and rows["b"]["server"] == servers["b"]
    shown = pbstk("status", "pair").stdout
    assert shown.startswith("service pair: DEGRADED 1/2 models"), shown

    _remove(rec, servers["a"])  # no worker left: every completion gets 503
    assert chat(rec.url, rec.api_key, "a").status_code == 503
    listed = requests.get(rec.url + "/models", headers={"Authorization": f"Bearer {rec.api_key}"}, timeout=10)
    assert listed.status_code == 503, listed.text  # as the router itself answers, not an empty 200 list
    doc = service_json("pair")
    assert doc["state"] == "DOWN" and {m["state"] for m in doc["models"]} == {"STARTING"}, doc
    assert (doc["router_workers"], doc["route_status"]) == ([], 503), doc
    shown = pbstk("status", "pair").stdout
    assert shown.startswith("service pair: DOWN 0/2 models"), shown
    assert "0 worker(s), a request with the key: 503 (the router has no worker to serve it)" in shown, shown
    assert "a request with the key: 200" not in shown, shown
    assert pbstk("cancel", "pair").exit_code == 0


def test_the_rows_of_an_ended_multi_model_service_read_how_it_ended(gpu_svc: Any) -> None:  # noqa: F811
    rec, _ = _serve_pair(gpu_svc)
    assert pbstk("cancel", "pair").exit_code == 0
    doc = service_json("pair")
    jobs = {s.current for s in rec.slots}
    assert doc["state"] == "CANCELLED", doc
    for m in doc["models"]:  # the job each model ran in, and how it ended (never PENDING)
        assert m["job"] in jobs and m["state"] in ("CANCELLED", "FINISHED", "ENDED"), doc["models"]
        assert m["url"] is None
    shown = pbstk("status", "pair").stdout
    assert "PENDING" not in shown and shown.startswith("service pair: CANCELLED 0/2 models"), shown


def _ended(job: str) -> bool:
    listed = json.loads(pbstk("jobs", "--all", "--json").stdout)
    return any(r["job_id"] == job and r["final_state"] for r in listed)


def test_an_ended_job_does_not_hide_the_running_service_of_its_name(svc_profile: str) -> None:  # noqa: F811
    launched = pbstk("launch", MODEL, "--profile", "svc", "--preset", "single", "--name", "dup")
    assert launched.exit_code == 0, launched.output
    job = JobStore().find("dup").job_id
    assert pbstk("cancel", "dup").stdout.startswith(f"{job}: ")
    wait_for(lambda: pbstk("status", job) and _ended(job), 30, "the job's end recorded (status records it)")

    served = serve("--name", "dup")  # says which one `dup` means from now on
    assert served.exit_code == 0, served.output
    assert f"pbstk: note: job {job} was named dup too and has ended (CANCELLED)" in served.stderr, served.output
    assert "act on this service" in served.stderr, served.output
    shown = pbstk("status", "dup")  # the running service, not the ended job
    assert shown.exit_code == 0 and shown.stdout.startswith("service dup: "), shown.output
    assert json.loads(pbstk("status", job, "--json").stdout)[0]["job_id"] == job  # the job: by its id
    cancelled = pbstk("cancel", "dup")
    assert cancelled.exit_code == 0 and cancelled.stdout.startswith("dup: cancelled (service:"), cancelled.output
    assert records.find(JobStore(), "dup").ended is not None

    again = pbstk("launch", MODEL, "--profile", "svc", "--preset", "single", "--name", "dup")  # over the ended one
    assert again.exit_code == 0, again.output
    assert "pbstk: note: service dup has ended (CANCELLED): commands naming dup act on this job" in again.stderr
    newer = JobStore().find("dup").job_id
    assert newer != job
    shown = pbstk("status", "dup")  # the active job now
    assert shown.exit_code == 0 and "service dup" not in shown.stdout and newer in shown.stdout, shown.output
    assert pbstk("cancel", "dup").stdout.startswith(f"{newer}: "), "the active job is the one cancelled"
