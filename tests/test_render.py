"""Rendering: every preset x profile, golden scripts, version-aware flags, ``auto`` layouts, PBS directives.

Golden files live in tests/golden/. After an intended change to a template, preset or profile, regenerate
them and review the diff:

    PBSTK_REGEN_GOLDEN=1 pytest tests/test_render.py -k golden
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from pbs_toolkit.errors import ConfigError, UsageError
from pbs_toolkit.jobs.render import RenderedJob, RenderRequest, render, start_body
from pbs_toolkit.schedulers import backend_class
from pbs_toolkit.settings.presets import list_presets, params_from_config, params_from_name
from pbs_toolkit.settings.profiles import list_profiles

GOLDEN = Path(__file__).parent / "golden"
MODEL = "Qwen/Qwen3-VL-2B-Instruct"
RUN_DIR = "/scratch/pbstk-runs/golden-run"
#: read at import: the autouse isolated_user fixture removes every PBSTK_* variable before a test runs
REGEN_GOLDEN = os.environ.get("PBSTK_REGEN_GOLDEN") == "1"


def _shipped_names(lister: Callable[[], list[Any]]) -> list[str]:
    """Names of the shipped presets/profiles, with an empty user config dir (collection time, no fixtures)."""
    with tempfile.TemporaryDirectory() as empty, mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": empty}):
        return [item.name for item in lister()]


PRESETS = _shipped_names(list_presets)
PROFILES = _shipped_names(list_profiles)


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache of our own, so a developer's real cache cannot change the auto layout."""
    hf = tmp_path / "hf"
    hf.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf))
    return hf


def _render(model: str = MODEL, **kw: Any) -> RenderedJob:
    kw.setdefault("run_dir", RUN_DIR)
    return render(RenderRequest(model=model, **kw))


def _profile_gpus() -> dict[str, int]:
    with tempfile.TemporaryDirectory() as empty, mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": empty}):
        return {p.name: p.gpus for p in list_profiles()}


def _local_profiles() -> set[str]:
    """Profiles of the local scheduler: stand-in nodes only with --nodes, so larger presets are refused there."""
    with tempfile.TemporaryDirectory() as empty, mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": empty}):
        return {p.name for p in list_profiles() if p.scheduler == "local"}


def _preset_gpus() -> dict[str, tuple[str, int]]:
    with tempfile.TemporaryDirectory() as empty, mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": empty}):
        return {p.name: ("auto" if p.auto else p.device, p.gpus) for p in list_presets()}


def _preset_replica() -> dict[str, tuple[int, int]]:
    """(GPUs per replica, replicas) of each shipped preset."""
    with tempfile.TemporaryDirectory() as empty, mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": empty}):
        return {p.name: (p.tensor_parallel * p.pipeline_parallel, p.data_parallel) for p in list_presets()}


def _expected_valid(preset: str, profile: str) -> bool:
    kind, need = _preset_gpus()[preset]
    have = _profile_gpus()[profile]
    if kind == "cpu":
        return have == 0
    if kind == "auto":  # MODEL is a 2B model: one GPU per replica, any GPU count works
        return have >= 1
    # a smaller preset shrinks the request to the GPUs it uses; a larger one spans whole nodes (issue 14)
    # (several replicas each spanning nodes are refused: vLLM's DP needs every replica inside a node)
    replica, replicas = _preset_replica()[preset]
    spans = profile not in _local_profiles() and have >= 1 and need % have == 0 and (replica <= have or replicas == 1)
    return 1 <= need <= have or spans


@functools.lru_cache(maxsize=1)
def _profiles_by_name() -> dict[str, Any]:
    return {p.name: p for p in list_profiles()}


def _matrix_kwargs(profile: str) -> dict[str, Any]:
    # profiles that require an account (polaris, perlmutter) get one
    return {"account": "PROJ"} if _profiles_by_name()[profile].account_required else {}


# --- the whole matrix: bash -n and shellcheck ------------------------------------------------------------

