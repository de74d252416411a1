"""Profile ``router: job``: the service's vllm-router inside a small CPU job of the profile's scheduler.

The router job is rendered from the same job template as a server (entry script ``start_router.sh``), submitted
through the normal backend (the local scheduler, the fake PBS), and the real ``vllm-router`` runs in it; the
replicas are stand-in vllm jobs. Everything on loopback, every loop bounded.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import MODEL, pbstk, wait_for

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.router import job as router_job
from pbs_toolkit.settings.profiles import Profile, validate

ROUTER = Path(sys.executable).parent / "vllm-router"
needs_router = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")


def write_profile(home: Path, scheduler: str, extra: str = "") -> None:
    directory = home / "config" / "pbstk" / "profiles"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rj.yaml").write_text(
        f"name: rj\nscheduler: {scheduler}\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nport: 8000\nrouter: job\nrouter_command: {ROUTER}\n{extra}")


def _stop_services() -> None:
    import contextlib

    from pbs_toolkit.client import Client

    with contextlib.suppress(Exception), Client(on_removal=lambda r: None) as c:
        for rec in c.services():
            with contextlib.suppress(Exception):
                c.cancel_service(rec)


def chat(url: str, key: str | None) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/chat/completions", json=body, headers=headers, timeout=10)


def service_json(name: str) -> dict[str, Any]:
    result = pbstk("status", name, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout)[0])


def router_pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def serve_two_then_cancel(name: str, timeout: str) -> None:
    """``serve --replicas 2`` with ``router: job`` -> READY 2/2, one chat through the router's URL; ``cancel``
    stops the router job (and so the router) with the replicas."""
    result = pbstk("serve", MODEL, "--profile", "rj", "--preset", "single", "--replicas", "2", "--name", name,
                   "--wait", "--timeout", timeout)
    assert result.exit_code == 0, result.output
    rec = records.find(JobStore(), name)
    job = rec.router_job
    assert job["job_id"] and job["name"] == f"{name}-router", rec
    # the router job's run directory: the job script runs start_router.sh, router.json is 0644 and keyless
    info_file = Path(job["run_dir"], "router.json")
    assert oct(info_file.stat().st_mode & 0o777) == "0o644"
    info = json.loads(info_file.read_text())
    assert rec.api_key and rec.api_key not in info_file.read_text()
    assert (rec.router["host"], rec.router["port"]) == (info["host"], info["port"]) and info["host"] == "127.0.0.1"
    assert rec.router["port"] not in (30000, 8000) and rec.router["prometheus_port"] != 29000

    doc = service_json(name)
    assert (doc["state"], doc["ready"], doc["router_running"]) == ("READY", 2, True), doc
    assert doc["router_job"]["job_id"] == job["job_id"] and doc["router_job"]["state"] == "running", doc
    shown = pbstk("status", name).stdout
    assert f"router running (job {job['job_id']}, running)" in shown, shown
    url = doc["url"]
    wait_for(lambda: len(requests.get(url[:-3] + "/list_workers", timeout=5).json()["urls"]) == 2, 20,
             "both replicas in the router")
    assert chat(url, rec.api_key).status_code == 200
    assert chat(url, None).status_code == 401
    # its admin API is the owner's (router_isolation netns, the default): 403 without the token in the 0600
    # router.token, which the record keeps and --json never shows
    token_file = Path(job["run_dir"], "router.token")
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert rec.router["admin_token"] == token_file.read_text().strip() and "admin_token" not in json.dumps(doc)
    assert requests.post(url[:-3] + "/add_worker", params={"url": "http://127.0.0.1:9"}, timeout=5).status_code == 403

    cancelled = pbstk("cancel", name)
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.startswith(f"{name}: cancelled (service: 3 job(s)"), cancelled.output
    wait_for(lambda: not router_pid_alive(int(info["pid"])), 30, "the router in its job to be gone")
    assert records.find(JobStore(), name).state == "CANCELLED"


@needs_router
def test_router_job_on_the_local_scheduler(isolated_user: Path, standins: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # power_of_two: the router refuses it with fewer than 2 workers at start; start_router.sh seeds it with the
    # router's own Prometheus port and removes that again before router.json (serve_two_then_cancel then sees
    # exactly the two replicas in /list_workers)
    write_profile(isolated_user, "local", "router_policy: power_of_two\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    try:
        serve_two_then_cancel("rjl", "90")
        assert records.find(JobStore(), "rjl").policy == "power_of_two"
    finally:
        _stop_services()


@needs_router
def test_router_job_on_the_fake_pbs(isolated_user: Path, standins: Path, fakepbs: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(isolated_user, "pbs", "router_job_queue: cpuq\nrouter_job_walltime: '00:05:00'\n")
    monkeypatch.setenv("PBSTK_SERVICE_POLL_S", "0.5")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0")
    try:
        serve_two_then_cancel("rjp", "120")
        job = records.find(JobStore(), "rjp").router_job
        script = Path(job["run_dir"], "job.pbs").read_text()
        # one more qsub: a CPU job in its own queue for its own walltime
        assert "#PBS -q cpuq\n" in script and "#PBS -l walltime=00:05:00\n" in script
        assert "#PBS -l select=1:ncpus=2\n" in script, script
    finally:
        _stop_services()


@needs_router
def test_a_router_job_that_fails_ends_the_service_with_its_reason(isolated_user: Path, standins: Path) -> None:
    (isolated_user / "config" / "pbstk" / "profiles").mkdir(parents=True)
    (isolated_user / "config" / "pbstk" / "profiles" / "rj.yaml").write_text(
        "name: rj\nscheduler: local\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        "address: loopback\nbind_host: 127.0.0.1\nrouter: job\nrouter_command: /nonexistent/vllm-router\n")
    result = pbstk("serve", MODEL, "--profile", "rj", "--preset", "single", "--name", "bad")
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("pbstk: error: the router job ") and "ended before its router answered" in lines[0]
    assert any("/nonexistent/vllm-router not found" in line for line in lines[1:]), result.stderr
    rec = records.find(JobStore(), "bad")
    assert rec.state == "ENDED" and not rec.slots[0].current  # no replica launched


# -- rendering: the same job template, another entry script; every value quoted; shellcheck-clean ------------


def _profile(scheduler: str, **extra: Any) -> Profile:
    base: dict[str, Any] = {"name": "rj", "scheduler": scheduler, "nodes": 4, "gpus_per_node": 4,
                            "cpus_per_node": 32, "walltime": "06:00:00", "queue": "gpuq", "router": "job"}
    return validate(Profile(**{**base, **extra}))


@pytest.mark.parametrize("scheduler", ["pbs", "slurm", "local"])
def test_router_job_script_renders_a_cpu_job_that_shellcheck_accepts(scheduler: str, tmp_path: Path) -> None:
    prof = router_job.job_profile(_profile(scheduler, router_job_queue="cpu.q", router_job_walltime="01:30:00",
                                           router_command="'/opt/my env/vllm-router' --log-level warn",
                                           bind_host="0.0.0.0", address="fqdn", address_suffix="-hsn"))
    run_dir = "/runs/svc-router-1"
    job = router_job.render_job_script(prof, "svc-router", run_dir)
    start = router_job.render_start_script(prof, run_dir, "svc", shlex.split(prof.router_command), "round_robin")
    assert job.rstrip().endswith('exec bash "$RUN_DIR/start_router.sh"'), job
    if scheduler == "slurm":
        assert "--partition=cpu.q" in job and "--time=01:30:00" in job and "--nodes=1\n" in job
        assert "gpu" not in job.lower(), job
    else:
        assert "#PBS -q cpu.q" in job and "walltime=01:30:00" in job and "select=1:ncpus=2\n" in job, job
    assert "ROUTER_CMD=('/opt/my env/vllm-router' --log-level warn)" in start
    assert "BIND_HOST=0.0.0.0" in start and "ADDRESS_MODE=fqdn" in start and "ADDRESS_SUFFIX=-hsn" in start
    files = []
    for name, text in (("job.sh", job), ("start_router.sh", start)):
        path = tmp_path / name
        path.write_text(text)
        files.append(str(path))
        assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0, text  # noqa: S603,S607
    checked = subprocess.run(["shellcheck", "-s", "bash", *files], capture_output=True, text=True, check=False)  # noqa: S603,S607
    assert checked.returncode == 0, checked.stdout


def test_server_job_scripts_still_run_start_vllm() -> None:
    """The template's default entry script is unchanged for servers (the golden files pin the whole text)."""
    from pbs_toolkit.jobs.render import RenderRequest, render

    rendered = render(RenderRequest(model=MODEL, profile="local", preset="cpu"))
    assert rendered.job_script.rstrip().endswith('exec bash "$RUN_DIR/start_vllm.sh"')


