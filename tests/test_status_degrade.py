"""``status`` with jobs on several schedulers, one of which refuses or does not answer: every job it can show,
UNKNOWN rows for the silent one, one warning line naming it, exit 0; alone, a refusal still fails (exit 3)
and ``wait`` keeps its exit 9. Real jobs: the local scheduler and the fake PBS with the stand-in vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launch, pbstk, set_faults

from pbs_toolkit.jobs.store import JobStore

LOCAL = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto"]
REFUSED = {"rc": 2, "stderr": "qstat: Permission denied\n"}


def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_with_retry`` without its sleeps between tries (the tries themselves still happen)."""
    from pbs_toolkit.schedulers import base, pbs

    original = base.run_with_retry

    def quick(*args: Any, **kw: Any) -> Any:
        return original(*args, **kw, sleep=lambda _: None)

    monkeypatch.setattr(base, "run_with_retry", quick)  # the sequence the base runs
    monkeypatch.setattr(pbs, "run_with_retry", quick)  # the backend's own extra calls


def jobs_on_two_schedulers(fakepbs: Path) -> tuple[str, str]:
    pbs_job = launch("--name", "on-pbs").job_id
    local = pbstk(*LOCAL, "--name", "on-local", "--wait", "--timeout", "30")
    assert local.exit_code == 0, local.output
    return pbs_job, JobStore().find("on-local").job_id


@pytest.mark.parametrize("fault", [{"qstat_script": [REFUSED] * 3}, {"qstat_unavailable": 50}],
                         ids=["refused", "unavailable"])
def test_status_all_shows_every_job_when_one_scheduler_fails(fakepbs: Path, standins: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            fault: dict[str, Any]) -> None:
    pbs_job, local_job = jobs_on_two_schedulers(fakepbs)
    set_faults(fakepbs, **fault)
    no_backoff(monkeypatch)
    result = pbstk("status", "--all", "--json")
    assert result.exit_code == 0, result.output
    states = {s["job_id"]: s for s in json.loads(result.stdout)}
    assert states[local_job]["state"] == "READY"
    assert states[pbs_job]["state"] in ("UNKNOWN", "READY"), states[pbs_job]  # its own server may answer
    assert states[pbs_job]["scheduler_state"] == "?"
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("pbstk: warning: PBS did not answer: qstat "), warnings
    assert "1 job(s)" in warnings[0]
    assert all(r.final_state is None for r in JobStore().all())
    table = pbstk("status", "--all")
    assert table.exit_code == 0 and pbs_job in table.stdout and local_job in table.stdout, table.output
    set_faults(fakepbs)
    pbstk("cancel", pbs_job, local_job)


def test_a_refusing_scheduler_alone_still_fails_and_so_does_wait(fakepbs: Path, standins: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    job = launch("--name", "alone").job_id
    for command in (["status", job], ["status", "--all"], ["wait", job, "--timeout", "30"]):
        set_faults(fakepbs, qstat_script=[REFUSED])
        result = pbstk(*command)
        assert result.exit_code == 3, (command, result.output)
        assert result.stderr.strip() == "pbstk: error: qstat failed (exit 2): qstat: Permission denied", command
    set_faults(fakepbs)
    pbstk("cancel", job)


def test_an_unreachable_login_node_does_not_hide_this_machines_jobs(fakepbs: Path, standins: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pbs_toolkit.jobs.store import JobRecord

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = int(sock.getsockname()[1])
    config = tmp_path / "ssh_config"
    config.write_text(f"Host deadhost\n    HostName 127.0.0.1\n    Port {closed}\n")
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(config))
    JobStore().add(JobRecord(job_id="41.pbs01", scheduler="pbs", profile="generic-pbspro", model="org/m",
                             served_model_name="org/m", preset="dp4", name="far", run_dir="/runs/far",
                             transport="deadhost"))
    here = launch("--name", "here").job_id
    result = pbstk("status", "--json")
    assert result.exit_code == 0, result.output
    states = {s["job_id"]: s for s in json.loads(result.stdout)}
    assert states["41.pbs01"]["state"] == "UNKNOWN" and "deadhost cannot be reached" in states["41.pbs01"]["reason"]
    assert states[here]["state"] in ("STARTING", "READY", "PENDING"), states[here]
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("pbstk: warning: deadhost cannot be reached: "), warnings
    alone = pbstk("status", "41.pbs01")  # nothing else to show: the SSH failure is the answer (exit 4)
    assert alone.exit_code == 4 and alone.stderr.startswith("pbstk: error: "), alone.output
    assert len(alone.stderr.strip().splitlines()) == 1
    pbstk("cancel", here)