#: extra combinations with --gpus-per-node and auto on several model sizes: (id, model, preset, profile, gpus)
VARIATIONS = [
    ("dp2-gpn2", MODEL, "dp2", "generic-pbspro", 2),
    ("single-gpn1", MODEL, "single", "generic-pbspro", 1),
    ("tp2dp2-gpn4", MODEL, "tp2dp2", "polaris", 4),
    ("auto-2b-gpn8", MODEL, "auto", "generic-pbspro", 8),
    ("auto-8b-gpn4", "meta-llama/Llama-3.1-8B-Instruct", "auto", "generic-pbspro", 4),
    ("auto-32b-gpn8", "Qwen/Qwen2.5-32B-Instruct", "auto", "generic-pbspro", 8),
    ("auto-70b-gpn4", "meta-llama/Llama-3.1-70B-Instruct", "auto", "polaris", 4),
    ("auto-405b-gpn8", "meta-llama/Llama-3.1-405B-Instruct", "auto", "generic-pbspro", 8),
    ("auto-8x7b-gpn4", "mistralai/Mixtral-8x7B-Instruct-v0.1", "auto", "generic-pbspro", 4),
    ("auto-2b-local-gpu", MODEL, "auto", "local-gpu", None),
    ("tp4-text-only", MODEL, "tp4", "generic-pbspro", None),
    ("dp4-text-only-0.9", MODEL, "dp4", "generic-pbspro", None),
]
#: render options of a variation besides those of the tuple (the text-only switch's two value forms: JSON, key=value)
VARIATION_OPTIONS: dict[str, dict[str, Any]] = {
    "var:tp4-text-only": {"text_only": True},
    "var:dp4-text-only-0.9": {"text_only": True, "vllm_version": "0.9.2"},
}


#: the start script's static body (pbs_toolkit/server/start/, its parts in order): every start script ends with it
START_BODY = start_body()