def test_router_job_keys_are_checked() -> None:
    from pbs_toolkit.errors import PbstkError

    with pytest.raises(PbstkError, match="router_job_queue"):
        _profile("pbs", router_job_queue="a b")
    with pytest.raises(PbstkError, match="bad walltime"):
        _profile("pbs", router_job_walltime="soon")


# -- a real Slurm (tests/slurm_cluster.py): the router job is one more sbatch --------------------------------


@needs_router
def test_router_job_on_a_real_slurm(isolated_user: Path, slurm_cluster: Any, tmp_path: Path) -> None:
    import os
    import time

    import yaml

    tests = Path(__file__).resolve().parent
    env = {**os.environ, **slurm_cluster.env, "PBSTK_TEST_RECORD": str(tmp_path), "PYTHONPATH": str(tests.parent),
           "PBSTK_SERVICE_POLL_S": "0.5", "PBSTK_TEST_STANDIN_DELAY": "0"}
    env["PATH"] = f"{tests / 'standins'}{os.pathsep}{slurm_cluster.env['PATH']}"
    directory = isolated_user / "config" / "pbstk" / "profiles"
    directory.mkdir(parents=True)
    (directory / "rjs.yaml").write_text(yaml.safe_dump({
        "name": "rjs", "scheduler": "slurm", "queue": slurm_cluster.partition, "nodes": 1,
        "gpus_per_node": slurm_cluster.gpus_per_node, "cpus_per_node": 1, "walltime": "00:10:00",
        "address": "loopback", "bind_host": "127.0.0.1", "vllm_version": "0.11.0", "router": "job",
        "router_command": str(ROUTER), "router_job_walltime": "00:05:00"}))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], env=env, capture_output=True,  # noqa: S603
                              text=True, timeout=150, check=False)

    try:
        result = cli("serve", MODEL, "--profile", "rjs", "--preset", "single", "--replicas", "2", "--name", "rjs",
                     "--wait", "--timeout", "120")
        assert result.returncode == 0, result.stdout + result.stderr
        rec = records.find(JobStore(), "rjs")
        script = Path(rec.router_job["run_dir"], "job.slurm").read_text()
        assert "--time=00:05:00" in script and "gres" not in script and "gpus" not in script, script
        doc = json.loads(cli("status", "rjs", "--json").stdout)[0]
        assert (doc["state"], doc["ready"], doc["router_running"]) == ("READY", 2, True), doc
        assert chat(doc["url"], rec.api_key).status_code == 200
        squeue = slurm_cluster.run("squeue", "-h", "-o", "%i %j %T")
        assert f"{rec.router_job['job_id']} rjs-router RUNNING" in squeue.stdout, squeue.stdout
        assert cli("cancel", "rjs").returncode == 0

        def active() -> bool:
            listed = slurm_cluster.run("squeue", "-h", "-t", "PD,R,CG", "-o", "%i").stdout.split()
            return rec.router_job["job_id"] in listed

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and active():
            time.sleep(0.5)
        assert not active(), "the router job is still in squeue after cancel"
    finally:
        cli("cancel", "rjs")
        slurm_cluster.cancel_all()


