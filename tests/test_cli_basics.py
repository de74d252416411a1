"""The CLI through click's CliRunner: listings, render, and one clean error line (exit 2) for bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pbs_toolkit import __version__, paths
from pbs_toolkit.cli.main import cli

MODEL = "Qwen/Qwen3-VL-2B-Instruct"


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_error_line(result: Result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pbstk: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout == ""
    return lines[0]


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"pbstk, version {__version__}"


def test_help_lists_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("render", "presets", "profiles"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command


def test_presets_list() -> None:
    result = run("presets")
    assert result.exit_code == 0
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert rows["dp4"][1:4] == ["DP4", "4", "graphs"]
    assert rows["baseline-eager"][1:4] == ["TP4", "4", "eager"]
    assert rows["auto"][1:3] == ["auto", "-"] and rows["cpu"][1] == "cpu"


def test_presets_show_prints_rationale() -> None:
    result = run("presets", "show", "dp4")
    assert result.exit_code == 0
    out = " ".join(result.stdout.split())
    assert out.startswith("dp4: 4 GPUs, 4 independent replicas")
    assert "--max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.95" in out
    assert "Each GPU holds a full copy of the model" in out and "7.4x / 6.3x / 5.6x the seed baseline" in out


def test_presets_show_unknown() -> None:
    assert_one_error_line(run("presets", "show", "nope"), "unknown preset 'nope'")


def test_profiles_list() -> None:
    result = run("profiles")
    assert result.exit_code == 0
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert set(rows) >= {"generic-pbspro", "local", "local-gpu", "polaris"}
    assert rows["polaris"][1:5] == ["pbs", "debug", "4", "polaris.alcf.anl.gov"]
    assert rows["local"][1:4] == ["local", "-", "0"]


def test_render_to_stdout() -> None:
    result = run("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--run-dir", "/scratch/r1")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert out.startswith("# ===== job.pbs (run directory /scratch/r1) =====\n#!/bin/bash\n")
    assert "\n# ===== start_vllm.sh =====\n#!/bin/bash\n" in out
    assert "#PBS -o /scratch/r1/pbs.out" in out and "  --data-parallel-size 4\n" in out
    assert result.stderr == ""


def test_render_notes_on_stderr() -> None:
    result = run("render", MODEL, "-p", "baseline-eager", "-P", "generic-pbspro", "--vllm-version", "0.20",
                 "--run-dir", "/scratch/r2")
    assert result.exit_code == 0
    assert result.stderr.startswith("pbstk: note: dropped --disable-log-requests")
    assert "--disable-log-requests" not in result.stdout.split("VLLM_ARGS=(")[1]


def test_render_to_dir(tmp_path: Path) -> None:
    out = tmp_path / "out" / "deeper"
    result = run("render", MODEL, "-p", "dp4", "-P", "polaris", "-A", "PROJ", "-o", str(out), "--run-dir", "/s/r")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"wrote {out}/job.pbs and {out}/start_vllm.sh (preset dp4, DP4)"
    assert sorted(p.name for p in out.iterdir()) == ["api_key", "job.pbs", "pbstk-job.json", "start_vllm.sh"]
    job = (out / "job.pbs").read_text()
    assert job.startswith("#!/bin/bash\n") and "#PBS -A PROJ\n" in job
    assert (out / "start_vllm.sh").stat().st_mode & 0o111


BAD_INPUT = [
    (["--preset", "nope"], ["unknown preset 'nope'"]),
    (["--profile", "nope"], ["unknown profile 'nope'"]),
    (["--walltime", "99:99"], ["bad walltime '99:99'"]),
    (["--walltime", "-1"], ["bad walltime '-1'"]),
    (["--walltime", "0:00:00"], ["bad walltime", "positive"]),
    (["-P", "generic-pbspro", "--preset", "dp4", "--gpus-per-node", "2", "--nodes", "1"],
     ["dp4", "4 GPUs = 2 node(s) of 2 GPUs", "--nodes 1 gives 2"]),
    (["-P", "generic-pbspro", "--preset", "dp4", "--gpus-per-node", "3"], ["dp4", "not a whole number of nodes"]),
    (["-P", "generic-pbspro", "--preset", "tp2", "--gpus-per-node", "4"], ["tp2", "2 GPU", "requests 4"]),
    (["--port", "-5"], ["--port -5"]),
    (["--port", "70000"], ["--port 70000"]),
    (["--port", "eighty"], ["--port 'eighty'"]),
    (["-P", "polaris", "--preset", "dp4"], ["needs an account"]),
    (["--env", "NOEQUALS"], ["--env 'NOEQUALS'"]),
    (["--vllm-version", "latest"], ["vllm_version"]),
]


@pytest.mark.parametrize(("args", "fragments"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_one_line_exit_2_writes_nothing(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    out = tmp_path / "out"
    result = run("render", MODEL, *args, "-o", str(out))
    assert_one_error_line(result, *fragments)
    assert not out.exists()


@pytest.mark.parametrize(
    "model",
    ["a model", "x; touch /tmp/pwned", "x$(id)", "`id`", "it's", 'say"hi"', "org/na me", "a|b", "a&b", "a\nb", ""],
)
def test_hostile_model_names_refused(tmp_path: Path, model: str) -> None:
    out = tmp_path / "out"
    result = run("render", model, "-o", str(out))
    assert_one_error_line(result, "model")
    assert not out.exists()


def test_malformed_profile_yaml_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "site.yaml"
    bad.write_text("queue: workq\ngpus_per_node: [4\n")
    out = tmp_path / "out"
    line = assert_one_error_line(run("render", MODEL, "-P", str(bad), "-o", str(out)), str(bad), "line 3")
    assert "malformed YAML" in line and not out.exists()


def test_unknown_profile_key_names_file_and_key(tmp_path: Path) -> None:
    d = paths.user_config_dir() / "profiles"
    d.mkdir(parents=True)
    (d / "site.yaml").write_text("gpus_per_nod: 4\n")
    out = tmp_path / "out"
    assert_one_error_line(run("render", MODEL, "-P", "site", "-o", str(out)), str(d / "site.yaml"), "'gpus_per_nod'")
    assert not out.exists()


def test_output_path_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    result = run("render", MODEL, "-P", "generic-pbspro", "-p", "dp4", "-o", str(target))
    assert result.exit_code == 2 and target.read_text() == "x"