@pytest.fixture(scope="module")
def rendered_matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Render every combination once, run ``bash -n`` per file and shellcheck in a few calls over all files.

    A start script is its launch's header (variables only) followed by the same static body. shellcheck reads the
    whole start script once per backend (pbs, slurm, local), the first combination that has it; for every other
    combination it reads the job script and the start script's header alone (the header's variables are read by
    the body, so "assigned but unused", SC2034, is expected there and only there). That is what varies between
    combinations, and the full start script costs ~1.5 s of shellcheck each (~0.05 s for a header)."""
    out = tmp_path_factory.mktemp("matrix")
    config = tmp_path_factory.mktemp("xdg-config")
    hf = tmp_path_factory.mktemp("hf")
    results: dict[str, Any] = {}
    files: list[Path] = []  # job scripts and full start scripts: shellcheck as they are
    headers: list[Path] = []  # start script headers: shellcheck -e SC2034
    full_seen: set[str] = set()
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith("PBSTK_"):
                mp.delenv(key)
        mp.setenv("XDG_CONFIG_HOME", str(config))
        mp.setenv("HF_HOME", str(hf))
        cases: list[tuple[str, str, str, str, int | None]] = [
            (f"{pr}@{pf}", MODEL, pr, pf, None) for pr in PRESETS for pf in PROFILES
        ]
        cases += [(f"var:{cid}", m, pr, pf, g) for cid, m, pr, pf, g in VARIATIONS]
        for case_id, model, preset, profile, gpus in cases:
            try:
                job = _render(model, preset=preset, profile=profile, gpus_per_node=gpus, **_matrix_kwargs(profile),
                              **VARIATION_OPTIONS.get(case_id, {}))
            except UsageError as exc:
                results[case_id] = exc
                continue
            d = out / re.sub(r"[^A-Za-z0-9_.-]", "_", case_id)
            d.mkdir()
            pair = [d / "job.pbs", d / "start_vllm.sh"]
            pair[0].write_text(job.job_script)
            pair[1].write_text(job.start_script)
            syntax = [subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)  # noqa: S603,S607
                      for p in pair]
            assert job.start_script.endswith(START_BODY), case_id
            kind = job.profile.scheduler
            if kind in full_seen:
                header = d / "start_header.sh"
                header.write_text(job.start_script[: -len(START_BODY)])
                checked = [pair[0], header]
                files.append(pair[0])
                headers.append(header)
            else:
                full_seen.add(kind)
                checked = pair
                files += pair
            results[case_id] = {"job": job, "files": checked, "bash_n": syntax}
    comments = _shellcheck(files, []) + _shellcheck(headers, ["-e", "SC2034"])
    for value in results.values():
        if isinstance(value, dict):
            names = {str(p) for p in value["files"]}
            value["shellcheck"] = [c for c in comments if c["file"] in names]
    return results


def _shellcheck(files: list[Path], options: list[str]) -> list[dict[str, Any]]:
    """shellcheck's findings over ``files``: one call per CPU over a share of the list (shellcheck takes many
    files in one call), so a loaded machine still finishes."""
    workers = max(2, min(8, os.cpu_count() or 2))
    procs = [subprocess.Popen(["shellcheck", "-f", "json1", *options, *map(str, files[i::workers])],  # noqa: S603,S607
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(workers) if files[i::workers]]
    comments: list[dict[str, Any]] = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode in (0, 1), stderr  # 1 = findings (asserted per case below)
        comments += json.loads(stdout)["comments"]
    return comments


def _assert_clean(case: dict[str, Any]) -> None:
    for result in case["bash_n"]:
        assert result.returncode == 0, result.stderr
    assert case["shellcheck"] == [], "\n".join(
        f"{c['file']}:{c['line']}: SC{c['code']} {c['message']}" for c in case["shellcheck"]
    )


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("preset", PRESETS)
def test_matrix_renders_clean_or_refuses(rendered_matrix: dict[str, Any], preset: str, profile: str) -> None:
    case = rendered_matrix[f"{preset}@{profile}"]
    if not _expected_valid(preset, profile):
        assert isinstance(case, UsageError), f"{preset} on {profile} should be refused"
        message = str(case)
        assert preset in message
        assert re.search(r"\bGPU", message) and re.search(r"\d", message), message
        return
    assert isinstance(case, dict), f"{preset} on {profile} was refused: {case}"
    _assert_clean(case)
    job: RenderedJob = case["job"]
    assert job.job_script.startswith("#!/bin/bash\n") and job.start_script.startswith("#!/bin/bash\n")


@pytest.mark.parametrize("case_id", [v[0] for v in VARIATIONS])
def test_matrix_variations_render_clean(rendered_matrix: dict[str, Any], case_id: str) -> None:
    case = rendered_matrix[f"var:{case_id}"]
    assert isinstance(case, dict), f"{case_id} was refused: {case}"
    _assert_clean(case)


def test_text_only_variations_render_their_limits(rendered_matrix: dict[str, Any]) -> None:
    limits = {cid: rendered_matrix[f"var:{cid}"]["job"].vllm_args for cid in ("tp4-text-only", "dp4-text-only-0.9")}
    assert limits["tp4-text-only"][-2:] == ["--limit-mm-per-prompt", '{"image":0,"video":0}']
    assert limits["dp4-text-only-0.9"][-2:] == ["--limit-mm-per-prompt", "image=0,video=0"]


def test_variation_layouts(rendered_matrix: dict[str, Any]) -> None:
    layouts = {
        cid: rendered_matrix[f"var:{cid}"]["job"].preset.layout()
        for cid in ("auto-2b-gpn8", "auto-8b-gpn4", "auto-32b-gpn8", "auto-70b-gpn4", "auto-405b-gpn8",
                    "auto-8x7b-gpn4", "auto-2b-local-gpu", "dp2-gpn2", "single-gpn1")
    }
    assert layouts == {
        "auto-2b-gpn8": "DP8", "auto-8b-gpn4": "TP2xDP2", "auto-32b-gpn8": "TP4xDP2",
        # polaris knows its 40 GB GPUs: 70B x 2 bytes = 141 GB is over 70% of a node's 152 GB -> two nodes
        "auto-70b-gpn4": "TP4xPP2",
        "auto-405b-gpn8": "TP8", "auto-8x7b-gpn4": "TP4", "auto-2b-local-gpu": "DP1", "dp2-gpn2": "DP2",
        "single-gpn1": "DP1",
    }


def test_gpu_count_mismatch_names_preset_and_counts() -> None:
    with pytest.raises(UsageError) as err:
        _render(preset="dp4", profile="generic-pbspro", gpus_per_node=2, nodes=1)
    assert "dp4" in str(err.value) and "4 GPUs = 2 node(s) of 2 GPUs" in str(err.value), err.value
    assert "--nodes 1 gives 2" in str(err.value)
    with pytest.raises(UsageError) as err:
        _render(preset="dp4", profile="generic-pbspro", gpus_per_node=3)
    assert "dp4" in str(err.value) and "not a whole number of nodes of 3 GPUs" in str(err.value)
    with pytest.raises(UsageError) as err:
        _render(preset="cpu", profile="polaris", account="PROJ")
    assert "cpu" in str(err.value) and "polaris" in str(err.value) and "4 GPU" in str(err.value)


def test_smaller_preset_requests_only_its_gpus() -> None:
    job = _render(preset="dp2", profile="generic-pbspro")
    assert "#PBS -l select=1:ncpus=32:ngpus=2\n" in job.job_script


# --- golden files ----------------------------------------------------------------------------------------

GOLDEN_CASES = {
    "dp4-polaris": dict(preset="dp4", profile="polaris", account="PROJ"),
    "cpu-local": dict(model="Qwen/Qwen3-0.6B", preset="cpu", profile="local"),
    "baseline-eager-pbspro-0.11": dict(preset="baseline-eager", profile="generic-pbspro", vllm_version="0.11.0"),
    "baseline-eager-pbspro-0.33": dict(preset="baseline-eager", profile="generic-pbspro", vllm_version="0.33.0"),
    "dp8-perlmutter": dict(preset="dp8", profile="perlmutter", account="PROJ"),
}


#: the static body every start script ends with: one golden copy, after each case's own header
BODY_GOLDEN = GOLDEN / "start_vllm.body.sh"


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job script and the start script of each case, byte for byte. A start script is the case's settings
    header (``NAME.start_vllm.header.sh``) followed by the one static body (``start_vllm.body.sh``)."""
    # generic-pbspro's vllm_cache_root is ~/...: a fixed HOME keeps the rendered text the same everywhere.
    monkeypatch.setenv("HOME", "/home/golden")
    kw = dict(GOLDEN_CASES[name])
    job = _render(str(kw.pop("model", MODEL)), **kw)
    script_name = backend_class(job.profile.scheduler).script_name  # job.pbs, job.slurm
    job_path, header_path = GOLDEN / f"{name}.{script_name}", GOLDEN / f"{name}.start_vllm.header.sh"
    if REGEN_GOLDEN:
        body = start_body()
        assert job.start_script.endswith(body), "the start script does not end with the static body"
        job_path.write_text(job.job_script, encoding="utf-8")
        header_path.write_text(job.start_script[: -len(body)], encoding="utf-8")
        BODY_GOLDEN.write_text(body, encoding="utf-8")
        return
    regen = f"if intended: PBSTK_REGEN_GOLDEN=1 pytest {__file__} -k golden"
    for path in (job_path, header_path, BODY_GOLDEN):
        assert path.is_file(), f"{path} is missing: {regen}"
    assert job.job_script == job_path.read_text(encoding="utf-8"), f"{job_path.name} differs; {regen}"
    expected = header_path.read_text(encoding="utf-8") + BODY_GOLDEN.read_text(encoding="utf-8")
    assert job.start_script == expected, f"{header_path.name} + {BODY_GOLDEN.name} differ; {regen}"


