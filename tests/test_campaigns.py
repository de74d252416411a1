"""``pbstk run`` and ``pbstk usage`` with real parts: the local scheduler and the fake PBS running the stand-in
``vllm``, a real client (the ``openai`` package) as COMMAND, real signals, and the schedulers' own accounting.

pbstk runs as a subprocess (``sys.executable -m pbs_toolkit``): COMMAND writes to the real stdout and gets real
signals, which an in-process runner cannot show.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import helpers
import pytest
import yaml
from helpers import MODEL

from pbs_toolkit.jobs.store import JobStore

TESTS = Path(__file__).resolve().parent
LOCAL = ("--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto")

EVAL = textwrap.dedent("""\
    import os, sys
    from openai import OpenAI

    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from pbstk run
    model = client.models.list().data[0].id
    prompt = output = 0
    for q in ("What is two plus two?", "Name a prime number now.", "Say hello."):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=7)
        prompt, output = prompt + r.usage.prompt_tokens, output + r.usage.completion_tokens
    print(f"eval done: model={model} prompt={prompt} output={output}")
    print("args:", sys.argv[1:], "key-in-argv:", os.environ["OPENAI_API_KEY"] in " ".join(sys.argv))
    sys.exit(int(os.environ.get("EVAL_EXIT", "0")))
