"""Self-healing services (issue 28 item 3): a replica that fails is replaced under the service's restart policy,
with or without keep-alive; a replica that fails at start is not restarted in a loop, and the cause is shown.

Real parts: the local scheduler runs the stand-in ``vllm`` (``PBSTK_TEST_STANDIN_MODE=fatal``: an OOM before it
listens), the real vllm-router, the real detached keeper (every 0.5 s); a short backoff (``--restart-backoff``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import requests
from helpers import pbstk, wait_for
from test_service import ROUTER, Load, chat, serve, service_json, svc_profile  # noqa: F401  (fixture)

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import keeper_alive, service_dir

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def server_of(job: str) -> dict[str, object]:
    return dict(json.loads(Path(JobStore().find(job).run_dir, "server.json").read_text()))


def workers(rec: records.ServiceRecord) -> list[str]:
    assert rec.url
    return list(requests.get(rec.url[:-3] + "/list_workers", timeout=5).json()["urls"])


def keeper_log(name: str) -> str:
    return (service_dir(name) / "keeper.log").read_text()


def test_a_killed_replica_of_a_fixed_service_is_replaced_and_no_request_fails(svc_profile: str) -> None:  # noqa: F811
    result = serve("--replicas", "2", "--name", "heal", "--wait", "--timeout", "90")  # the default policy
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "heal")
    assert rec.url and rec.api_key
    url, key = rec.url, rec.api_key
    wait_for(lambda: len(workers(rec)) == 2, 15, "both replicas in the router")
    victim = rec.slots[0].current or ""

    def send() -> None:  # no retries of its own: every error the router lets through counts
        response = chat(url, key)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    # the load outlasts every wait below (30 + 60 + 60 + 30 s): stopped early, it would fail the last one
    with Load(send, threads=2, limit_s=240) as load:
        wait_for(lambda: load.ok >= 20, 30, "steady load")
        os.kill(int(str(server_of(victim)["pid"])), signal.SIGKILL)
        slot = wait_for(lambda: (s := records.find(JobStore(), "heal").slots[0]).current != victim and s, 60,
                        "a replacement of the killed replica")
        doc = wait_for(lambda: (d := service_json("heal"))["state"] == "READY" and d["ready"] == 2 and d, 60,
                       "READY 2/2 again")
        before = load.ok
        wait_for(lambda: load.ok >= before + 20, 30, "load through the healed service")
    print(f"replica killed and replaced under load: {load.ok} ok, {load.failed} failed: {load.errors[:3]}; "
          f"cause shown: {doc['slots'][0]['last_failure']}")
    assert load.failed == 0, load.errors
    assert slot.current == JobStore().find("heal-r0-g1").job_id
    shown = doc["slots"][0]
    assert shown["restarts"] == 1 and shown["gave_up"] == "" and doc["restart_stopped"] is None, shown
    assert shown["last_failure"].startswith(f"{victim} FAILED"), shown
    assert doc["restart_policy"] == {"max_restarts": 3, "window_s": 1800.0, "backoff_s": 10.0}
    assert doc["slots"][1]["restarts"] == 0
    text = pbstk("status", "heal").stdout
    assert "restarts: 3 restarts in 30m00s, backoff 10s doubling" in text, text
    assert f"r0: 1 restart(s), last failure: {victim} FAILED" in text, text
    assert f"replacement {slot.current} launched (restart 1)" in keeper_log("heal")
    assert pbstk("cancel", "heal").exit_code == 0


def test_a_replica_failing_at_start_is_not_restarted_past_the_limit_and_the_cause_is_shown(
        svc_profile: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")  # every start: CUDA out of memory before listening
    result = serve("--replicas", "1", "--name", "oom", "--max-restarts", "2", "--restart-backoff", "1s", "--wait",
                   "--timeout", "120")
    # three starts (the first and 2 restarts), each failing: serve --wait ends with the cause in one line
    assert result.exit_code == 5, result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("pbstk: error:")]
    assert len(error) == 1 and "DOWN" in error[0] and "out of memory" in error[0].lower(), result.stderr
    assert "not restarted after 2 restart(s)" in error[0], error
    print(f"serve --wait of a replica failing at start: {error[0]}")
    jobs = lambda: sorted(r.name for r in JobStore().all() if r.name.startswith("oom-"))  # noqa: E731
    assert jobs() == ["oom-r0", "oom-r0-g1", "oom-r0-g2"]
    ticks = (service_dir("oom") / "keeper-tick.json").read_text
    seen = ticks()
    wait_for(lambda: ticks() != seen, 15, "a later keeper tick")  # a tick after the last failure was judged
    seen = ticks()
    wait_for(lambda: ticks() != seen, 15, "another one")
    assert jobs() == ["oom-r0", "oom-r0-g1", "oom-r0-g2"]  # not restarted a fourth time
    assert keeper_alive("oom")
    doc = service_json("oom")
    assert doc["state"] == "DOWN" and doc["ready"] == 0
    slot = doc["slots"][0]
    assert slot["restarts"] == 2 and "not restarted after 2 restart(s)" in slot["gave_up"], slot
    assert slot["last_failure"].startswith(f"{JobStore().find('oom-r0-g2').job_id} FAILED"), slot
    assert "out of memory" in slot["last_failure"].lower() and doc["restart_stopped"], slot
    listed = pbstk("status")
    notes = [line for line in listed.stderr.splitlines() if "service oom" in line]
    assert len(notes) == 1 and "is DOWN" in notes[0] and "out of memory" in notes[0].lower(), listed.stderr
    shown = pbstk("status", "oom").stdout
    assert shown.startswith("service oom: DOWN 0/1 replicas"), shown
    assert "not restarted: replica r0 not restarted after 2 restart(s)" in shown, shown
    assert "r0: 2 restart(s), no more (limit reached), last failure:" in shown, shown
    assert pbstk("cancel", "oom").exit_code == 0


def test_a_replica_recorded_final_before_the_keeper_looked_is_its_own_not_a_stranger(
        svc_profile: str) -> None:  # noqa: F811
    """A replica's status once recorded final (``status`` by anyone) carries no address: the keeper still knows
    the worker URL it added as its own job's, takes it out of the router as such, and replaces the job."""
    result = serve("--replicas", "1", "--name", "own", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), "own")
    first = rec.slots[0].current or ""
    server = server_of(first)
    dead = f"http://127.0.0.1:{server['port']}"
    wait_for(lambda: workers(rec) == [dead], 15, "the replica in the router")
    os.kill(int(json.loads((service_dir("own") / "keeper.json").read_text())["pid"]), signal.SIGKILL)
    wait_for(lambda: not keeper_alive("own"), 10, "the keeper gone")
    os.kill(int(str(server["pid"])), signal.SIGKILL)
    wait_for(lambda: pbstk("status", first, "--json").exit_code == 0 and JobStore().find(first).final_state, 30,
             "the replica recorded FAILED")
    assert dead in workers(rec)  # nobody took it out: the keeper was not running
    assert pbstk("service", "resume", "own").exit_code == 0
    wait_for(lambda: dead not in workers(rec), 15, "the dead worker out of the router")
    log = keeper_log("own")
    assert "added by someone else" not in log, log
    assert f"removed {first} ({dead}) from the router: FAILED" in log, log
    wait_for(lambda: service_json("own")["state"] == "READY", 60, "READY again with a replacement")
    assert records.find(JobStore(), "own").slots[0].restarts == 1
    assert pbstk("cancel", "own").exit_code == 0


def test_a_service_cancelled_while_a_replacement_waits_its_backoff_is_not_healed(svc_profile: str) -> None:  # noqa: F811
    result = serve("--replicas", "1", "--name", "cx", "--restart-backoff", "3s", "--wait", "--timeout", "90")
    assert result.exit_code == 0, result.output
    first = records.find(JobStore(), "cx").slots[0].current or ""
    os.kill(int(str(server_of(first)["pid"])), signal.SIGKILL)
    wait_for(lambda: "restart in" in keeper_log("cx"), 30, "the failure noted, its replacement waiting")
    assert pbstk("cancel", "cx").exit_code == 0
    wait_for(lambda: not keeper_alive("cx"), 15, "the keeper gone")
    assert [r.name for r in JobStore().all() if r.name.startswith("cx-")] == ["cx-r0"]
    assert records.find(JobStore(), "cx").state == "CANCELLED"