def test_golden_directory_holds_exactly_the_cases() -> None:
    """No golden file without a case (a renamed case or an old layout would otherwise linger unchecked)."""
    wanted = {"README.md", BODY_GOLDEN.name}
    for name, kw in GOLDEN_CASES.items():
        script_name = backend_class(_profiles_by_name()[str(kw["profile"])].scheduler).script_name
        wanted |= {f"{name}.{script_name}", f"{name}.start_vllm.header.sh"}
    assert {p.name for p in GOLDEN.iterdir()} == wanted


def test_golden_versions_differ_only_by_removed_flag() -> None:
    old = (GOLDEN / "baseline-eager-pbspro-0.11.start_vllm.header.sh").read_text().splitlines()
    new = (GOLDEN / "baseline-eager-pbspro-0.33.start_vllm.header.sh").read_text().splitlines()
    assert [line for line in old if line not in new] == ["  --disable-log-requests"]
    assert [line for line in new if line not in old] == []


# --- version-aware flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.17.0", "0.22.1", "0.33.0"])
def test_disable_log_requests_dropped_from_017(version: str) -> None:
    job = _render(preset="baseline-eager", profile="generic-pbspro", vllm_version=version)
    assert "--disable-log-requests" not in job.vllm_args
    assert "--disable-log-requests" not in job.start_script.split("VLLM_ARGS=(")[1]
    assert any("--disable-log-requests" in n and "0.17" in n for n in job.notes), job.notes