""")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, check=False, env=env or _env())


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS.parent), **extra}


def usage_of(*refs: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = cli("usage", *refs, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_run_openai_client_passes_exit_codes_and_records_usage(standins: Path, tmp_path: Path) -> None:
    script = tmp_path / "eval.py"
    script.write_text(EVAL)
    ok = cli("run", MODEL, *LOCAL, "--name", "ev", "--", sys.executable, str(script), "--limit", "3")
    assert ok.returncode == 0, ok.stderr
    # COMMAND's stdout unchanged and alone on stdout; pbstk's own lines on stderr
    assert ok.stdout.splitlines() == [f"eval done: model={MODEL} prompt=12 output=21",
                                      "args: ['--limit', '3'] key-in-argv: False"], ok.stdout
    assert "pbstk: launched" in ok.stderr and "READY" in ok.stderr and "pbstk: cancelled" in ok.stderr
    doc = usage_of("ev")
    row = doc["jobs"][0]
    # the server's own counters, recorded before the cancel, agree with what the client was told
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"]) == (3, 12, 21), row
    assert row["counters_source"] == "recorded" and row["walltime_source"] == "wall clock", row
    assert row["gpus"] == 1 and row["nodes"] == 1 and row["walltime_s"] is not None
    assert row["gpu_hours"] == pytest.approx(row["walltime_s"] / 3600, abs=1e-4)
    assert doc["totals"]["output_tokens"] == 21 and doc["totals"]["jobs"] == 1
    assert [r["name"] for r in usage_of("--since", "1h")["jobs"]] == ["ev"]
    assert usage_of("--since", "2099-01-01")["jobs"] == []
    table = cli("usage").stdout.splitlines()
    assert table[0].split()[:4] == ["JOB", "NAME", "NODES", "GPUS"]
    assert table[-1].split()[:3] == ["TOTAL", "1", "job(s)"]
    # the job is gone: cancelled by run
    assert helpers.wait_recorded("ev", "CANCELLED")["state"] == "CANCELLED"


def test_run_passes_exit_codes_and_signals(standins: Path, tmp_path: Path) -> None:
    script = tmp_path / "eval.py"
    script.write_text(EVAL)
    three = cli("run", MODEL, *LOCAL, "--name", "ev3", "--", sys.executable, str(script),
                env=_env(EVAL_EXIT="3"))
    assert three.returncode == 3 and "eval done" in three.stdout, three.stderr
    killed = cli("run", MODEL, *LOCAL, "--name", "evk", "--", "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr
    totals = usage_of()["totals"]
    assert totals["jobs"] == 2 and totals["requests"] == 3 and totals["output_tokens"] == 21, totals



def test_ctrl_c_during_command_leaves_no_process_and_no_entry(standins: Path, tmp_path: Path) -> None:
    registry = tmp_path / "endpoints.yaml"
    pidfile = tmp_path / "child.pid"
    child = tmp_path / "child.sh"  # a COMMAND with a grandchild in its process group
    child.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ > {pidfile}\nwait\n")
    child.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *LOCAL, "--name", "cc",  # noqa: S603
                             "--registry", str(registry), "--", str(child)], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with helpers.interrupting(proc, 60) as interrupt:
        helpers.until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=60, what="COMMAND started")
        entries = yaml.safe_load(registry.read_text())["endpoints"]
        assert list(entries) == ["cc"]  # written before COMMAND ran
        pgid = int(pidfile.read_text())
        assert helpers.group_alive(pgid)
        err = interrupt()
    assert proc.returncode == 130, err  # sh ended by the forwarded SIGINT
    assert not helpers.group_alive(pgid), "COMMAND's process group outlived pbstk run"
    assert yaml.safe_load(registry.read_text())["endpoints"] in ({}, None), err
    assert helpers.wait_recorded("cc", "CANCELLED")["state"] == "CANCELLED"


def test_sigterm_before_command_cancels_the_launch(standins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *LOCAL, "--name", "tw",  # noqa: S603
                             "--", "touch", str(marker)], env=_env(PBSTK_TEST_STANDIN_MODE="hang"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: JobStore().all(), timeout=60, what="the launch")
        helpers.until(lambda: helpers.status_of("tw")["state"] == "STARTING", timeout=60, what="STARTING")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not marker.exists()
    assert helpers.wait_recorded("tw", "CANCELLED")["state"] == "CANCELLED"


def test_failed_launch_exits_with_pbstks_code_without_command(standins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    failed = cli("run", MODEL, *LOCAL, "--name", "oom", "--", "touch", str(marker),
                 env=_env(PBSTK_TEST_STANDIN_MODE="fatal"))
    assert failed.returncode == 5, failed.stderr  # ServerFailed, as `launch --wait`
    assert "pbstk: error:" in failed.stderr and "CUDA out of memory" in failed.stderr
    assert not marker.exists()
    missing = cli("run", MODEL, *LOCAL, "--", "no-such-command-pbstk")
    assert missing.returncode == 2 and "not found" in missing.stderr, missing.stderr
    assert [r.name for r in JobStore().all()] == ["oom"]  # nothing launched for the missing COMMAND


def test_reuse_keeps_the_server_and_keep_leaves_it_up(standins: Path, tmp_path: Path) -> None:
    registry = tmp_path / "endpoints.yaml"
    kept = cli("run", MODEL, *LOCAL, "--name", "kp", "--keep", "--registry", str(registry), "--", "true")
    assert kept.returncode == 0, kept.stderr
    assert helpers.status_of("kp")["state"] == "READY"
    assert yaml.safe_load(registry.read_text())["endpoints"] in ({}, None)  # the entry goes, the server stays
    out = tmp_path / "url"
    reused = cli("run", "--reuse", "kp", "--", "sh", "-c", f'echo "$OPENAI_BASE_URL $NO_PROXY" > {out}')
    assert reused.returncode == 0, reused.stderr
    url, no_proxy = out.read_text().split()
    assert url == helpers.status_of("kp")["url"] and "127.0.0.1" in no_proxy.split(",")
    assert helpers.status_of("kp")["state"] == "READY"  # not ours to cancel
    refused = cli("run", "--reuse", "kp", "--preset", "single", "--", "true")
    assert refused.returncode == 2 and "--reuse takes no launch" in refused.stderr
    assert cli("cancel", "kp").returncode == 0


# -- usage from the schedulers' own accounting ---------------------------------------------------------------


def _qstat(job: str) -> dict[str, Any]:
    out = subprocess.run(["qstat", "-x", "-f", "-F", "json", job], capture_output=True, text=True,  # noqa: S603,S607
                         check=True).stdout
    return dict(next(iter(json.loads(out)["Jobs"].values())))


def test_usage_matches_the_fake_pbs_accounting(standins: Path, fakepbs: Path, tmp_path: Path) -> None:
    launched = cli("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                   "--name", "pu", "--wait", "--timeout", "60")
    assert launched.returncode == 0, launched.stderr
    job = launched.stdout.split()[1]
    st = helpers.status_of(job)
    host, port = st["url"].split("//")[1].split("/")[0].split(":")
    import urllib.request

    request = urllib.request.Request(f"http://{host}:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "one two three", "max_tokens": 5}).encode(),
                                     headers={"Authorization": f"Bearer {_key(job)}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - loopback
        assert answer.status == 200
    live = usage_of(job)["jobs"][0]
    assert live["counters_source"] == "live" and live["output_tokens"] == 5 and live["prompt_tokens"] == 3
    helpers.until(lambda: _qstat(job)["resources_used"]["walltime"] != "00:00:00", timeout=10, what="walltime")
    assert cli("cancel", job).returncode == 0
    helpers.until(lambda: _qstat(job)["job_state"] == "F", timeout=30, what="F")
    info = _qstat(job)
    h, m, s = (int(x) for x in info["resources_used"]["walltime"].split(":"))
    row = usage_of(job)["jobs"][0]
    assert row["walltime_s"] == h * 3600 + m * 60 + s and row["walltime_source"] == "qstat resources_used.walltime"
    assert row["gpus"] == int(info["Resource_List"]["ngpus"]) == 4
    assert row["nodes"] == int(info["Resource_List"]["nodect"]) == 1
    assert row["ended"] is True and row["counters_source"] == "recorded" and row["output_tokens"] == 5, row
    assert row["gpu_hours"] == pytest.approx(row["walltime_s"] * 4 / 3600, abs=1e-4)
    assert row["output_tokens_per_gpu_hour"] == pytest.approx(5 / (row["walltime_s"] * 4 / 3600), rel=1e-2)
    # kept with the job: the figures survive the scheduler forgetting it (history expired)
    for path in (fakepbs / "jobs").glob("*.json"):
        path.unlink()
    again = usage_of(job)["jobs"][0]
    assert again["walltime_s"] == row["walltime_s"] and again["walltime_source"] == row["walltime_source"]


def _key(job: str) -> str:
    key = JobStore().find(job).api_key
    assert key
    return key


def test_usage_refuses_bad_input() -> None:
    assert cli("usage", "nosuchjob").returncode == 7
    bad = cli("usage", "--since", "yesterday-ish")
    assert bad.returncode == 2 and bad.stderr.startswith("pbstk: error: --since"), bad.stderr
    empty = cli("usage")
    assert empty.returncode == 0 and empty.stdout.strip() == "no jobs to report"


def test_parse_sacct_allocations_and_completion() -> None:
    from pbs_toolkit.schedulers.slurm.accounting import parse_sacct

    # sacct --allocations --parsable2 --format=JobID,Elapsed,NNodes,State,AllocTRES (slurmdbd)
    text = ("41|01:02:03|2|CANCELLED by 1000|billing=8,cpu=8,gres/gpu=8,mem=64G,node=2\n"
            "42|1-00:00:10|1|RUNNING|billing=4,cpu=4,mem=16G,node=1\n"
            "43|00:00:00|1|PENDING|\n")
    found = parse_sacct(text, "sacct Elapsed")
    assert (found["41"].walltime_s, found["41"].nodes, found["41"].gpus, found["41"].final) == (3723, 2, 8, True)
    assert (found["42"].walltime_s, found["42"].gpus, found["42"].final) == (86410, None, False)
    assert found["43"].final is False
    # sacct --completion (jobcomp/filetxt): no TRES column
    done = parse_sacct("7|00:00:42|1|COMPLETED\n", "sacct -c Elapsed")
    assert (done["7"].walltime_s, done["7"].final, done["7"].source) == (42, True, "sacct -c Elapsed")


ROUTER = Path(sys.executable).parent / "vllm-router"


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
def test_run_with_replicas_serves_a_service_and_usage_groups_it(standins: Path, isolated_user: Path,
                                                                tmp_path: Path) -> None:
    helpers.local_service_profile(isolated_user, ROUTER)
    script, registry = tmp_path / "eval.py", tmp_path / "endpoints.yaml"
    script.write_text(EVAL)
    env = _env(PBSTK_SERVICE_POLL_S="0.5", PBSTK_TEST_STANDIN_DELAY="0")
    ran = cli("run", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "2", "--name", "sv",
              "--registry", str(registry), "--", sys.executable, str(script), env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"eval done: model={MODEL} prompt=12 output=21"), ran.stdout
    assert "2/2 replicas READY" in ran.stderr and "pbstk: cancelled sv" in ran.stderr, ran.stderr
    assert yaml.safe_load(registry.read_text())["endpoints"] in ({}, None)
    doc = usage_of("sv", env=env)
    assert [(r["name"], r["kind"], r["service"]) for r in doc["jobs"]] == [("sv-r0", "replica", "sv"),
                                                                          ("sv-r1", "replica", "sv")]
    assert sum(r["requests"] for r in doc["jobs"]) == 3  # through the router, spread over both replicas
    (svc,) = doc["services"]
    assert svc["service"] == "sv" and svc["jobs"] == 2 and svc["output_tokens"] == 21 and svc["gpus"] == 2
    assert doc["totals"]["output_tokens"] == 21
    status = cli("status", "sv", "--json", env=env)
    assert json.loads(status.stdout)[0]["state"] == "CANCELLED", status.stdout


SERVICE_SEEN = textwrap.dedent("""\
    import json, subprocess, sys
    out = subprocess.run([sys.executable, "-m", "pbs_toolkit", "status", "sa", "--json"], capture_output=True,
                         text=True, check=True).stdout
    svc = json.loads(out)[0]
    print("seen:", json.dumps({"spec": svc["autoscale"]["spec"], "idle": svc["idle_cancel_s"]}, sort_keys=True))
