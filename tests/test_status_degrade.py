"""``status`` with jobs on several schedulers, one of which refuses or does not answer: every job it can show,
UNKNOWN rows for the silent one, one warning line naming it, exit 0; alone, a refusal still fails (exit 3)
and ``wait`` keeps its exit 9. Real jobs: the local scheduler and the fake PBS with the stand-in vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launch, pbstk

from pbs_toolkit.jobs.store import JobStore

LOCAL = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto"]
REFUSED = {"rc": 2, "stderr": "qstat: Permission denied\n"}


def set_faults(home: Path, **faults: Any) -> None:
    (home / "faults.json").write_text(json.dumps(faults))


def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_with_retry`` without its sleeps between tries (the tries themselves still happen)."""
    from pbs_toolkit.schedulers import base, pbs

    def quick(*args: Any, **kw: Any) -> Any:
        return base.run_with_retry(*args, **kw, sleep=lambda _: None)

    monkeypatch.setattr(pbs, "run_with_retry", quick)


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
