"""A ``--vllm-arg`` replaces the preset's value for that flag (issue 21, item 14): the flag reaches vLLM once,
and a note says the preset's value was overridden. Layout flags are refused (tests/test_layout_flags.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.settings.vllm_overrides import apply_overrides, chunks

DP4 = ["--profile", "local-gpu", "--gpus-per-node", "4", "--preset", "dp4"]


def rendered_args(*extra: str) -> tuple[list[str], list[str]]:
    result = pbstk("render", MODEL, *DP4, "--json", *extra)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    return doc["vllm_args"], doc["notes"]


def test_vllm_arg_replaces_the_presets_value_with_a_note() -> None:
    args, notes = rendered_args("--vllm-arg=--max-num-seqs=64")
    assert [a for a in args if a.startswith("--max-num-seqs")] == ["--max-num-seqs=64"]
    assert "512" not in args
    assert notes == ["--vllm-arg --max-num-seqs=64 overrides preset dp4's --max-num-seqs 512"]
    text = pbstk("render", MODEL, *DP4, "--vllm-arg=--max-num-seqs=64")
    assert text.stderr.splitlines() == [f"pbstk: note: {notes[0]}"]
    assert text.stdout.count("--max-num-seqs") == 1


def test_separate_value_and_untouched_flags() -> None:
    args, notes = rendered_args("--vllm-arg=--gpu-memory-utilization", "--vllm-arg=0.8",
                                "--vllm-arg=--max-model-len=4096")
    i = args.index("--gpu-memory-utilization")
    assert args[i + 1] == "0.8" and args.count("--gpu-memory-utilization") == 1 and "0.95" not in args
    assert "--max-num-seqs" in args and args[args.index("--max-num-seqs") + 1] == "512"  # not overridden: kept
    assert len(notes) == 1 and "--gpu-memory-utilization 0.8 overrides" in notes[0]


def test_the_override_is_what_vllm_gets(standins: Path) -> None:
    result = pbstk("launch", MODEL, *DP4, "--port", "auto", "--name", "over", "--vllm-arg=--max-num-seqs=3",
                   "--wait", "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert "overrides preset dp4's --max-num-seqs 512" in result.stderr
    try:
        argv = [json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines()][-1]["argv"]
        assert [a for a in argv if a.startswith("--max-num-seqs")] == ["--max-num-seqs=3"] and "512" not in argv
    finally:
        pbstk("cancel", result.stdout.split()[1])


def test_layout_flags_are_refused_in_one_line() -> None:
    assert "--vllm-arg -dp 2: " in pbstk("render", MODEL, *DP4, "--vllm-arg=-dp", "--vllm-arg=2").stderr
    result = pbstk("render", MODEL, *DP4, "--vllm-arg=--data-parallel-size=2")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "pbstk: error: --vllm-arg --data-parallel-size=2: pbstk sizes the job's GPUs and nodes for the layout of "
        "preset dp4 (DP4) and renders its flags itself; for DP2 use --preset dp2 or tp2dp2 (`pbstk presets`; "
        "--nodes/--gpus-per-node spread a preset over nodes)"]  # every form and flag: tests/test_layout_flags.py


@pytest.mark.parametrize(("preset", "user", "kept"), [
    (["--enforce-eager"], ["--no-enforce-eager"], []),  # --no-X replaces --X
    (["--no-enable-prefix-caching"], ["--enable-prefix-caching"], []),
    (["--a", "1", "--b", "-1"], ["--b=2"], ["--a", "1"]),  # a negative number is a value
    (["--a", "1"], ["--ab=2"], ["--a", "1"]),
])
def test_apply_overrides(preset: list[str], user: list[str], kept: list[str]) -> None:
    assert apply_overrides(preset, user, "p")[0] == kept


def test_chunks() -> None:
    assert chunks(["--a", "1", "--b=2", "--c", "-5", "x"]) == [["--a", "1"], ["--b=2"], ["--c", "-5", "x"]]