""")


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
def test_run_takes_the_autoscaling_and_idle_options_of_serve(standins: Path, isolated_user: Path,
                                                             tmp_path: Path) -> None:
    """``run --min/--max-replicas`` serves an autoscaled service (``scale`` reaches ``serve``) and ``--idle-cancel``
    comes with the render options; bad combinations are one error line before anything launches."""
    helpers.local_service_profile(isolated_user, ROUTER)
    script = tmp_path / "seen.py"
    script.write_text(SERVICE_SEEN)
    env = _env(PBSTK_SERVICE_POLL_S="0.5", PBSTK_TEST_STANDIN_DELAY="0")
    for bad, says in ((("--replicas", "2", "--max-replicas", "3"), "--replicas N keeps a fixed N"),
                      (("--scale-down-idle", "5m"), "need --max-replicas"),
                      (("--idle-cancel", "soon"), "--idle-cancel 'soon'")):
        refused = cli("run", MODEL, "--profile", "svc", *bad, "--", sys.executable, "-c", "pass", env=env)
        assert refused.returncode == 2 and refused.stderr.startswith("pbstk: error: "), refused.stderr
        assert says in refused.stderr and len(refused.stderr.splitlines()) == 1, refused.stderr
    reuse = cli("run", "--reuse", "sa", "--max-replicas", "2", "--", sys.executable, "-c", "pass", env=env)
    assert reuse.returncode == 2 and "--reuse takes no launch or serve options" in reuse.stderr, reuse.stderr
    assert not list(JobStore().all())  # nothing launched by any of them
    ran = cli("run", MODEL, "--profile", "svc", "--preset", "single", "--min-replicas", "1", "--max-replicas", "2",
              "--scale-up-waiting", "3", "--idle-cancel", "30m", "--name", "sa", "--", sys.executable, str(script),
              env=env)
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout.split("seen:", 1)[1])
    assert seen["idle"] == 1800.0
    assert (seen["spec"]["min_replicas"], seen["spec"]["max_replicas"], seen["spec"]["up_waiting"]) == (1, 2, 3.0)
    assert "pbstk: cancelled sa" in ran.stderr, ran.stderr


@pytest.mark.ssh
def test_run_over_ssh_through_a_tunnel(login_node: Any, tmp_path: Path) -> None:
    """Submitted through a real sshd to the fake PBS behind it; COMMAND runs here and reaches the node through a
    tunnel over the job's SSH connection (forced: on loopback the node would answer directly)."""
    script = tmp_path / "eval.py"
    script.write_text(EVAL.replace("sys.exit(", "print('base:', os.environ['OPENAI_BASE_URL'])\nsys.exit("))
    env = _env(PBSTK_SSH_CONFIG=str(login_node.ssh_config), PBSTK_KNOWN_HOSTS=str(login_node.known_hosts))
    ran = cli("run", MODEL, "--ssh", login_node.alias, "--profile", "generic-pbspro", "--preset", "dp4",
              "--port", "auto", "--name", "tun", "--via-tunnel", "--", sys.executable, str(script), env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"eval done: model={MODEL} prompt=12 output=21"), ran.stdout
    assert "reached through a tunnel on http://127.0.0.1:" in ran.stderr, ran.stderr
    record = JobStore().find("tun")
    node_url = f"http://{record.extra['verified_endpoint']}/v1"
    tunnel_url = ran.stdout.split("base: ", 1)[1].strip()
    assert tunnel_url.startswith("http://127.0.0.1:") and tunnel_url != node_url
    row = usage_of("tun", env=env)["jobs"][0]
    assert row["transport"] == login_node.alias and row["output_tokens"] == 21, row
    assert row["walltime_source"] == "qstat resources_used.walltime" and row["gpus"] == 4, row


