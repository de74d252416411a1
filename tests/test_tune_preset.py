"""``tune -p NAME`` runs that preset only (issue 21, item 15): before, ``-p`` was taken as the base request's
preset and tune ran its four defaults anyway, four 4-GPU jobs on a real allocation."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import pbstk

from pbs_toolkit.jobs.store import JobStore

SMALL = ["--profile", "local-gpu", "--gpus-per-node", "1", "-c", "1", "--num-prompts", "2", "--input-len", "4",
         "--output-len", "3", "--client", "builtin", "--timeout", "60", "--json"]


def test_tune_with_p_runs_that_one_preset(standins: Path) -> None:
    result = pbstk("tune", "Qwen/Qwen3-1.7B", "-p", "single", *SMALL)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [run["preset"] for run in doc["runs"]] == ["single"] and doc["recommended"] == "single"
    assert [r.preset for r in JobStore().all()] == ["single"]  # one job launched, no other preset


def test_tune_p_is_checked_like_presets_before_anything_is_submitted(standins: Path) -> None:
    result = pbstk("tune", "Qwen/Qwen3-1.7B", "--profile", "local-gpu", "-p", "tp2")
    assert result.exit_code == 2 and result.stderr.startswith("pbstk: error: cannot tune: tp2: "), result.output
    both = pbstk("tune", "Qwen/Qwen3-1.7B", "-p", "single", "--presets", "single,single-eager")
    assert both.exit_code == 2 and both.stderr == "pbstk: error: tune takes --presets or -p/--preset, not both\n"
    assert JobStore().all() == []


def test_tune_compares_two_presets_and_prints_what_it_saved(standins: Path, tmp_path: Path) -> None:
    """Two presets one after the other on the stand-ins (the real vLLM's tune in tests/test_e2e_vllm.py runs one):
    a run per preset, each measured at every level, and the table and recommendation agree with the saved report."""
    from helpers import check_tune_report

    out = tmp_path / "tune.json"
    small = [a for a in SMALL if a != "--json"]
    small[small.index("-c") + 1] = "1,4"
    result = pbstk("tune", "Qwen/Qwen3-1.7B", "--presets", "single,single-eager", "--output", str(out), *small)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [run["preset"] for run in doc["runs"]] == ["single", "single-eager"] and doc["concurrencies"] == [1, 4]
    assert all("error" not in run and run["results"] for run in doc["runs"]), doc
    check_tune_report(doc, result.stdout)
    assert pbstk("tune", "--report", str(out)).stdout == result.stdout
