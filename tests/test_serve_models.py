"""`pbstk serve M1 M2 ... --dry-run` (issue 31, first slice): the model spec's refusals and the plan as a table and
as JSON, through the CLI. Nothing is written or queued, and several models without --dry-run are refused.

Before: `serve` took exactly one MODEL ("Got unexpected extra argument"), had no --dry-run and no --models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import pbstk

from pbs_toolkit import paths


def checkpoint(root: Path, name: str, weight_bytes: int) -> str:
    """A model directory `auto` sizes from its weights index (bf16)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": weight_bytes}}))
    return str(path)


@pytest.fixture
def gpu_profile(tmp_path: Path) -> str:
    """Two nodes' worth of 2 x 80 GB GPUs, PBS-shaped; `--nodes` picks nodes per job."""
    path = tmp_path / "two-gpus.yaml"
    path.write_text("name: two-gpus\nscheduler: pbs\ngpus_per_node: 2\ngpu_memory_gb: 80\nport: 8100\n")
    return str(path)


@pytest.fixture
def models(tmp_path: Path) -> list[str]:
    """0.6B, 1.7B and 32B-shaped bf16 checkpoints."""
    return [checkpoint(tmp_path / "m", "small", 1_200_000_000), checkpoint(tmp_path / "m", "mid", 3_400_000_000),
            checkpoint(tmp_path / "m", "big", 64_000_000_000)]


def nothing_recorded() -> None:
    """No job, no service, no run directory: the command wrote nothing."""
    assert not (paths.user_state_dir() / "services").exists()
    assert not any(Path(os.environ["PBSTK_RUNS_ROOT"]).iterdir())
    jobs = pbstk("jobs", "--json")
    assert jobs.exit_code == 0 and json.loads(jobs.stdout) == [], jobs.output


def refused(result: object, *words: str) -> None:
    assert result.exit_code == 2, result.output  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), lines
    for word in words:
        assert word in lines[0], lines[0]
    nothing_recorded()