def test_a_services_jobs_are_its_replicas_and_successors_over_its_life() -> None:
    from pbs_toolkit.campaigns.usage import service_jobs
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.record import ServiceRecord

    def rec(name: str, created: float, transport: str = "") -> JobRecord:
        return JobRecord(job_id=f"{name}.id", scheduler="pbs", profile="p", model="m", served_model_name="m",
                         preset="single", name=name, run_dir="/r", transport=transport, created=created)

    svc = ServiceRecord(name="q", model="m", served_model_name="m", profile="p", replicas=2, request={},
                        created=100.0, ended=500.0)
    records = [rec("q-r0", 101), rec("q-r1", 102), rec("q-r0-g1", 300), rec("q-r10-g2", 400),
               rec("q-r0", 50),  # an earlier service of the same name
               rec("q-r1", 600),  # a later one
               rec("q-r1", 150, transport="login1"),  # another login node's
               rec("q-router", 101), rec("qq-r0", 101), rec("q-r0-gx", 101)]
    assert [r.name for r in service_jobs(records, svc)] == ["q-r0", "q-r1", "q-r0-g1", "q-r10-g2"]


def test_reachable_tells_an_open_port_from_a_closed_one() -> None:
    import socket

    from pbs_toolkit.campaigns.run import reachable

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert reachable("127.0.0.1", port)
    assert not reachable("127.0.0.1", port, timeout=1) and not reachable(None, port)


def test_sigterm_while_the_job_is_submitted_cancels_it(standins: Path, fakepbs: Path, tmp_path: Path) -> None:
    """The launch holds the signal until the job is recorded (jobs/launch.py), then exits: run must still find
    the job it launched and cancel it, and COMMAND must not run."""
    marker = tmp_path / "ran"
    helpers.set_faults(fakepbs, slow_qsub=2.0)
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, "--preset", "dp4",  # noqa: S603
                             "--profile", "generic-pbspro", "--port", "auto", "--name", "sub", "--",
                             "touch", str(marker)], env=_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: helpers.fake_jobs(fakepbs), timeout=60, what="qsub to create the job")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "pbstk: cancelled" in err and not marker.exists(), err
    helpers.until(lambda: set(helpers.fake_jobs(fakepbs).values()) == {"F"}, timeout=30, what="the job to end")
