"""A ``--vllm-arg`` that sets a parallel layout is refused whatever the preset (issue 42 item 4): one
``pbstk: error:`` line, exit 2, nothing written, naming the presets with that layout (from the preset data) or
``--nodes``/``--gpus-per-node``. ``dp4`` + ``-tp 2`` rendered DP4 x TP2 = 8 GPUs in a 4-GPU job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.settings.layout_flags import layout_flag
from pbs_toolkit.settings.presets import list_presets

#: preset -> the GPUs per node it fills on the local-gpu profile
PRESETS = {"single": "1", "dp4": "4", "tp4": "4", "tp2": "2", "tp2dp2": "4", "auto": "4"}
#: every spelling of the three sizes (each a list of --vllm-arg values)
SIZE_FORMS = [
    ["-tp", "2"], ["-tp=2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"],
    ["--tensor_parallel_size=2"],
    ["-dp", "2"], ["-dp=2"], ["--data-parallel-size", "2"], ["--data-parallel-size=2"],
    ["-pp", "2"], ["-pp=2"], ["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size=2"],
]


def refused_render(tmp_path: Path, preset: str, values: list[str], *extra: str) -> str:
    """``render -o DIR`` with ``values`` as --vllm-args: the one error line (exit 2, nothing on stdout or in DIR)."""
    out = tmp_path / "out"
    result = pbstk("render", MODEL, "--profile", "local-gpu", "--gpus-per-node", PRESETS[preset], "--preset", preset,
                   *extra, *(f"--vllm-arg={v}" for v in values), "-o", str(out))
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: --vllm-arg "), result.output
    assert result.stdout == ""
    assert not out.exists() or not any(out.iterdir())
    return lines[0]


def with_size(key: str, size: int) -> list[str]:
    return [p.name for p in list_presets() if not p.auto and p.device == "gpu" and getattr(p, key) == size]


@pytest.mark.parametrize(("preset", "values"), [
    *(("dp4", form) for form in SIZE_FORMS),
    *((preset, form) for preset in sorted(PRESETS) if preset != "dp4"
      for form in (["-tp", "2"], ["--data-parallel-size=2"], ["-pp=2"])),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_spelling_of_a_size_is_refused_whatever_the_preset(tmp_path: Path, preset: str,
                                                                  values: list[str]) -> None:
    line = refused_render(tmp_path, preset, values)
    assert line.startswith(f"pbstk: error: --vllm-arg {' '.join(values)}: pbstk sizes the job's GPUs and nodes for "
                           f"the layout of preset {preset}")
    key = {"t": "tensor_parallel", "d": "data_parallel", "p": "pipeline_parallel"}[values[0].lstrip("-")[0]]
    names = with_size(key, 2)
    assert names and all(name in line for name in names)
    assert "--nodes/--gpus-per-node" in line


def test_the_presets_named_come_from_the_preset_data(tmp_path: Path, isolated_user: Path) -> None:
    line = refused_render(tmp_path, "dp4", ["--tensor-parallel-size=2"])
    assert line == ("pbstk: error: --vllm-arg --tensor-parallel-size=2: pbstk sizes the job's GPUs and nodes for "
                    "the layout of preset dp4 (DP4) and renders its flags itself; for TP2 use --preset tp2, "
                    "tp2-eager or tp2dp2 (`pbstk presets`; --nodes/--gpus-per-node spread a preset over nodes)")
    presets = isolated_user / "config" / "pbstk" / "presets"
    presets.mkdir(parents=True)
    (presets / "tp2pp2.yaml").write_text("name: tp2pp2\nsummary: mine\ntensor_parallel: 2\npipeline_parallel: 2\n")
    assert "for PP2 use --preset tp2pp2 or tp4pp2 " in refused_render(tmp_path, "dp4", ["-pp", "2"])
    assert "no preset has TP3: add one of your own" in refused_render(tmp_path, "dp4", ["-tp=3"])
    assert "for TP > 1 use --preset baseline-eager, " in refused_render(tmp_path, "dp4", ["-tp"])


@pytest.mark.parametrize(("values", "why"), [
    (["--data-parallel-size-local", "2"], "pbstk sets the data-parallel ranks per node"),
    (["-dpl=1"], "pbstk sets the data-parallel ranks per node"),
    (["--headless"], "the start script sets it on each node"),
    (["--data-parallel-start-rank", "2"], "the start script sets it on each node"),
    (["-dpr", "2"], "the start script sets it on each node"),
    (["--data_parallel_address=10.0.0.1"], "the start script sets it on each node"),
    (["-dpp", "13345"], "the start script sets it on each node"),
    (["--nnodes=2"], "the start script sets it on each node"),
    (["-n2"], "the start script sets it on each node"),
    (["--node-rank", "1"], "the start script sets it on each node"),
    (["-r", "1"], "the start script sets it on each node"),
    (["--master-addr", "h1"], "the start script sets it on each node"),
    (["--master-port=29500"], "the start script sets it on each node"),
    (["--distributed-executor-backend", "ray"], "the profile's multinode_engine"),
    (["--data-parallel-backend=ray"], "the profile's multinode_engine"),
    (["-dph"], "the head's API server, which balances over every data-parallel rank"),
    (["--data-parallel-external-lb"], "the head's API server"),
    (["-pcp", "2"], "multiplies the GPUs vLLM uses"),
])
def test_the_other_layout_flags_are_refused_with_their_reason(tmp_path: Path, values: list[str], why: str) -> None:
    line = refused_render(tmp_path, "dp4", values)
    assert f"--vllm-arg {' '.join(values)}: " in line and why in line


def test_flags_that_keep_the_layout_still_pass() -> None:
    result = pbstk("render", MODEL, "--profile", "local-gpu", "--gpus-per-node", "4", "--preset", "tp4", "--json",
                   "--vllm-arg=--enable-expert-parallel", "--vllm-arg=--api-server-count=2",
                   "--vllm-arg=--decode-context-parallel-size=2", "--vllm-arg=--max-num-seqs", "--vllm-arg=-2")
    assert result.exit_code == 0, result.output
    args = json.loads(result.stdout)["vllm_args"]
    assert args.count("--tensor-parallel-size") == 1 and "--enable-expert-parallel" in args


@pytest.mark.parametrize(("arg", "flag"), [
    ("-tp", "--tensor-parallel-size"), ("--tensor_parallel_size=4", "--tensor-parallel-size"),
    ("-n2", "--nnodes"), ("--no-data-parallel-hybrid-lb", "--data-parallel-hybrid-lb"),
    ("-dpl", "--data-parallel-size-local"),
    ("--tensor-parallel-sizes", None), ("-2", None), ("-nx", None), ("--enforce-eager", None), ("2", None),
])
def test_layout_flag(arg: str, flag: str | None) -> None:
    assert layout_flag(arg) == flag


def test_serve_refuses_before_anything_starts(isolated_user: Path) -> None:
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "svc.yaml").write_text("name: svc\nscheduler: local\nnodes: 1\ngpus_per_node: 2\naddress: loopback\n"
                                       "bind_host: 127.0.0.1\nrouter_command: /bin/true\n")
    for models in ([MODEL], [f"{MODEL}:preset=single", "Qwen/Qwen3-0.6B:preset=single"]):
        for dry in ([], ["--dry-run"]):
            result = pbstk("serve", *models, "--name", "svc1", "--profile", "svc", "--preset", "single", *dry,
                           "--vllm-arg=-tp", "--vllm-arg=2")
            assert result.exit_code == 2, result.output
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("pbstk: error: --vllm-arg -tp 2: "), result.output
            assert "layout of preset single (DP1)" in lines[0] and "tp2dp2" in lines[0]
            assert not JobStore().all() and not JobStore().service_rows()