# -- one command line for router: login and router: job ------------------------------------------------------

_STUB_ROUTER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv
with open({record!r}, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
class Handler(BaseHTTPRequestHandler):
    def answer(self):
        body = b'{{"urls": []}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *a):
        pass
HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


def _slotted(argv: list[str]) -> list[str]:
    """``argv`` with its ports as the slots ``router_argv`` gets for a router job (they differ between starts)."""
    port, prom = argv[argv.index("--port") + 1], argv[argv.index("--prometheus-port") + 1]
    return [a.replace(prom, router_job.PROM_PORT_SLOT).replace(port, router_job.PORT_SLOT) for a in argv]


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_router_job_starts_the_router_with_the_login_command_line(policy: str, tmp_path: Path) -> None:
    """``router: login`` (``start_router``) and ``router: job`` (``start_router.sh``) run the command line of
    one builder, ``router.router_argv``: the same argv for the same settings, ports aside; power_of_two's start-up
    worker (the router's own Prometheus port, twice) included, and removed by both."""
    from dataclasses import replace

    from pbs_toolkit.services.router.process import router_argv, start_router, stop_router
    from pbs_toolkit.transports.local import LocalRunner

    record = tmp_path / "argv.jsonl"
    stub = tmp_path / "stub-router"
    stub.write_text(f"#!{sys.executable}\n" + _STUB_ROUTER.format(record=str(record)))
    stub.chmod(0o755)
    command = [str(stub), "--log-level", "warn"]
    info = start_router(LocalRunner(), str(tmp_path / "login"), command=command, bind="127.0.0.1", policy=policy,
                        isolate=False)
    try:
        login = json.loads(record.read_text().splitlines()[-1])
    finally:
        stop_router(LocalRunner(), info, timeout=5)

    prof = replace(_profile("local", router_isolation="none", bind_host="127.0.0.1", address="loopback"),
                   router_bind="127.0.0.1")
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    (run_dir / "start_router.sh").write_text(router_job.render_start_script(prof, str(run_dir), "svc", command, policy))
    proc = subprocess.Popen(["bash", str(run_dir / "start_router.sh")],  # noqa: S603,S607
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run_dir / "router.json").exists(), 20, "router.json of the router job")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    job = json.loads(record.read_text().splitlines()[-1])

    expected, seed = router_argv(command, policy=policy, bind="127.0.0.1", port=router_job.PORT_SLOT,
                                 prometheus_port=router_job.PROM_PORT_SLOT)
    assert _slotted(login) == _slotted(job) == expected
    assert (seed is not None) == (policy == "power_of_two") and (seed is None or expected.count(seed) == 2)
    assert "pbstk-router: error" not in (run_dir / "router.log").read_text()