@pytest.mark.parametrize("version", ["0.11.0", "0.16.2"])
def test_disable_log_requests_kept_before_017(version: str) -> None:
    job = _render(preset="baseline-eager", profile="generic-pbspro", vllm_version=version)
    assert "--disable-log-requests" in job.vllm_args
    assert "\n  --disable-log-requests\n" in job.start_script
    assert not any("dropped" in n for n in job.notes)


@pytest.mark.parametrize("arg", [["--swap-space", "4"], ["--swap-space=4"]])
def test_swap_space_refused_from_018(arg: list[str]) -> None:
    with pytest.raises(UsageError, match=r"--swap-space.*0\.18"):
        _render(preset="dp4", profile="generic-pbspro", vllm_version="0.18.0", vllm_args=arg)
    job = _render(preset="dp4", profile="generic-pbspro", vllm_version="0.17.1", vllm_args=arg)
    assert job.vllm_args[-len(arg):] == arg


def _user_preset(name: str, body: str) -> None:
    from pbs_toolkit import paths

    d = paths.user_config_dir() / "presets"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(body)


def test_async_scheduling_automatic_from_014() -> None:
    _user_preset("async", "tensor_parallel: 1\ndata_parallel: 4\nvllm_args:\n  --async-scheduling: true\n")
    old = _render(preset="async", profile="generic-pbspro", vllm_version="0.13.0")
    assert "--async-scheduling" in old.vllm_args and not old.notes
    for version in ("0.14.0", "0.33.0"):
        new = _render(preset="async", profile="generic-pbspro", vllm_version=version)
        assert "--async-scheduling" not in new.vllm_args
        assert "--async-scheduling" not in new.start_script
        assert any("--async-scheduling" in n and "automatic" in n for n in new.notes), new.notes


def test_vllm_use_v1_env_refused_from_012() -> None:
    with pytest.raises(UsageError, match=r"VLLM_USE_V1.*0\.12"):
        _render(preset="dp4", profile="generic-pbspro", vllm_version="0.12.0", env={"VLLM_USE_V1": "1"})
    job = _render(preset="dp4", profile="generic-pbspro", vllm_version="0.11.0", env={"VLLM_USE_V1": "1"})
    assert "\n  VLLM_USE_V1=1\n" in job.start_script.split("ENV_EXPORTS=(")[1].split(")")[0]


def test_flags_owned_by_pbstk_refused() -> None:
    for arg in (["--port", "9"], ["--api-key=abc"], ["--host", "0.0.0.0"]):
        with pytest.raises(UsageError, match="set by pbstk"):
            _render(preset="dp4", profile="generic-pbspro", vllm_args=arg)


# --- auto ------------------------------------------------------------------------------------------------

Config = dict[str, object]
LLAMA_8B: Config = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
LLAMA_70B: Config = {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
QWEN_1_7B: Config = {"hidden_size": 2048, "num_hidden_layers": 28, "intermediate_size": 6144,
                     "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                     "tie_word_embeddings": True}


def test_params_from_config_known_shapes() -> None:
    assert params_from_config(LLAMA_8B) == pytest.approx(8.03, abs=0.05)
    assert params_from_config(LLAMA_70B) == pytest.approx(70.55, abs=0.1)
    assert params_from_config(QWEN_1_7B) == pytest.approx(1.72, abs=0.05)  # tied embeddings counted once
    assert params_from_config({"text_config": LLAMA_8B}) == pytest.approx(8.03, abs=0.05)
    assert params_from_config({"architectures": ["X"]}) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Qwen/Qwen3-VL-2B-Instruct", 2.0), ("meta-llama/Llama-3.1-70B", 70.0), ("Qwen/Qwen2.5-0.5B", 0.5),
     ("mistralai/Mixtral-8x7B-v0.1", 56.0), ("org/SmolLM-135M", 0.135), ("Qwen/Qwen3-30B-A3B", 30.0),
     ("org/no-size-here", None)],
)
def test_params_from_name(name: str, expected: float | None) -> None:
    assert params_from_name(name) == (pytest.approx(expected) if expected is not None else None)


