"""Vision-language models (settings/multimodal.py): the text-only switch (flag, PBSTK_TEXT_ONLY, config.yaml, profile
and preset keys) renders vLLM's multimodal limits at zero in the form the profile's vLLM reads, and is refused (flag)
or ignored with a note (keys) for a text-only model; TP presets split the vision encoder by data from vLLM 0.10.2, for
vision-language models only; ``doctor`` names the vision encoder's profiling in a slow start."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import Result
from helpers import pbstk

from pbs_toolkit import paths
from pbs_toolkit.jobs.spec import launch_options
from pbs_toolkit.perf.doctor import DoctorContext, diagnose
from pbs_toolkit.settings.launch_settings import RenderRequest

VL_HUB = "Qwen/Qwen3-VL-2B-Instruct"
TEXT_HUB = "Qwen/Qwen3-8B"
TEXT_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
               "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936}
VL_CONFIG = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
             "text_config": {**TEXT_CONFIG, "model_type": "qwen3_vl_text"},
             "vision_config": {"depth": 24, "hidden_size": 1024, "model_type": "qwen3_vl"}, "image_token_id": 151655}
JSON_LIMITS = '{"image":0,"video":0}'


@pytest.fixture
def models(tmp_path: Path) -> dict[str, str]:
    """Two model directories whose names say nothing: only their config.json tells vision from text."""
    out = {}
    for name, config in (("vl", VL_CONFIG), ("text", TEXT_CONFIG)):
        d = tmp_path / "models" / f"m-{name}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config))
        out[name] = str(d)
    return out


def render(model: str, *args: str) -> Result:
    return pbstk("render", model, "-P", "generic-pbspro", "--run-dir", "/scratch/pbstk-runs/mm", *args)


def vllm_args(result: Result) -> list[str]:
    """The rendered start script's ``VLLM_ARGS`` array as bash reads it (its quoting included)."""
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    script = result.stdout.split("# ===== start_vllm.sh =====\n", 1)[1]
    start = script.index("VLLM_ARGS=(")
    array = script[start:script.index("\n)\n", start) + 3]
    shown = subprocess.run(["bash", "-c", 'eval "$1"; printf "%s\\n" "${VLLM_ARGS[@]}"', "_", array],  # noqa: S603,S607
                           capture_output=True, text=True, check=True)
    return shown.stdout.splitlines()


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def assert_one_error_line(result: Result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout == ""


# -- the text-only switch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "value"), [("0.33.0", JSON_LIMITS), ("0.11.0", JSON_LIMITS),
                                                ("0.10.0", JSON_LIMITS), ("0.9.2", "image=0,video=0")])
def test_text_only_renders_zero_limits_in_the_versions_form(models: dict[str, str], version: str, value: str) -> None:
    args = vllm_args(render(models["vl"], "-p", "dp4", "--text-only", "--vllm-version", version))
    assert flag_value(args, "--limit-mm-per-prompt") == value
    assert args.count("--limit-mm-per-prompt") == 1
    assert "--limit-mm-per-prompt" not in vllm_args(render(models["vl"], "-p", "dp4", "--vllm-version", version))


def test_text_only_flag_on_a_text_model_is_one_error_line(models: dict[str, str]) -> None:
    assert_one_error_line(render(models["text"], "-p", "dp4", "--text-only"), "--text-only",
                          "not a vision-language model", "no vision_config")
    assert_one_error_line(render(TEXT_HUB, "-p", "dp4", "--text-only"), "not a vision-language model")


def test_text_only_launch_on_a_text_model_submits_nothing(models: dict[str, str]) -> None:
    result = pbstk("launch", models["text"], "-p", "dp4", "-P", "generic-pbspro", "--text-only")
    assert_one_error_line(result, "not a vision-language model")
    assert pbstk("jobs", "--all", "--json").stdout.count('"job_id"') == 0


