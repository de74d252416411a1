"""The lease of ``pbstk run`` (docs/campaigns.md "The lease"): the run renews ``RUN_DIR/lease`` while it lives; a
run killed with ``kill -9`` renews nothing more, and its job drains and ends itself within the lease, ``status``
naming the lapsed lease; the run's COMMAND is ended within seconds by the watch beside it, and ``status`` says
so. Real parts: pbstk run as a subprocess (real SIGKILL), the local scheduler and the fake PBS running the
stand-in vLLM and the rendered start script in bash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import helpers
import pytest
from helpers import MODEL

from pbs_toolkit.campaigns.lease import Renewal, lease_seconds, renewal_interval
from pbs_toolkit.endpoints.registry import read_endpoints
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.lease import lapsed_after, lease_reason
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.transports.local import LocalRunner

TESTS = Path(__file__).resolve().parent
LOCAL = ("--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto")
PBS = ("--profile", "generic-pbspro", "--preset", "dp4", "--port", "auto")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS.parent), **extra}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=180, check=False, env=env or _env())


def _kill_run_during_command(tmp_path: Path, name: str, options: tuple[str, ...], orphans: list[int]) -> None:
    """``pbstk run`` with a 3 s lease (from PBSTK_RUN_LEASE, as a user's shell may set it), SIGKILLed while COMMAND
    runs: its job must end by itself, FINISHED with the lapsed lease as the reason, and its registry entry go."""
    pidfile = tmp_path / f"{name}.pid"
    registry = tmp_path / "endpoints.yaml"
    command = f'echo $$ > "{pidfile}"; exec sleep 600'
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *options, "--name", name,  # noqa: S603
                             "--registry", str(registry), "--", "sh", "-c", command],
                            env=_env(PBSTK_RUN_LEASE="3s"), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=120, what="COMMAND started")
        orphans.append(int(pidfile.read_text()))
        assert helpers.status_of(name)["state"] == "READY"
        proc.kill()  # SIGKILL: no handler, no end of run, no cancel
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # COMMAND does not outlive the run: the watch beside it ends its group within seconds (issue 41)
    helpers.until(lambda: not helpers.group_alive(orphans[-1]), timeout=20, what="COMMAND ended with its run")
    st = helpers.wait_recorded(name, "FINISHED", timeout=120, interval=0.5)
    assert st["ended"] == "lease", st
    assert st["reason"].startswith("the lease of pbstk run lapsed (no renewal for 3s"), st
    assert f"pbstk run (pid {proc.pid}) was gone: the watch ended its COMMAND at " in st["reason"], st
    assert st["exit_status"] == 0, st
    run_dir = Path(JobStore().find(name).run_dir)
    assert (run_dir / "ended_lease").is_file()
    log = (run_dir / "vllm.log").read_text()
    assert "lease lapsed: no renewal from pbstk run for 3s" in log, log
    human = helpers.pbstk("status", name)
    assert "the lease of pbstk run lapsed" in human.output, human.output
    assert read_endpoints(registry) == {}, "the registry entry outlived the job"
    # what the lease does not record (docs/campaigns.md): the counters
    usage = _cli("usage", name, "--json")
    assert usage.returncode == 0, usage.stderr
    row = json.loads(usage.stdout)["jobs"][0]
    assert row["requests"] is None and row["counters_source"] is None, row



def test_kill_9_of_run_ends_its_local_job_within_the_lease(standins: Path, tmp_path: Path,
                                                          orphans: list[int]) -> None:
    _kill_run_during_command(tmp_path, "lk", LOCAL, orphans)


def test_kill_9_of_run_ends_its_pbs_job_within_the_lease(standins: Path, fakepbs: Path, tmp_path: Path,
                                                        orphans: list[int]) -> None:
    _kill_run_during_command(tmp_path, "lp", PBS, orphans)
    helpers.until(lambda: set(helpers.fake_jobs(fakepbs).values()) == {"F"}, timeout=60, what="the PBS job to end")


def test_a_run_killed_while_it_waits_leaves_a_job_that_ends_after_its_lease(standins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *LOCAL, "--name", "lw",  # noqa: S603
                             "--lease", "2s", "--", "touch", str(marker)],
                            env=_env(PBSTK_TEST_STANDIN_DELAY="4"), text=True,  # listens 4 s after it starts
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: JobStore().all(), timeout=60, what="the launch")
        helpers.until(lambda: helpers.status_of("lw")["state"] == "STARTING", timeout=60, what="STARTING")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    st = helpers.wait_recorded("lw", "FINISHED", timeout=120, interval=0.5)
    assert st["ended"] == "lease", st
    assert "vLLM is listening" in Path(JobStore().find("lw").run_dir, "vllm.log").read_text()  # it got READY
    assert not marker.exists()


SLOW_CLIENT = """\
import json, os, sys, urllib.request
open(sys.argv[1] + ".started", "w").close()
body = json.dumps({"model": os.environ["PBSTK_MODEL"], "prompt": "hi", "max_tokens": 2, "standin_delay_s": 8})
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions", data=body.encode(), headers={
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as answer:
        status = str(answer.status)
except Exception as exc:
    status = type(exc).__name__
with open(sys.argv[1], "w") as out:
    out.write(status)
"""


def test_a_lapsed_lease_drains_the_request_still_running(standins: Path, tmp_path: Path) -> None:
    """The run is killed while its COMMAND's request runs (8 s, longer than the 2 s lease): the job waits for it
    before it stops vLLM (the stand-in, like a SIGKILL, drops what runs when it gets SIGTERM). The client runs in a
    session of its own, which the watch over COMMAND does not end (its group it does), so it can see its answer."""
    client, result = tmp_path / "slow.py", tmp_path / "result"
    client.write_text(SLOW_CLIENT)
    command = ["sh", "-c", 'setsid "$0" "$1" "$2" & wait', sys.executable, str(client), str(result)]
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *LOCAL, "--name", "ld",  # noqa: S603
                             "--lease", "2s", "--", *command], env=_env(),
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: Path(f"{result}.started").exists(), timeout=120, what="the request")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    st = helpers.wait_recorded("ld", "FINISHED", timeout=120, interval=0.5)
    assert st["ended"] == "lease", st
    helpers.until(lambda: result.exists() and result.read_text(), timeout=120, what="the request's end")
    assert result.read_text() == "200"  # served to its end, not cut by the stop
    assert "lease lapsed" in Path(JobStore().find("ld").run_dir, "vllm.log").read_text()


def test_renewals_keep_the_job_up_and_a_clean_end_still_cancels_at_once(standins: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *LOCAL, "--name", "lc",  # noqa: S603
                             "--lease", "2s", "--", "sh", "-c", f'until [ -e "{go}" ]; do sleep 0.1; done'],
                            env=_env(PBSTK_RUN_LEASE="banana"), text=True,  # the flag wins over the variable
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: JobStore().all(), timeout=60, what="the launch")
        run_dir = Path(JobStore().find("lc").run_dir)
        assert "\nLEASE_S=2\n" in (run_dir / "start_vllm.sh").read_text()
        log = run_dir / "vllm.log"
        helpers.until(lambda: log.exists() and "lease: vLLM is stopped when pbstk run has not renewed" in
                      log.read_text(), timeout=60, what="the lease watcher")

        def renewals() -> int:
            text = (run_dir / "lease").read_text() if (run_dir / "lease").exists() else ""
            return int(text.split()[0]) if text.strip() else 0

        first = helpers.until(renewals, timeout=60, what="a renewal")
        # renewed every 0.5 s: 10 more renewals span more than two leases of 2 s
        helpers.until(lambda: renewals() >= first + 10, timeout=120, what="renewals over two leases")
        assert helpers.status_of("lc")["state"] == "READY"
        go.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "pbstk: cancelled 1.vm.local" in err, err
    assert helpers.wait_recorded("lc", "CANCELLED", timeout=60)["state"] == "CANCELLED"
    assert not (run_dir / "ended_lease").exists()
    assert "lease lapsed" not in (run_dir / "vllm.log").read_text()


def test_a_kept_server_has_no_lease(standins: Path, tmp_path: Path) -> None:
    kept = _cli("run", MODEL, *LOCAL, "--name", "lkp", "--keep", "--", "true", env=_env(PBSTK_RUN_LEASE="2s"))
    assert kept.returncode == 0, kept.stderr
    run_dir = Path(JobStore().find("lkp").run_dir)
    assert "\nLEASE_S=0\n" in (run_dir / "start_vllm.sh").read_text()
    assert not (run_dir / "lease").exists()
    assert "lease:" not in (run_dir / "vllm.log").read_text()
    assert helpers.status_of("lkp")["state"] == "READY"
    assert _cli("cancel", "lkp").returncode == 0


def test_lease_options_refused_as_one_error_line(standins: Path) -> None:
    for args in (("run", MODEL, *LOCAL, "--lease", "banana", "--", "true"),
                 ("run", MODEL, *LOCAL, "--keep", "--lease", "5m", "--", "true"),
                 ("run", MODEL, *LOCAL, "--replicas", "2", "--keep", "--lease", "5m", "--", "true"),
                 ("run", "--reuse", "nothing", "--lease", "5m", "--", "true")):
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert [line for line in result.stderr.splitlines() if line.startswith("pbstk: error:")] == \
            [result.stderr.strip()], result.stderr
        assert "--lease" in result.stderr, result.stderr
    assert JobStore().all() == []  # nothing launched


def test_lease_seconds_renewal_and_the_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PBSTK_RUN_LEASE", raising=False)
    assert lease_seconds(None) == 300 and lease_seconds("90s") == 90 and lease_seconds("off") == 0
    assert lease_seconds("1.2") == 2  # rounded up: never shorter than asked
    monkeypatch.setenv("PBSTK_RUN_LEASE", "4s")
    assert lease_seconds(None) == 4 and lease_seconds("1m") == 60
    monkeypatch.setenv("PBSTK_RUN_LEASE", "-1")
    with pytest.raises(UsageError, match="PBSTK_RUN_LEASE"):
        lease_seconds(None)
    assert renewal_interval(2) == 0.5 and renewal_interval(300) == 60 and renewal_interval(100) == 20
    renewal = Renewal()
    runner = LocalRunner()
    renewal.renew([(runner, str(tmp_path))])
    first = (tmp_path / "lease").read_text()
    renewal.renew([(runner, str(tmp_path))])
    assert (tmp_path / "lease").read_text() != first  # the job watches for a change, not a clock
    said: list[str] = []
    failing = Renewal(said.append)
    for _ in range(3):
        failing.renew([(runner, str(tmp_path / "missing" / "dir"))])
    assert len(said) == 1 and "not renewed" in said[0]  # one warning for a series of failures
    lines = ["pbstk: 10:00:00 lease lapsed: no renewal from pbstk run for 300s; draining, then stopping vLLM"]
    assert lapsed_after(lines) == 300 and lapsed_after(["pbstk: 10:00:00 vLLM exited"]) is None
    assert lease_reason("FINISHED", lines) == ("the lease of pbstk run lapsed (no renewal for 5m00s: the run was "
                                               "killed or lost): the job ended itself")
    assert lease_reason("FAILED", lines) is None


@pytest.mark.ssh
def test_over_ssh_the_run_renews_through_its_connection_and_a_kill_lapses(
        login_node: Any, tmp_path: Path, orphans: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted through a real sshd to the fake PBS behind it: the renewals travel over the job's SSH connection
    (the run directory is the login node's), keep the job up past several leases, and stop with a kill -9."""
    pidfile = tmp_path / "ssh.pid"
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))  # status in this process too
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    env = _env()
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, "--ssh", login_node.alias,  # noqa: S603
                             *PBS, "--name", "ls", "--lease", "2s", "--via-tunnel", "--", "sh", "-c",
                             f'echo $$ > "{pidfile}"; exec sleep 600'], env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        helpers.until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=120, what="COMMAND started")
        orphans.append(int(pidfile.read_text()))
        lease = Path(JobStore().find("ls").run_dir, "lease")

        def renewals() -> int:
            text = lease.read_text() if lease.exists() else ""
            return int(text.split()[0]) if text.strip() else 0

        first = helpers.until(renewals, timeout=60, what="a renewal over SSH")
        helpers.until(lambda: renewals() >= first + 10, timeout=120, what="renewals over two leases")
        assert helpers.status_of("ls")["state"] == "READY"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    st = helpers.wait_recorded("ls", "FINISHED", timeout=120, interval=0.5)
    assert st["ended"] == "lease" and st["reason"].startswith("the lease of pbstk run lapsed (no renewal for 2s"), st


def test_the_lease_reaches_the_start_script_and_a_bad_one_is_refused(standins: Path) -> None:
    from pbs_toolkit.client import Client

    with Client() as client:
        rendered = client.render(MODEL, "single", "local-gpu", gpus_per_node=1, lease_s=7)
        assert "\nLEASE_S=7\n" in rendered.start_script
        assert "\nLEASE_S=0\n" in client.render(MODEL, "single", "local-gpu", gpus_per_node=1).start_script
        for bad in (-1, 2.5, True, "5m"):
            with pytest.raises(UsageError, match="lease_s must be a whole number"):
                client.render(MODEL, "single", "local-gpu", gpus_per_node=1, lease_s=bad)
