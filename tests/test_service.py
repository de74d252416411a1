"""``pbstk serve``: replica jobs (local scheduler, stand-in vllm) behind the real vllm-router, one URL, one key.

The router is the real ``vllm-router`` next to this interpreter; the replicas are ordinary local jobs running
the stand-in ``vllm``; the keeper is the real detached process. Everything on loopback, every loop bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import MODEL, local_service_profile, pbstk, wait_for

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import keeper_alive

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


@pytest.fixture
def svc_profile(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local-scheduler profile whose router is the real vllm-router; the keeper looks every 0.5 s."""
    local_service_profile(isolated_user, ROUTER)
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
    line = next(row for row in text.stdout.splitlines() if row.startswith("qs "))
    assert "READY 2/2 replicas" in line and "http://127.0.0.1:" in line, text.stdout
    shown = pbstk("status", "qs").stdout
    assert shown.startswith("service qs: READY 2/2 replicas  http://127.0.0.1:"), shown
    assert "qs-r0" in shown and "qs-r1" in shown and "keeper running" in shown, shown
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


class Load:
    """A bounded request loop on loopback in a few threads: counts successes and failures until stopped."""

    def __init__(self, send: Any, threads: int = 3, limit_s: float = 120.0) -> None:
        self.send, self.ok, self.failed, self.errors = send, 0, 0, []  # type: list[str]
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit_s
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                self.send()
                ok, err = True, ""
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever raised it
                ok, err = False, f"{type(exc).__name__}: {str(exc)[:200]}"
            with self._lock:
                if ok:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(err)
            time.sleep(0.01)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def test_losing_a_replica_under_load_degrades_and_leaves_the_router(svc_profile: str) -> None:
    # --max-restarts 0: the lost replica stays lost (tests/test_service_heal.py replaces one)
    result = serve("--replicas", "3", "--name", "loss", "--max-restarts", "0", "--wait", "--timeout", "90", "--json")
    assert result.exit_code == 0, result.output
    served = json.loads(result.stdout)  # serve --json --wait: one service object, READY
    assert (served["kind"], served["state"], served["ready"], served["replicas"]) == ("service", "READY", 3, 3)
    rec = records.find(JobStore(), "loss")
    url, key = rec.url, rec.api_key
    assert url and key
    workers = url[:-3] + "/list_workers"
    wait_for(lambda: len(requests.get(workers, timeout=5).json()["urls"]) == 3, 10, "three workers")

    def send() -> None:
        response = chat(url, key)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    victim = JobStore().find("loss-r1")
    server = json.loads(Path(victim.run_dir, "server.json").read_text())
    with Load(send) as load:
        wait_for(lambda: load.ok >= 30, 30, "steady load")
        os.kill(int(server["pid"]), signal.SIGKILL)
        dead = f"http://127.0.0.1:{server['port']}"
        wait_for(lambda: dead not in requests.get(workers, timeout=5).json()["urls"], 15,
                 "the dead replica to leave the router")
        before = load.ok
        wait_for(lambda: load.ok >= before + 30, 30, "load to go on")
    print(f"replica loss under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
    assert load.failed == 0, load.errors  # the router retries on another worker (docs/services.md "The router")
    doc = wait_for(lambda: (d := service_json("loss"))["state"] == "DEGRADED" and d, 15, "DEGRADED")
    assert doc["ready"] == 2 and doc["replicas"] == 3
    line = pbstk("status").stdout
    assert "DEGRADED 2/3 replicas" in line, line
    assert sorted(requests.get(workers, timeout=5).json()["urls"]) == sorted(
        f"http://127.0.0.1:{json.loads(Path(JobStore().find(n).run_dir, 'server.json').read_text())['port']}"
        for n in ("loss-r0", "loss-r2"))
    assert pbstk("cancel", "loss").exit_code == 0


def openai_chat(rec: records.ServiceRecord) -> Callable[[], None]:
    """One short chat completion through the service's URL with the `openai` client (no retries of its own)."""
    import openai

    client = openai.OpenAI(base_url=rec.url, api_key=rec.api_key, max_retries=0, timeout=10)

    def send() -> None:
        client.chat.completions.create(model=rec.served_model_name, max_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])

    return send


