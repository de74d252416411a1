"""A layout spread over nodes says so on the first line of launch, --dry-run and render (issue 21, item 12):
dp4 with --gpus-per-node 2 becomes 2 nodes, which used to show only as ``DP4``."""

from __future__ import annotations

from pathlib import Path

from helpers import MODEL, pbstk

WIDE = ["--profile", "generic-pbspro", "--gpus-per-node", "2", "--preset", "dp4"]


def first_line(*args: str) -> str:
    result = pbstk(*args)
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()[0]


def test_render_and_dry_run_name_the_nodes(tmp_path: Path) -> None:
    assert first_line("launch", MODEL, *WIDE, "--dry-run").startswith(
        "dry run: dp4 (DP4 on 2 nodes x 2 GPUs) with profile generic-pbspro; would write ")
    assert first_line("render", MODEL, *WIDE).startswith(
        "# ===== job.pbs (dp4: DP4 on 2 nodes x 2 GPUs; run directory ")
    out = tmp_path / "out"
    assert first_line("render", MODEL, *WIDE, "-o", str(out)) == (
        f"wrote {out}/job.pbs and {out}/start_vllm.sh (preset dp4, DP4 on 2 nodes x 2 GPUs)")
    assert first_line("launch", MODEL, "--profile", "generic-pbspro", "--preset", "tp4pp2", "--dry-run").startswith(
        "dry run: tp4pp2 (TP4xPP2 on 2 nodes x 4 GPUs) ")
    one = first_line("launch", MODEL, "--profile", "generic-pbspro", "--preset", "dp4", "--dry-run")
    assert one.startswith("dry run: dp4 (DP4) with profile generic-pbspro;")  # one node: nothing added


def test_launch_names_the_nodes(fakepbs: Path, standins: Path) -> None:
    line = first_line("launch", MODEL, *WIDE, "--port", "auto", "--name", "wide")
    assert line.startswith("submitted ") and line.endswith(" (dp4: DP4 on 2 nodes x 2 GPUs, profile generic-pbspro)")
    pbstk("cancel", line.split()[1])
