"""A service name where a job name would do: ``wait``, ``metrics``, ``logs``, ``doctor``, ``bench``.

One service of two replicas (local scheduler, stand-in vLLM) behind the real vllm-router on loopback, looked at
through each command; the router's own Prometheus figures are read from the real router.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import pbstk, until, wait_for
from test_service import ROUTER, chat, serve, svc_profile  # noqa: F401 - svc_profile is a fixture

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.settings.front_servers import ONE_GPU_SERVERS

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def ok(*args: str) -> Any:
    result = pbstk(*args)
    assert result.exit_code == 0, (args, result.output)
    return result


def router_requests(name: str) -> float:
    doc = json.loads(ok("metrics", name, "--json", "--interval", "0.1").stdout)
    return float(doc["router"]["requests_total"])


def test_a_service_name_works_for_wait_metrics_logs_doctor_and_bench(svc_profile: str,  # noqa: F811
                                                                      standins: Path) -> None:
    assert serve("--replicas", "2", "--name", "ns", "--vllm-arg=--enforce-eager").exit_code == 0

    # wait: until the service is READY (it used to say: unknown job 'ns')
    waited = json.loads(ok("wait", "ns", "--json", "--timeout", "60").stdout)
    assert (waited["kind"], waited["state"], waited["ready"]) == ("service", "READY", 2)
    assert ok("wait", "ns", "--timeout", "10").stdout.startswith(f"service ns ready: {waited['url']}")
    rec = records.find(JobStore(), "ns")
    url, key = rec.url, rec.api_key
    assert url and key
    wait_for(lambda: len(requests.get(url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 2, 10,
             "both replicas in the router")
    for _ in range(6):
        assert chat(url, key).status_code == 200
    # issue 43: the hop a service's requests waited at was the replica's one vLLM API-server process; each
    # one-GPU replica now runs several behind its port, and the router's requests reach them
    for slot in rec.slots:
        log = Path(JobStore().find(slot.current or "").run_dir, "vllm.log").read_text()
        assert f"Started {ONE_GPU_SERVERS} API server processes" in log, log[-2000:]

    # metrics: per replica, their sum, and the router's own figures. Each replica runs several API servers (the
    # one-GPU preset's): their requests gauges keep the last busy step's value, read as 0 once the engine has made
    # no progress for a second (vllm/prom.py): the look that counts is the first that says nothing runs
    def settled() -> dict[str, Any] | None:
        look = json.loads(ok("metrics", "ns", "--json", "--interval", "0.2").stdout)
        return look if look["aggregate"]["running"] == 0 else None

    doc = wait_for(settled, 10, "the replicas' stale running gauges read as 0")
    assert doc["kind"] == "service_metrics" and doc["name"] == "ns"
    assert [r["replica"] for r in doc["replicas"]] == [0, 1]
    assert {r["job_id"] for r in doc["replicas"]} == {s.current for s in rec.slots}
    per = [r["totals"]["generation_tokens"] for r in doc["replicas"]]
    assert all(p and p > 0 for p in per), per  # round robin: both replicas served some of the 6 requests
    assert doc["aggregate"]["totals"]["generation_tokens"] == sum(per) == 6 * 3
    assert doc["aggregate"]["replicas"] == 2
    router = doc["router"]
    assert router["requests_total"] >= 6 and router["active_workers"] == 2
    assert sorted(w["url"] for w in router["workers"]) == sorted(requests.get(url[:-3] + "/list_workers",
                                                                              timeout=5).json()["urls"])
    assert all(w["healthy"] and w["circuit"] == "closed" for w in router["workers"])
    assert router["duration_p50_ms"] is not None
    looks = [json.loads(line) for line in ok("metrics", "ns", "--watch", "0.2", "--count", "2", "--json")
             .stdout.splitlines()]
    assert [(m["kind"], m["aggregate"]["window"], m["router"]["window"]) for m in looks] == [
        ("service_metrics", "interval", "interval")] * 2
    text = ok("metrics", "ns", "--interval", "0.1").stdout
    assert "service ns: 2 replica(s) scraped" in text and "all replicas:" in text, text
    assert "router: " in text and "workers 2/2 healthy" in text, text

    # logs: the router's by default, a replica's with --replica K
    router_log = ok("logs", "ns", "-n", "1000").stdout
    assert router_log.strip() and "Starting vLLM server" not in router_log
    plain = re.sub(r"\x1b\[[0-9;]*m", "", Path(rec.router["run_dir"], "router.log").read_text())
    assert plain.endswith(router_log[-200:]) and "Added worker" in router_log  # click drops colours off a tty
    replica_log = ok("logs", "ns", "--replica", "1").stdout
    assert "Starting vLLM server" in replica_log
    bad = pbstk("logs", "ns", "--replica", "5")
    assert bad.exit_code == 2 and "replicas 0 to 1" in bad.stderr, bad.output
    bad = pbstk("logs", "ns", "--stream", "sched-out")
    assert bad.exit_code == 2 and "add --replica K" in bad.stderr, bad.output

    # doctor: router, keeper, each replica (or one)
    diag = json.loads(ok("doctor", "ns", "--json").stdout)
    assert diag["kind"] == "service_diagnosis" and diag["router"]["running"] and diag["router"]["keeper_running"]
    assert len(diag["router"]["workers"]) == 2 and not diag["findings"], diag["findings"]
    assert [(r["replica"], r["kind"]) for r in diag["replicas"]] == [(0, "diagnosis"), (1, "diagnosis")]
    # a replica's eager mode is a finding, without a `pbstk launch` to relaunch it: the service brings it back
    eager = [f for r in diag["replicas"] for f in r["findings"] if f["code"] == "eager-mode"]
    assert len(eager) == 2 and all(f["relaunch"] is None for f in eager), eager
    one = json.loads(ok("doctor", "ns", "--replica", "1", "--json").stdout)
    assert [r["job_id"] for r in one["replicas"]] == [rec.slots[1].current]
    assert "service ns (READY): router running, 2 worker(s), keeper running" in ok("doctor", "ns").stdout

    # bench: the load goes through the router, with the service's key
    before = router_requests("ns")
    bench = json.loads(ok("bench", "ns", "--client", "builtin", "-c", "2", "--num-prompts", "8", "--input-len", "8",
                          "--output-len", "4", "--json").stdout)
    assert (bench["job_id"], bench["preset"]) == ("service:ns", "service")
    assert [(r["completed"], r["failed"]) for r in bench["results"]] == [(8, 0)]
    level = bench["results"][0]  # vLLM's own time: the replicas' histograms added (perf/server_time.py)
    assert 0 < level["server_e2e_ms"] <= 1.02 * level["mean_e2el_ms"] + 5, level
    assert router_requests("ns") - before >= 8  # the 8 prompts (and the warm-up) went through the router
    by_vllm = json.loads(ok("bench", "ns", "--client", "vllm", "-c", "1", "--num-prompts", "8", "--json").stdout)
    assert by_vllm["results"][0]["client"] == "vllm"
    argv = json.loads((standins / "bench.jsonl").read_text().splitlines()[-1])["argv"]
    assert argv[argv.index("--base-url") + 1] == url[: -len("/v1")]  # vllm bench serve, pointed at the router

    # logs -f follows the router's log until the service ends
    follow = subprocess.Popen([sys.executable, "-m", "pbs_toolkit.cli.main", "logs", "ns", "-f", "-n", "1"],  # noqa: S603
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        assert until(follow.stdout.readline, timeout=15, what="the router log's last line").strip()
        assert ok("cancel", "ns").stdout.startswith("ns: cancelled")
        follow.communicate(timeout=20)
        assert follow.returncode == 0
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()


def test_a_job_name_refuses_replica_and_an_unready_service_says_so(svc_profile: str) -> None:  # noqa: F811
    assert serve("--name", "nr").exit_code == 0
    job = pbstk("logs", "nr-r0", "--replica", "0")
    assert job.exit_code == 2 and "is a job, not a service" in job.stderr, job.output
    rec = records.find(JobStore(), "nr")
    records.end(JobStore(), rec, "CANCELLED")  # as cancel records it first, before it stops anything
    try:
        for command in ("metrics", "bench"):
            result = pbstk(command, "nr")
            assert result.exit_code == 5 and "service nr is CANCELLED" in result.stderr, result.output
        assert "the service is CANCELLED" in ok("doctor", "nr").stdout
        waited = pbstk("wait", "nr", "--timeout", "5")
        assert waited.exit_code == 5 and "service nr is CANCELLED" in waited.stderr, waited.output
    finally:  # then what cancel does next: keeper, replica and router stopped
        from pbs_toolkit.client import Client
        from pbs_toolkit.services.stop import teardown

        with Client(on_removal=lambda r: None) as c:
            teardown(c.service_session(), records.find(c.store, "nr"), "CANCELLED")


def test_update_endpoint_via_tunnel_of_a_service(svc_profile: str, tmp_path: Path) -> None:  # noqa: F811
    """A laptop reaches a login-node router through the SSH connection: the entry is the tunnel's URL, the hint's
    `env --local-url` exports it, and SIGTERM closes the tunnel and takes the entry back."""
    import signal

    from pbs_toolkit.endpoints.registry import read_endpoints

    assert serve("--name", "vt", "--wait", "--timeout", "60").exit_code == 0
    rec = records.find(JobStore(), "vt")
    registry = tmp_path / "endpoints.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit.cli.main", "update-endpoint", "vt",  # noqa: S603
                             "--registry", str(registry), "--via-tunnel"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        until(proc.stdout.readline, timeout=30, what="the registry line")
        hint = until(proc.stdout.readline, timeout=10, what="the env hint")
        url = read_endpoints(registry)["vt"].url
        assert url.startswith("http://127.0.0.1:") and url != rec.url, (url, rec.url)  # the tunnel, not the router
        local = hint.split("--local-url ", 1)[1].split(")", 1)[0]
        assert local + "/v1" == url, hint
        assert f"export OPENAI_BASE_URL={url}" in ok("env", "vt", "--local-url", local).stdout
        wait_for(lambda: chat(url, rec.api_key).status_code == 200, 15, "a chat through the tunnel and the router")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "vt" not in read_endpoints(registry), registry.read_text()