def handed_over_from(name: str, first: str | None) -> Callable[[], bool]:
    """Whether slot 0 of service ``name`` has a new current job and nothing left draining."""

    def done() -> bool:
        now = records.find(JobStore(), name).slots[0]
        return now.current != first and now.draining is None

    return done


def test_keep_alive_hands_over_under_openai_load_with_zero_failures(svc_profile: str, isolated_user: Path) -> None:
    result = serve("--replicas", "1", "--name", "ka", "--keep-alive", "--walltime", "00:01:15", "--handover", "45",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "ka")
    first = rec.slots[0].current
    registry = isolated_user / "endpoints.yaml"
    assert pbstk("update-endpoint", "ka", "--registry", str(registry)).exit_code == 0
    before = registry.read_bytes()
    send, handed_over = openai_chat(rec), handed_over_from("ka", first)

    with Load(send, threads=2, limit_s=150) as load:
        # the successor is eligible 45 s before the 75 s walltime ends: about 30 s after the first started
        doc = wait_for(lambda: service_json("ka")["slots"][0]["successor"] and service_json("ka"), 30, "a successor")
        assert any(j["state"] == "PENDING" and "eligible at" in (j["comment"] or "") for j in doc["jobs"]), doc
        wait_for(handed_over, 75, "the handover", interval=0.5)
        done = load.ok
        wait_for(lambda: load.ok >= done + 20, 30, "load after the handover")
    print(f"keep-alive handover under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}")
    assert load.failed == 0, load.errors
    assert registry.read_bytes() == before
    now = records.find(JobStore(), "ka").slots[0]
    assert now.current == JobStore().find("ka-r0-g1").job_id
    wait_for(lambda: pbstk("status", first, "--json").exit_code == 0 and JobStore().find(first).final_state
             == "CANCELLED", 15, "the predecessor CANCELLED")
    successor = json.loads(Path(JobStore().find("ka-r0-g1").run_dir, "server.json").read_text())
    assert requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"] == [
        f"http://127.0.0.1:{successor['port']}"]
    assert service_json("ka")["state"] == "READY"
    assert pbstk("cancel", "ka").exit_code == 0


def test_keep_alive_replaces_a_lost_replica_now_and_resume_restarts_a_killed_keeper(svc_profile: str) -> None:
    result = serve("--replicas", "1", "--name", "rep", "--keep-alive", "--handover", "60", "--restart-backoff", "1s",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    # a 10-minute walltime: the successor is queued at once, eligible 60 s before the end
    doc = wait_for(lambda: (d := service_json("rep"))["slots"][0]["successor"] and d, 15, "a queued successor")
    queued = doc["slots"][0]["successor"]
    first = JobStore().find("rep-r0")
    os.kill(int(json.loads(Path(first.run_dir, "server.json").read_text())["pid"]), signal.SIGKILL)
    doc = wait_for(lambda: (d := service_json("rep"))["slots"][0]["current"] not in (first.job_id, queued) and d,
                   20, "a replacement")
    assert JobStore().find(queued).final_state == "CANCELLED" or pbstk("status", queued, "--json").exit_code == 0
    wait_for(lambda: JobStore().find(queued).final_state == "CANCELLED", 15, "the queued successor cancelled")
    wait_for(lambda: service_json("rep")["state"] == "READY", 30, "READY again")

    keeper = json.loads((records_dir() / "rep" / "keeper.json").read_text())["pid"]
    os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: not keeper_alive("rep"), 10, "the keeper gone")
    st = pbstk("status")
    assert "pbstk service resume rep" in st.stderr and "keeper of service rep is not running" in st.stderr, st.output
    resumed = pbstk("service", "resume", "rep")
    assert resumed.exit_code == 0 and "keeper started" in resumed.stdout, resumed.output
    assert keeper_alive("rep") and "not running" not in pbstk("status").stderr
    assert pbstk("cancel", "rep").exit_code == 0


def records_dir() -> Path:
    from pbs_toolkit.services.keeper.process import service_dir

    return service_dir("x").parent


