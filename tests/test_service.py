"""``pbstk serve``: replica jobs (local scheduler, stand-in vllm) behind the real vllm-router, one URL, one key.

The router is the real ``vllm-router`` next to this interpreter; the replicas are ordinary local jobs running
the stand-in ``vllm``; the keeper is the real detached process. Everything on loopback, every loop bounded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import MODEL, pbstk, wait_for

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.manage import keeper_alive

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def svc_profile(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local-scheduler profile whose router is the real vllm-router; the keeper looks every 0.5 s."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "svc.yaml").write_text(
        "name: svc\nscheduler: local\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        "address: loopback\nbind_host: 127.0.0.1\nport: 8000\n"
        f"router_command: {ROUTER}\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "3")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    yield "svc"
    _stop_services()


def _stop_services() -> None:
    """A failed test must not leave a keeper or a router running."""
    import contextlib

    from pbs_toolkit.client import Client

    with contextlib.suppress(Exception), Client(on_removal=lambda r: None) as c:
        for rec in c.services():
            with contextlib.suppress(Exception):
                c.cancel_service(rec)


def serve(*args: str) -> Any:
    return pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", *args)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def service_json(name: str) -> dict[str, Any]:
    result = pbstk("status", name, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout)[0])


def chat(url: str, key: str | None, timeout: float = 10.0) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return requests.post(url + "/chat/completions", json=body, headers=headers, timeout=timeout)


def test_serve_two_replicas_one_url_then_cancel_stops_everything(svc_profile: str, isolated_user: Path) -> None:
    result = serve("--replicas", "2", "--name", "qs", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    assert "ready: http://127.0.0.1:" in result.stdout, result.output

    text = pbstk("status")
    assert text.exit_code == 0, text.output
    line = next(l for l in text.stdout.splitlines() if l.startswith("qs "))
    assert "READY 2/2 replicas" in line and "http://127.0.0.1:" in line, text.stdout
    doc = service_json("qs")
    assert doc["kind"] == "service" and doc["schema_version"]
    assert (doc["state"], doc["ready"], doc["replicas"]) == ("READY", 2, 2)
    assert doc["keeper_running"] and doc["router_running"]
    assert [j["name"] for j in doc["jobs"]] == ["qs-r0", "qs-r1"]
    assert all(j["state"] == "READY" for j in doc["jobs"])
    rec = records.find(JobStore(), "qs")
    assert rec.api_key and rec.api_key not in json.dumps(doc) and "token" not in doc["router"]
    url = doc["url"]
    wait_for(lambda: len(requests.get(url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 2, 10,
             "both replicas in the router")
    assert chat(url, rec.api_key).status_code == 200
    assert chat(url, None).status_code == 401
    assert chat(url, "wrong").status_code == 401

    env = pbstk("env", "qs")
    assert env.exit_code == 0, env.output
    assert f"export OPENAI_BASE_URL={url}" in env.stdout and rec.api_key in env.stdout

    registry = isolated_user / "reg.yaml"
    upd = pbstk("update-endpoint", "qs", "--registry", str(registry))
    assert upd.exit_code == 0, upd.output
    assert url in registry.read_text() and "qs" in registry.read_text()

    router_pid = rec.router["pid"]
    keeper_pid = json.loads((isolated_user / "state" / "pbstk" / "services" / "qs" / "keeper.json").read_text())["pid"]
    servers = [json.loads(Path(JobStore().find(j).run_dir, "server.json").read_text())["pid"]
               for s in rec.slots for j in s.jobs()]
    assert alive(router_pid) and alive(keeper_pid) and all(alive(p) for p in servers)

    cancelled = pbstk("cancel", "qs")
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.startswith("qs: cancelled"), cancelled.output
    wait_for(lambda: not alive(router_pid) and not alive(keeper_pid) and not any(alive(p) for p in servers), 15,
             "router, keeper and servers to be gone")
    assert "qs" not in registry.read_text()
    assert not keeper_alive("qs")
    for job in ("qs-r0", "qs-r1"):
        wait_for(lambda j=job: pbstk("status", j, "--json").exit_code == 0 and JobStore().find(j).final_state
                 == "CANCELLED", 15, f"{job} CANCELLED")
    assert records.find(JobStore(), "qs").state == "CANCELLED"
    assert "qs" not in pbstk("status").stdout