def test_the_plan_as_a_table_packs_small_models_on_one_gpu(gpu_profile: str, models: list[str]) -> None:
    small, mid, big = models
    result = pbstk("serve", small, f"{mid}:name=mid17", big, "--name", "evals", "--profile", gpu_profile,
                   "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "service evals: 3 model(s) in 2 job(s) of profile two-gpus (dry run: nothing written or queued)"
    rows = [line.split() for line in lines[2:]]
    assert lines[1].split() == ["MODEL", "JOB", "NODE/GPUS", "MEMORY", "PORT", "PRESET"]
    # each shared GPU given out whole (0.90 in proportion to the needs, 0.10 each), each model on its own GPUs'
    # layout (issue 42)
    assert rows == [["big", f"({big})", "job1", "n0:0,1", "0.95", "(152", "GB)", "8100", "auto", "(TP2)"],
                    ["mid17", f"({mid})", "job2", "n0:0", "0.45", "(36", "GB)", "8100", "auto", "(TP1)"],
                    ["small", f"({small})", "job2", "n0:0", "0.45", "(36", "GB)", "8101", "auto", "(TP1)"]], lines
    nothing_recorded()


def test_the_plan_as_json_and_from_a_models_file_is_the_same(gpu_profile: str, models: list[str],
                                                              tmp_path: Path) -> None:
    small, mid, big = models
    listed = tmp_path / "models.yaml"
    listed.write_text(f"models:\n  - {small}\n  - model: {mid}\n    name: mid17\n  - {big}\n")
    by_args = pbstk("serve", small, f"{mid}:name=mid17", big, "--name", "evals", "--profile", gpu_profile,
                    "--nodes", "2", "--dry-run", "--json")
    by_file = pbstk("serve", "--models", str(listed), "--name", "evals", "--profile", gpu_profile, "--nodes", "2",
                    "--dry-run", "--json")
    assert by_args.exit_code == 0 and by_file.exit_code == 0, (by_args.output, by_file.output)
    plan = json.loads(by_args.stdout)
    assert plan == json.loads(by_file.stdout)
    assert (plan["kind"], plan["name"], plan["jobs"], plan["nodes_per_job"]) == ("model_plan", "evals", 1, 2)
    assert [(m["served_model_name"], m["job"], m["node"], m["gpus"], m["gpu_memory_utilization"],
             m["gpu_memory_needed"], m["port"]) for m in plan["models"]] == [
        ("big", 1, 0, [0, 1], 0.95, 0.95, 8100), ("mid17", 1, 1, [0], 0.45, 0.1, 8101),
        ("small", 1, 1, [0], 0.45, 0.1, 8102)]
    assert plan["models"][0]["model"] == big and plan["models"][0]["tensor_parallel"] == 2
    nothing_recorded()


def test_one_model_with_dry_run_is_planned_and_its_own_preset_is_used(gpu_profile: str, models: list[str]) -> None:
    result = pbstk("serve", f"{models[0]}:preset=single", "--profile", gpu_profile, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["name"] == "small" and [(m["preset"], m["gpus"]) for m in plan["models"]] == [("single", [0])]


@pytest.mark.parametrize(("extra", "words"), [
    (["--policy", "power_of_two"], ("--policy power_of_two", "routes by model")),
    (["--nodes", "2"], ("second node of a job", "not running yet")),
    (["--port", "9000"], ("--port 9000", "a port each")),
])
def test_what_several_models_do_not_run_yet_is_refused_in_one_line(gpu_profile: str, models: list[str],
                                                                    extra: list[str], words: tuple[str, ...]) -> None:
    """Several models run now (tests/test_serve_models_run.py); what this slice does not run is refused before
    anything is written or queued."""
    small, mid, _ = models
    args = [small, mid, "--name", "evals", "--profile", gpu_profile, *extra]
    if extra[0] == "--nodes":  # three models over a job of two 2-GPU nodes: the third lands on node 1
        args = [*models, "--name", "evals", "--profile", gpu_profile, *extra]
    refused(pbstk("serve", *args), *words)


@pytest.mark.parametrize(("spec", "words"), [
    (["{0}:prest=single", "{1}"], ("unknown option 'prest'", "known: preset, name")),
    (["{0}:name=a", "{1}:name=a"], ("served name 'a' is given twice", "MODEL argument 1", "MODEL argument 2")),
    (["{0}", "{0}"], ("is given twice",)),
    (["{0}:preset=nosuch", "{1}"], ("unknown preset 'nosuch'",)),
    (["{0}:name=", "{1}"], ("option 'name' has no value",)),
    (["{0}:name=has space", "{1}"], ("served name 'has space'",)),
    (["{0}:name=x:name=y", "{1}"], ("option 'name' given twice",)),
])
def test_a_bad_model_spec_is_one_error_line_and_nothing_queued(gpu_profile: str, models: list[str],
                                                                spec: list[str], words: tuple[str, ...]) -> None:
    args = [s.format(*models) for s in spec]
    refused(pbstk("serve", *args, "--name", "evals", "--profile", gpu_profile, "--dry-run"), *words)
    refused(pbstk("serve", *args, "--name", "evals", "--profile", gpu_profile), *words)  # checked first, also here


def test_a_bad_models_file_and_conflicting_options_are_refused(gpu_profile: str, models: list[str],
                                                               tmp_path: Path) -> None:
    listed = tmp_path / "models.yaml"
    listed.write_text(f"models:\n  - model: {models[0]}\n    prest: single\n")
    refused(pbstk("serve", "--models", str(listed), "--name", "e", "--profile", gpu_profile, "--dry-run"),
            "models[0]", "unknown key 'prest'")
    listed.write_text(f"model:\n  - {models[0]}\n")
    refused(pbstk("serve", "--models", str(listed), "--name", "e", "--dry-run"), "unknown key 'model'")
    refused(pbstk("serve", models[0], "--models", str(listed), "--name", "e", "--dry-run"), "not both")
    refused(pbstk("serve", *models[:2], "--dry-run", "--profile", gpu_profile), "need --name")
    refused(pbstk("serve", *models[:2], "--name", "e", "--replicas", "2", "--dry-run"), "--replicas is for one model")


def test_a_model_that_fits_nowhere_is_refused_before_anything_is_queued(gpu_profile: str, models: list[str],
                                                                        tmp_path: Path) -> None:
    huge = checkpoint(tmp_path / "m", "huge", 810_000_000_000)
    refused(pbstk("serve", models[0], f"{huge}:name=huge", "--name", "e", "--profile", gpu_profile, "--dry-run"),
            "model huge:", "810 GB of weights", "one node of 2 GPU(s) x 80 GB")


def test_one_model_takes_the_same_options_and_refuses_the_same_mistakes(gpu_profile: str, models: list[str]) -> None:
    refused(pbstk("serve", f"{models[0]}:prest=single", "--profile", gpu_profile), "unknown option 'prest'")
    result = pbstk("serve", f"{models[0]}:name=tiny", "--profile", gpu_profile, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    assert [m["served_model_name"] for m in json.loads(result.stdout)["models"]] == ["tiny"]


def test_a_vision_language_config_is_sized_by_its_nested_text_config(gpu_profile: str, tmp_path: Path) -> None:
    """No weights index: auto's config.json reader sizes the language model under text_config (about 8.2B
    parameters, 16.4 GB of bf16), so it gets 0.30 of an 80 GB GPU, not the share of an unknown or tiny model."""
    path = tmp_path / "vl"
    path.mkdir()
    text = {"hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 151936, "head_dim": 128}
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"],
                                                  "torch_dtype": "bfloat16", "text_config": text,
                                                  "vision_config": {"depth": 27, "hidden_size": 1152}}))
    tiny = checkpoint(tmp_path / "m", "tiny", 100_000_000)  # a second model: the packer plans (one is a replica)
    result = pbstk("serve", str(path), tiny, "--name", "vlt", "--profile", gpu_profile, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    row = next(m for m in json.loads(result.stdout)["models"] if m["served_model_name"] == "vl")
    assert 16 < row["weights_gb"] < 17.5 and row["gpu_memory_needed"] == 0.3, row


def test_a_packed_share_has_room_for_one_request_of_the_models_full_length(gpu_profile: str, tmp_path: Path) -> None:
    """Found on 4x H100 (vLLM 0.22.1): a Qwen3-1.7B-shaped model planned at 0.10 of 80 GB by its weights alone had
    3.98 GiB for its KV cache, one 40,960-token request needs 4.38 GiB, and vLLM refused to start. The plan now
    counts that request's KV cache (from config.json), or the shorter one --max-model-len asks for."""
    path = tmp_path / "q17"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16", "hidden_size": 2048,
        "num_hidden_layers": 28, "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960}))
    tiny = checkpoint(tmp_path / "m", "tiny", 100_000_000)  # a second model: the packer plans (one is a replica)
    full = pbstk("serve", str(path), tiny, "--name", "kv", "--profile", gpu_profile, "--dry-run", "--json")
    short = pbstk("serve", str(path), tiny, "--name", "kv", "--profile", gpu_profile, "--dry-run", "--json",
                  "--vllm-arg=--max-model-len=4096")
    assert full.exit_code == 0 and short.exit_code == 0, full.output + short.output

    def need(result: Any) -> float:
        return next(m["gpu_memory_needed"] for m in json.loads(result.stdout)["models"]
                    if m["served_model_name"] == "q17")

    assert need(full) == 0.15  # 3.4 GB weights + 1.1 x 4.7 GB + 1.5 GB of 80 GB
    assert need(short) == 0.1