def test_router_job_command_line_behind_the_front_is_the_builders(tmp_path: Path) -> None:
    """Behind the front (router_isolation netns) the job's command line is ``router_argv``'s too, with the
    front's Python and this node's ports put into its slots by the script's own lines."""
    from pbs_toolkit.services.router.process import router_argv

    prof = _profile("local", bind_host="0.0.0.0", address="loopback")
    command = ["vllm-router", "--log-level", "warn"]
    script = router_job.render_start_script(prof, "/runs/r1", "svc", command, "power_of_two")
    header, body = script.split("\nset -uo pipefail\n", 1)
    fill = [line for line in body.splitlines() if line.startswith(("  argv=(", "  SEED="))]
    assert len(fill) == 4, fill
    show = header + "\nPORT=4001 PROM_PORT=4002 FRONT_PY=/usr/bin/python3\n" + "\n".join(fill) + (
        '\nprintf "%s\\n" "$SEED" "${argv[@]}"\n')
    out = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True,  # noqa: S603,S607
                         timeout=10).stdout.splitlines()
    expected, seed = router_argv(command, policy="power_of_two", bind="0.0.0.0", port=4001, prometheus_port=4002,
                                 front=("/usr/bin/python3", "/runs/r1/router_front.py"))
    assert out == [seed, *expected] and seed == "http://127.0.0.1:4002"


def test_router_body_declares_the_header_settings(tmp_path: Path) -> None:
    """``start_router.sh``'s static body declares exactly what its header assigns, so shellcheck of the body
    alone knows them and flags a misspelt one (``$SEED_UR``)."""
    import re

    body_path = Path(router_job.__file__).parent.parent.parent / "server" / "start_router.sh"
    body = body_path.read_text()
    free_port = (body_path.parent / "start" / "free_port.sh").read_text()  # the free-port rule, before the body
    start = router_job.render_start_script(_profile("local"), "/runs/r1", "svc", ["vllm-router"], "round_robin")
    assert start.endswith(free_port + body)
    header = start[: -len(free_port + body)]
    declared = {w for line in body.splitlines() if line.startswith("declare ") for w in line.split()[1:]
                if not w.startswith("-")}
    assigned = re.findall(r"^([A-Z_]+)=", header + free_port, re.MULTILINE)
    assert declared == set(assigned)
    clean = subprocess.run(["shellcheck", "-s", "bash", str(body_path)], capture_output=True, text=True,  # noqa: S603,S607
                           check=False)
    assert clean.returncode == 0, clean.stdout
    bad = tmp_path / "start_router.sh"
    bad.write_text(body.replace('SEED=${SEED_URL//', 'SEED=${SEED_UR//', 1))
    assert bad.read_text() != body
    flagged = subprocess.run(["shellcheck", "-s", "bash", str(bad)], capture_output=True, text=True,  # noqa: S603,S607
                             check=False)
    assert flagged.returncode != 0 and "SEED_UR" in flagged.stdout, flagged.stdout