def test_auto_reads_local_model_dir(tmp_path: Path) -> None:
    model = tmp_path / "my-model-2B"  # the name says 2B; config.json (8B) must win
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    job = _render(str(model), preset="auto", profile="generic-pbspro")
    assert job.params_b == pytest.approx(8.03, abs=0.05)
    assert job.preset.layout() == "TP2xDP2"
    assert f"\nMODEL={model.resolve()}\n" in job.start_script


def test_auto_reads_hf_cache(empty_hf_cache: Path) -> None:
    snap = empty_hf_cache / "hub" / "models--acme--mystery" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(LLAMA_8B))
    job = _render("acme/mystery", preset="auto", profile="generic-pbspro", gpus_per_node=8)
    assert job.params_b == pytest.approx(8.03, abs=0.05)
    assert job.preset.layout() == "TP2xDP4"
    assert "\nMODEL=acme/mystery\n" in job.start_script  # an HF id stays an id


def test_auto_70b_config_and_name_agree(empty_hf_cache: Path) -> None:
    """A 70B-class config counts ~70.6B (embeddings): it must get the same TP4 as the name "70B"."""
    snap = empty_hf_cache / "hub" / "models--acme--big" / "snapshots" / "x"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(LLAMA_70B))
    by_config = _render("acme/big", preset="auto", profile="generic-pbspro")
    by_name = _render("acme/Big-70B", preset="auto", profile="generic-pbspro")
    assert by_config.preset.layout() == by_name.preset.layout() == "TP4"


@pytest.mark.parametrize(
    ("model", "gpus", "layout"),
    [("org/m-2B", 4, "DP4"), ("org/m-6.9B", 4, "DP4"), ("org/m-7B", 4, "TP2xDP2"), ("org/m-14B", 8, "TP2xDP4"),
     ("org/m-20B", 4, "TP4"), ("org/m-70B", 8, "TP4xDP2"), ("org/m-72B", 8, "TP8"), ("org/m-8x22B", 8, "TP8"),
     ("org/no-size", 4, "DP4")],
)
def test_auto_rule(model: str, gpus: int, layout: str) -> None:
    job = _render(model, preset="auto", profile="generic-pbspro", gpus_per_node=gpus)
    assert job.preset.layout() == layout
    tp = job.preset.tensor_parallel
    assert (f"--tensor-parallel-size {tp}" in job.start_script) == (tp > 1)


@pytest.mark.parametrize(("model", "gpus", "tp"), [("org/m-8B", 1, 2), ("org/m-32B", 2, 4), ("org/m-405B", 4, 8)])
def test_auto_refuses_when_tp_exceeds_gpus(model: str, gpus: int, tp: int) -> None:
    with pytest.raises(UsageError, match=rf"auto.*tensor parallel {tp}.*{gpus} GPU"):
        _render(model, preset="auto", profile="generic-pbspro", gpus_per_node=gpus)


def test_auto_on_cpu_profile_refused() -> None:
    with pytest.raises(UsageError, match=r"auto.*GPU"):
        _render(preset="auto", profile="local")


# --- PBS directives --------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^#PBS -[A-Za-z] [A-Za-z0-9_.@=:+,/-]+$")


def _pbs_lines(job: RenderedJob) -> list[str]:
    return [line for line in job.job_script.splitlines() if line.startswith("#PBS")]


def test_directives_every_pbs_profile(rendered_matrix: dict[str, Any]) -> None:
    checked = 0
    for case in rendered_matrix.values():
        if not isinstance(case, dict) or case["job"].profile.scheduler != "pbs":
            continue
        job: RenderedJob = case["job"]
        lines = _pbs_lines(job)
        assert not re.search(r"(^|\s)-V(\s|$)", job.job_script, re.M)  # not as a directive, not as an option
        assert "#PBS -r n" in lines
        assert "#PBS -k doe" in lines
        assert f"#PBS -o {RUN_DIR}/pbs.out" in lines and f"#PBS -e {RUN_DIR}/pbs.err" in lines
        for line in lines:
            assert _DIRECTIVE.match(line), line
        checked += 1
    assert checked >= 12


