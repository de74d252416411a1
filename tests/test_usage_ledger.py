"""``pbstk usage`` after ``pbstk clean``: the figures of cleaned jobs stay (the job store's usage ledger), counted
once. Real parts: ``pbstk run`` in a subprocess with the local scheduler, the stand-in ``vllm``, the real
``vllm-router`` for a service and the ``openai`` client as COMMAND (issue 32, item 4)."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, local_service_profile
from test_campaigns import EVAL, LOCAL, ROUTER, _env, cli

from pbs_toolkit.jobs.store import JobStore


def usage(*refs: str, env: dict[str, str]) -> dict[str, Any]:
    result = cli("usage", *refs, "--json", env=env)
    assert result.returncode == 0, result.stderr
    doc = dict(json.loads(result.stdout))
    doc.pop("notes")
    return doc


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
def test_usage_of_a_service_and_a_job_survives_clean(standins: Path, isolated_user: Path, tmp_path: Path) -> None:
    local_service_profile(isolated_user, ROUTER)
    script = tmp_path / "eval.py"
    script.write_text(EVAL)
    env = _env(PBSTK_SERVICE_POLL_S="0.5", PBSTK_TEST_STANDIN_DELAY="0")
    service = ("--profile", "svc", "--preset", "single", "--replicas", "2", "--name", "sv")
    for args in (service, (*LOCAL, "--name", "ev")):
        ran = cli("run", MODEL, *args, "--", sys.executable, str(script), env=env)
        assert ran.returncode == 0, ran.stderr
    before_all, before_sv, before_ev = usage(env=env), usage("sv", env=env), usage("ev", env=env)
    assert before_all["totals"]["jobs"] == 3 and before_all["totals"]["output_tokens"] == 42, before_all
    assert before_sv["services"][0]["jobs"] == 2 and before_sv["totals"]["requests"] == 3, before_sv
    assert before_ev["jobs"][0]["walltime_s"] is not None, before_ev

    cleaned = cli("clean", "--older-than", "0s", env=env)
    assert cleaned.returncode == 0, cleaned.stderr
    assert len([line for line in cleaned.stdout.splitlines() if line.startswith("removed ")]) == 3, cleaned.stdout
    assert "`pbstk usage` keeps their figures" in cleaned.stderr, cleaned.stderr
    assert JobStore().all() == []  # the records are gone ...

    # ... and usage says the same as before, each job once
    assert usage(env=env) == before_all
    assert usage("sv", env=env) == before_sv
    assert usage("ev", env=env) == before_ev
    again = cli("clean", "--older-than", "0s", env=env)
    assert again.returncode == 0 and usage(env=env) == before_all, again.stderr
    # the ledger holds no key
    with sqlite3.connect(JobStore().path) as conn:
        rows = [json.loads(data) for (data,) in conn.execute("SELECT data FROM ledger")]
    assert len(rows) == 3 and all("api_key" not in row for row in rows), rows
