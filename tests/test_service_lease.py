"""The lease of a service that ``pbstk run --replicas N`` started (docs/campaigns.md "The lease"): the run renews
``lease`` in the service's directory; its keeper ends the whole service (drained first) once the renewals stop,
and ``status NAME`` names the lapsed lease. Real parts: ``pbstk run`` as a subprocess (a real SIGKILL), the real
detached keeper, the real vllm-router, replica jobs on the local scheduler running the stand-in vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
from helpers import MODEL
from test_lease import SLOW_CLIENT
from test_service import ROUTER, service_json, svc_profile  # noqa: F401 - the fixture

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.process import service_dir
from pbs_toolkit.services.lease import LeaseWatch

pytestmark = [pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python"),
              pytest.mark.usefixtures("svc_profile")]

TESTS = Path(__file__).resolve().parent
SERVE = ("--profile", "svc", "--preset", "single", "--replicas", "2")


def _env(**extra: str) -> dict[str, str]:
    # the drain must outlast the slow request (8 s): svc_profile's 3 s is for handovers
    return {**os.environ, "PYTHONPATH": str(TESTS.parent), "PBSTK_SERVICE_DRAIN_S": "60", **extra}


def _run(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", MODEL, *SERVE, "--name", name,  # noqa: S603
                             *args], env=env or _env(), text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _replica_scripts(name: str) -> list[str]:
    rec = records.find(JobStore(), name)
    return [Path(JobStore().find(s.current).run_dir, "start_vllm.sh").read_text() for s in rec.slots if s.current]


def test_kill_9_of_a_service_run_ends_the_service_after_its_request(tmp_path: Path, orphans: list[int]) -> None:
    """``kill -9`` of the run while COMMAND's request (8 s) runs through the router: the keeper sees the lease
    (2 s) lapse, lets the request finish with 200, then ends the whole service; ``status`` says why."""
    client, result, pidfile = tmp_path / "slow.py", tmp_path / "result", tmp_path / "command.pid"
    client.write_text(SLOW_CLIENT)
    # the client in a session of its own (the watch over COMMAND ends COMMAND's group, not it): it sees its answer;
    # setsid in a background job is no group leader, so it execs the client at once and $! is the client's pid
    command = f'setsid "{sys.executable}" "{client}" "{result}" & echo $! > "{pidfile}"; wait'
    proc = _run("sl", "--lease", "2s", "--", "sh", "-c", command)
    try:
        helpers.until(lambda: Path(f"{result}.started").exists(), timeout=180, what="COMMAND's request")
        orphans.append(int(pidfile.read_text()))
        assert service_json("sl")["state"] == "READY"
        assert all("\nLEASE_S=0\n" in script for script in _replica_scripts("sl"))  # the keeper watches
        assert records.find(JobStore(), "sl").lease_s == 2
        assert (service_dir("sl") / "lease").is_file()  # renewed by the run
        proc.kill()  # SIGKILL: no handler, no end of run, no cancel
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = helpers.wait_for(lambda: (d := service_json("sl"))["state"] == "ENDED" and d, 120,
                            "the service to end by itself")
    assert done["end_reason"].startswith("the lease of pbstk run lapsed (no renewal for 2s"), done
    assert "the service ended itself; pbstk run (pid " in done["end_reason"], done  # and its COMMAND was ended
    assert "was gone: the watch ended its COMMAND at " in done["end_reason"], done
    assert result.read_text() == "200"  # finished before the teardown: the keeper drained first
    assert "ended: the lease of pbstk run lapsed" in helpers.pbstk("status", "sl").stdout
    for job in [j for j in JobStore().all() if j.name.startswith("sl-r")]:
        helpers.wait_for(lambda job=job: helpers.pbstk("status", job.job_id, "--json").stdout.count('"CANCELLED"'),
                         60, f"{job.job_id} cancelled")
    log = (service_dir("sl") / "keeper.log").read_text()
    assert "ends once pbstk run has not renewed its lease for 2 s" in log, log
    assert "draining 1 request(s) before it ends" in log, log


def test_a_renewed_service_stays_up_and_a_clean_end_cancels_it_at_once(tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc = _run("sc", "--", "sh", "-c", f'until [ -e "{go}" ]; do sleep 0.1; done',
                env=_env(PBSTK_RUN_LEASE="2s"))  # the lease from the variable, as a user's shell may set it
    try:
        lease = service_dir("sc") / "lease"

        def renewals() -> int:
            text = lease.read_text() if lease.exists() else ""
            return int(text.split()[0]) if text.strip() else 0

        helpers.until(lambda: (service_dir("sc") / "keeper.log").exists() and
                      service_json("sc")["state"] == "READY", timeout=180, what="the service READY")
        first = helpers.until(renewals, timeout=60, what="a renewal")
        # renewed every 0.5 s: 10 more renewals span more than two leases of 2 s
        helpers.until(lambda: renewals() >= first + 10, timeout=120, what="renewals over two leases")
        assert service_json("sc")["state"] == "READY"
        go.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        go.touch()  # COMMAND ends by itself even when the run was killed: no loop left behind
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "pbstk: cancelled sc" in err, err
    done = service_json("sc")
    assert done["state"] == "CANCELLED" and not done["end_reason"], done
    assert "lease of pbstk run lapsed" not in (service_dir("sc") / "keeper.log").read_text()


def test_the_keepers_watch_counts_by_its_own_clock_from_its_start() -> None:
    """No file yet counts from the keeper's start; each new content starts the lease again; no lease never lapses."""
    now = [100.0]
    directory = service_dir("w")
    directory.mkdir(parents=True, exist_ok=True)
    watch = LeaseWatch("w", clock=lambda: now[0])
    watch.arm(records.ServiceRecord(name="w", model=MODEL, served_model_name="w", profile="svc", replicas=1,
                                    request={}, lease_s=3))
    now[0] += 2.9
    assert watch.lapsed() is None
    (directory / "lease").write_text("1 1.0 pid 1\n")  # a renewal: counted from this look
    now[0] += 2.9
    assert watch.lapsed() is None
    now[0] += 2.9
    assert not watch.lapsed()  # 2.9 s since the renewal was seen
    now[0] += 0.2
    assert watch.lapsed() == ("the lease of pbstk run lapsed (no renewal for 3s: the run was killed or lost): "
                              "the service ended itself") and watch.due()
    (directory / "lease").write_text("2 2.0 pid 1\n")
    assert not watch.due()
    unleased = LeaseWatch("w", clock=lambda: now[0])
    unleased.arm(records.ServiceRecord(name="w", model=MODEL, served_model_name="w", profile="svc", replicas=1,
                                       request={}))
    now[0] += 1e6
    assert unleased.lapsed() is None