def test_text_only_by_name_when_no_config_is_readable() -> None:
    result = render(VL_HUB, "-p", "dp4", "--text-only")
    assert flag_value(vllm_args(result), "--limit-mm-per-prompt") == JSON_LIMITS
    assert "taken as vision-language by its name" in result.stderr


def _config_yaml(text: str) -> None:
    path = paths.user_config_dir() / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_text_only_from_config_yaml_applies_to_vl_and_is_a_note_for_text(models: dict[str, str]) -> None:
    _config_yaml("profiles:\n  generic-pbspro:\n    text_only: true\n")
    assert flag_value(vllm_args(render(models["vl"], "-p", "dp4")), "--limit-mm-per-prompt") == JSON_LIMITS
    result = render(models["text"], "-p", "dp4")
    assert "--limit-mm-per-prompt" not in vllm_args(result)
    assert "pbstk: note: text_only (config.yaml (profiles.generic-pbspro)) ignored" in result.stderr
    # the flag wins over config.yaml both ways
    assert "--limit-mm-per-prompt" not in vllm_args(render(models["vl"], "-p", "dp4", "--no-text-only"))


def test_text_only_from_the_environment(models: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEXT_ONLY", "yes")
    assert flag_value(vllm_args(render(models["vl"], "-p", "dp4")), "--limit-mm-per-prompt") == JSON_LIMITS
    monkeypatch.setenv("PBSTK_TEXT_ONLY", "maybe")
    result = render(models["vl"], "-p", "dp4")
    assert result.exit_code == 2 and "PBSTK_TEXT_ONLY='maybe'" in result.stderr


def test_text_only_preset_key_and_no_text_only(models: dict[str, str], tmp_path: Path) -> None:
    preset = tmp_path / "dp4-text.yaml"
    preset.write_text("name: dp4-text\nsummary: dp4, text only\ndata_parallel: 4\ntext_only: true\n")
    assert flag_value(vllm_args(render(models["vl"], "-p", str(preset))), "--limit-mm-per-prompt") == JSON_LIMITS
    assert "--limit-mm-per-prompt" not in vllm_args(render(models["vl"], "-p", str(preset), "--no-text-only"))
    result = render(models["text"], "-p", str(preset))
    assert "--limit-mm-per-prompt" not in vllm_args(result)
    assert "text_only (preset dp4-text) ignored" in result.stderr


def test_a_users_limit_replaces_text_only(models: dict[str, str]) -> None:
    args = vllm_args(render(models["vl"], "-p", "dp4", "--text-only",
                            '--vllm-arg=--limit-mm-per-prompt={"image":1}'))
    assert [a for a in args if a.startswith("--limit-mm-per-prompt")] == ['--limit-mm-per-prompt={"image":1}']


def test_launch_options_reproduce_the_switch() -> None:
    assert "--text-only" in launch_options(RenderRequest(model=VL_HUB, text_only=True), None)
    assert "--no-text-only" in launch_options(RenderRequest(model=VL_HUB, text_only=False), None)
    assert not any("text-only" in o for o in launch_options(RenderRequest(model=VL_HUB), None))


# -- the vision encoder under tensor parallelism --------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tp4", "tp2dp2", "tp2"])
def test_tp_presets_split_the_vision_encoder_by_data(models: dict[str, str], preset: str) -> None:
    assert flag_value(vllm_args(render(models["vl"], "-p", preset)), "--mm-encoder-tp-mode") == "data"
    assert "--mm-encoder-tp-mode" not in vllm_args(render(models["text"], "-p", preset))


def test_encoder_tp_mode_not_for_one_gpu_replicas_nor_text_only(models: dict[str, str]) -> None:
    assert "--mm-encoder-tp-mode" not in vllm_args(render(models["vl"], "-p", "dp4"))
    assert "--mm-encoder-tp-mode" not in vllm_args(render(models["vl"], "-p", "auto", "--gpus-per-node", "4"))
    assert "--mm-encoder-tp-mode" not in vllm_args(render(models["vl"], "-p", "tp4", "--text-only"))
    assert "--mm-encoder-tp-mode" not in vllm_args(render(models["vl"], "-p", "baseline-eager"))  # the seed's flags


@pytest.mark.parametrize(("version", "passed"), [("0.10.1", False), ("0.10.2", True), ("0.22.1", True)])
def test_encoder_tp_mode_version_gate(models: dict[str, str], version: str, passed: bool) -> None:
    result = render(models["vl"], "-p", "tp4", "--vllm-version", version)
    assert ("--mm-encoder-tp-mode" in vllm_args(result)) is passed
    dropped = "dropped --mm-encoder-tp-mode from preset tp4: --mm-encoder-tp-mode does not exist before vLLM 0.10.2"
    assert (dropped in result.stderr) is not passed


def test_a_users_encoder_mode_on_an_old_vllm_is_refused(models: dict[str, str]) -> None:
    result = render(models["vl"], "-p", "dp4", "--vllm-version", "0.10.1", "--vllm-arg=--mm-encoder-tp-mode=data")
    assert_one_error_line(result, "--mm-encoder-tp-mode does not exist before vLLM 0.10.2")


# -- doctor ---------------------------------------------------------------------------------------------------------

ENCODER_LINE = ("(EngineCore_DP0 pid=4242) INFO 11-27 10:00:41 [gpu_model_runner.py:4321] Encoder cache will be "
                "initialized with a budget of 16384 tokens, and profiled with 1 image items of the maximum feature "
                "size.")
SLOW_GRAPHS = {"phases": {"queued": 3.0, "setup": 2.0, "imports": 20.0, "weights": 10.0, "compile": 30.0,
                          "graphs": 60.0, "api_up": 2.0}, "current": None}


def _slow_start(log: list[str]) -> dict[str, str]:
    findings = [f for f in diagnose(DoctorContext(startup=SLOW_GRAPHS, log_lines=log)) if f.code == "slow-start"]
    assert len(findings) == 1
    return findings[0].to_dict()


def test_doctor_names_the_vision_encoders_profiling_in_a_slow_start() -> None:
    finding = _slow_start(["INFO 11-27 10:00:10 [loader.py:1] Loading weights took 9.80 seconds", ENCODER_LINE])
    assert "profiling the image encoder with 1 image(s)" in finding["evidence"]
    assert "16384 tokens" in finding["evidence"]
    assert finding["fix"].startswith("Part of it is the vision encoder's profiling")
    assert "--text-only" in finding["fix"]
    text_model = _slow_start(["INFO 11-27 10:00:10 [loader.py:1] Loading weights took 9.80 seconds"])
    assert "encoder" not in text_model["evidence"] + text_model["fix"]


def test_config_show_names_the_switchs_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = json.loads(pbstk("config", "show", "--text-only", "--json").stdout)["settings"]["text_only"]
    assert shown == {"value": True, "source": "flag --text-only"}
    monkeypatch.setenv("PBSTK_TEXT_ONLY", "off")
    shown = json.loads(pbstk("config", "show", "--json").stdout)["settings"]["text_only"]
    assert shown == {"value": False, "source": "PBSTK_TEXT_ONLY"}


def test_a_text_only_start_keeps_its_own_compile_cache(models: dict[str, str]) -> None:
    """vLLM 0.22.1 keys its compile cache without the multimodal limits: on 2x H200 a text-only start of a
    Qwen3-VL-shaped model loaded the graphs an image-enabled start had saved and died in its first forward pass
    (benchmarks/README.md). Text-only starts get a cache of their own; the others keep theirs."""
    def cache_layout(model: str, *args: str) -> str:
        result = render(model, "-p", "dp4", *args)
        assert result.exit_code == 0, result.output
        line = next(x for x in result.stdout.splitlines() if x.startswith("CACHE_KEY_LAYOUT="))
        return line.split("=", 1)[1].strip("'")

    assert cache_layout(models["vl"]) == "DP4"
    assert cache_layout(models["vl"], "--text-only") == "DP4-text-only"
    assert cache_layout(models["text"]) == "DP4"
