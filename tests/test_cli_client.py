"""The CLI as a thin layer over ``pbs_toolkit.Client``: one client (one runner per transport) per command, and
what the commands used to do on their own (the metrics watch loop, tune's merge) available from Python too.

Runs for real on the ``local`` scheduler with the stand-in ``vllm`` (profile ``local-gpu``, one GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.client import Client
from pbs_toolkit.transports import LocalRunner

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "results"
LAUNCH = ("--profile", "local-gpu", "--preset", "single", "--gpus-per-node", "1", "--port", "auto")


@pytest.fixture
def runners_made(monkeypatch: pytest.MonkeyPatch) -> list[LocalRunner]:
    """Every ``LocalRunner`` constructed during the test, by anyone (``open_runner`` in any module included)."""
    made: list[LocalRunner] = []
    init = LocalRunner.__init__

    def counting_init(self: LocalRunner, *args: Any, **kw: Any) -> None:
        made.append(self)
        init(self, *args, **kw)

    from pbs_toolkit.settings.machine_gpus import this_machine

    this_machine("local")  # this machine's GPUs, asked once per process and environment: not a runner of the job
    monkeypatch.setattr(LocalRunner, "__init__", counting_init)
    return made


def runners_for(made: list[LocalRunner], *args: str) -> tuple[int, Any]:
    """How many runners ``pbstk ARGS`` opened, and its result (which must be a success)."""
    before = len(made)
    res = pbstk(*args)
    assert res.exit_code == 0, res.output
    return len(made) - before, res


def test_each_command_opens_one_runner(standins: Path, runners_made: list[LocalRunner]) -> None:
    # launch --wait, metrics, bench and doctor each opened a second runner (over SSH: a second login, a second
    # MFA prompt) for the status or wait that preceded the real work
    opened, res = runners_for(runners_made, "launch", MODEL, *LAUNCH, "--name", "one", "--wait", "--timeout", "30",
                              "--json")
    job = json.loads(res.stdout)["job_id"]
    try:
        assert opened == 1
        assert runners_for(runners_made, "metrics", job, "--json", "--interval", "0.1")[0] == 1
        assert runners_for(runners_made, "bench", job, "--client", "builtin", "-c", "1", "--num-prompts", "2",
                           "--input-len", "8", "--output-len", "4", "--json")[0] == 1
        assert runners_for(runners_made, "doctor", job, "--json")[0] == 1
        assert runners_for(runners_made, "env", job)[0] == 1
    finally:
        assert runners_for(runners_made, "cancel", job)[0] == 1


def test_metrics_watch_from_python_and_the_cli(standins: Path) -> None:
    with Client() as client:
        job = client.launch(MODEL, name="watch", preset="single", profile="local-gpu", gpus_per_node=1, port="auto")
        try:
            client.wait(job, timeout=30)
            looks = list(client.watch_metrics(job, every=0.05, count=3))
            assert len(looks) == 3 and all(m.job_id == job.job_id and "rates" in m.summary for m in looks)
            one = client.metrics(job, interval=0.05)
            assert "engine_log" in one.summary and one.engine_log == one.summary["engine_log"]
            res = pbstk("metrics", job.job_id, "--watch", "0.05", "--count", "2", "--json")
            assert res.exit_code == 0, res.output
            lines = [json.loads(line) for line in res.stdout.splitlines()]
            assert len(lines) == 2 and all(s["job_id"] == job.job_id and "engine_log" not in s for s in lines)
        finally:
            client.cancel(job)


def test_tune_report_from_python_matches_the_cli(tmp_path: Path) -> None:
    reports = [str(RESULTS / "h200x2-run-a.json"), str(RESULTS / "h200x2-run-b.json")]
    saved: list[str] = []
    doc = Client.tune_report(reports, baseline="tp2-eager", output=str(tmp_path / "py.json"), progress=saved.append)
    assert saved == [f"saved {tmp_path / 'py.json'}"]
    assert [r.preset for r in doc.runs] == ["single", "single-eager", "tp2-eager", "tp2", "dp2"]
    assert doc.baseline == "tp2-eager" and doc.recommended == "dp2"
    res = pbstk("tune", "--report", reports[0], "--report", reports[1], "--baseline", "tp2-eager", "--json",
                "--output", str(tmp_path / "cli.json"))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == doc.to_dict() == json.loads((tmp_path / "cli.json").read_text())