@pytest.mark.ssh
def test_serve_through_a_login_node_router_on_the_login_node_replicas_on_fake_pbs(
        login_node: Any, isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "svcssh.yaml").write_text(
        f"name: svcssh\nscheduler: pbs\nssh_host: {login_node.alias}\nnodes: 1\ngpus_per_node: 1\n"
        "cpus_per_node: 2\naddress: loopback\nbind_host: 127.0.0.1\nwalltime: '00:10:00'\n"
        f"router_command: {ROUTER}\nrouter_bind: 127.0.0.1\n")
    try:
        result = pbstk("serve", MODEL, "--profile", "svcssh", "--preset", "single", "--replicas", "2",
                       "--name", "remote", "--wait", "--timeout", "90")
        assert result.exit_code == 0, result.output
        rec = records.find(JobStore(), "remote")
        assert rec.transport == login_node.alias and rec.router["transport"] == login_node.alias
        doc = service_json("remote")
        assert (doc["state"], doc["ready"], doc["router_running"]) == ("READY", 2, True)
        assert rec.url and chat(rec.url, rec.api_key).status_code == 200  # loopback: the login node is here
        router_pid = rec.router["pid"]
        assert pbstk("cancel", "remote").exit_code == 0
        wait_for(lambda: not alive(router_pid), 15, "the router on the login node to be gone")
    finally:
        _stop_services()


def test_a_handover_waits_for_a_slow_request_on_the_predecessor(svc_profile: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain reads the predecessor's ``vllm:num_requests_running`` (the stand-in counts its requests in
    flight): a 12 s request sent to it just before the handover completes (200) before it is cancelled."""
    monkeypatch.setenv("PBSTK_SERVICE_DRAIN_S", "60")  # the drain bound must not be what ends the wait
    result = serve("--replicas", "1", "--name", "dr", "--keep-alive", "--walltime", "00:01:00", "--handover", "45",
                   "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "dr")
    first = JobStore().find("dr-r0")
    server = json.loads(Path(first.run_dir, "server.json").read_text())
    direct = f"http://127.0.0.1:{server['port']}/v1"
    # the successor is eligible 15 s after the first started: wait until it leaves its queue (starting)
    doc = wait_for(lambda: (d := service_json("dr"))["slots"][0]["successor"] and d, 20, "a successor")
    successor = doc["slots"][0]["successor"]
    wait_for(lambda: next(j for j in service_json("dr")["jobs"] if j["job_id"] == successor)["state"] != "PENDING",
             40, "the successor to start", interval=0.3)
    outcome: dict[str, Any] = {}

    def slow() -> None:
        body = {"model": rec.served_model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "standin_delay_s": 12}
        try:
            response = requests.post(direct + "/chat/completions", json=body, timeout=60,
                                     headers={"Authorization": f"Bearer {rec.api_key}"})
            outcome["status"] = response.status_code
        except requests.RequestException as exc:
            outcome["error"] = repr(exc)
        outcome["ended"] = time.time()

    thread = threading.Thread(target=slow, daemon=True)
    thread.start()
    running = re.compile(r"^vllm:num_requests_running\{[^}]*\} 1\.0$", re.MULTILINE)
    wait_for(lambda: running.search(requests.get(direct[:-3] + "/metrics", timeout=5).text), 5,
             "the stand-in to count the slow request")
    took_over = wait_for(lambda: (s := records.find(JobStore(), "dr").slots[0]).current == successor
                         and s.draining == first.job_id and time.time(), 40, "the handover", interval=0.2)
    thread.join(30)
    assert outcome.get("status") == 200, outcome  # the predecessor was not cancelled under it
    wait_for(lambda: pbstk("status", first.job_id, "--json").exit_code == 0 and JobStore().find(
        first.job_id).final_state == "CANCELLED", 20, "the drained predecessor CANCELLED")
    log = records_dir() / "dr" / "keeper.log"
    drained = wait_for(lambda: next((line for line in log.read_text().splitlines()
                                     if f"drained and cancelled {first.job_id}" in line), None), 5, "the log line")
    waited = float(drained.rsplit("after ", 1)[1].split()[0])
    assert waited >= outcome["ended"] - took_over - 1, (drained, outcome["ended"] - took_over)
    assert outcome["ended"] - took_over > 3, "the slow request should outlast the 2 s minimum drain"
    assert pbstk("cancel", "dr").exit_code == 0