def test_polaris_directives() -> None:
    job = _render(preset="dp4", profile="polaris", account="PROJ", walltime="2:30:00", queue="preemptable")
    assert _pbs_lines(job) == [
        "#PBS -N qwen3-vl-2b-instruct", "#PBS -q preemptable", "#PBS -A PROJ", "#PBS -l select=1:system=polaris",
        "#PBS -l walltime=02:30:00", "#PBS -l filesystems=home:eagle", "#PBS -l place=scatter", "#PBS -k doe",
        f"#PBS -o {RUN_DIR}/pbs.out", f"#PBS -e {RUN_DIR}/pbs.err", "#PBS -r n",
    ]


def test_polaris_needs_account() -> None:
    with pytest.raises(UsageError, match="account"):
        _render(preset="dp4", profile="polaris")


@pytest.mark.parametrize(
    "kw",
    [
        {"queue": "debug\n#PBS -V"}, {"queue": "debug -V"}, {"account": "P; rm -rf ~"}, {"account": "A B"},
        {"name": "x -V"}, {"name": "1abc"}, {"name": "a\nb"}, {"walltime": "1:00:00 -V"}, {"walltime": "99:99"},
        {"run_dir": "relative/dir"}, {"run_dir": "/tmp/with space"}, {"run_dir": "/tmp/a\n#PBS -V"},
        {"run_dir": "/tmp/it's"}, {"run_dir": "/tmp/host:path"}, {"run_dir": "/tmp/$(id)"},
        {"queue": "debug\n"}, {"account": "PROJ\n"}, {"name": "abc\n"}, {"env": {"A\n": "1"}},
        {"vllm_args": ["--x\n#PBS -V"]}, {"env": {"A B": "1"}},
        {"env": {"VLLM_API_KEY": "k"}},
    ],
)
def test_hostile_directive_values_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        _render(preset="dp4", profile="generic-pbspro", **kw)


def _user_profile(name: str, body: str) -> Path:
    from pbs_toolkit import paths

    d = paths.user_config_dir() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.yaml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    ("line", "key"),
    [("select: '1:ngpus=4 -V'", "select"), ("place: 'scatter -V'", "place"), ("filesystems: 'a b'", "filesystems"),
     ("extra_directives: [\"-l a=b\\n#PBS -V\"]", "extra_directives"),
     ("extra_directives: ['-l a=b -V']", "extra_directives"), ("extra_directives: ['-V']", "extra_directives"),
     ("extra_directives: ['#PBS -V']", "extra_directives"),
     ("keep_files: ''", "keep_files"), ("scheduler: lsf", "scheduler")],
)
def test_hostile_profile_values_refused(line: str, key: str) -> None:
    path = _user_profile("hostile", f"gpus_per_node: 4\n{line}\n")
    with pytest.raises(ConfigError) as err:
        _render(preset="dp4", profile="hostile")
    assert str(path) in str(err.value) and key in str(err.value)


def test_default_run_dir_under_runs_root(isolated_user: Path) -> None:
    job = render(RenderRequest(model=MODEL, preset="dp4", profile="generic-pbspro"))
    assert job.run_dir.startswith(str(isolated_user / "runs") + "/qwen3-vl-2b-instruct-")
    assert f"#PBS -o {job.run_dir}/pbs.out" in job.job_script


def test_every_value_reaching_shell_is_quoted() -> None:
    job = _render(preset="dp4", profile="generic-pbspro", served_model_name="a b $(id)",
                  vllm_args=["--chat-template", "{{ x }}; $(id)"], env={"WEIRD": "it's $(id) `id`"})
    assert "  --served-model-name 'a b $(id)'\n" in job.start_script
    assert "  --chat-template '{{ x }}; $(id)'\n" in job.start_script
    assert "  'WEIRD=it'\"'\"'s $(id) `id`'\n" in job.start_script.split("ENV_EXPORTS=(")[1]


def test_shipped_names_collected() -> None:
    assert {"auto", "cpu", "dp4", "baseline-eager"} <= set(PRESETS)
    assert {"local", "local-gpu", "polaris", "generic-pbspro"} <= set(PROFILES)


@pytest.mark.parametrize("key", ["MODEL", "EAGER", "VLLM_ARGS", "PHASE_READY", "RUN_DIR"])
def test_env_named_like_a_start_script_setting_refused(key: str) -> None:
    """The body exports --env after the settings header: ``MODEL=x`` would replace the model vLLM serves."""
    with pytest.raises(UsageError, match=f"environment variable {key} would overwrite"):
        _render(preset="dp4", profile="generic-pbspro", env={key: "x"})
