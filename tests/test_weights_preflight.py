"""``preflight_weights`` as other commands call it (``run`` does), without a Hub: which profiles it checks, and the
worker and the reader agreeing on where the manifest is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pbs_toolkit.errors import WeightsError
from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.transports.local import LocalRunner
from pbs_toolkit.weights import manifest, stage
from pbs_toolkit.weights.preflight import preflight_weights, revision_of


def test_only_offline_profiles_with_a_cache_are_checked_for_hub_models(tmp_path: Path) -> None:
    runner = LocalRunner()
    preflight_weights(runner, "acme/none", Profile(name="online", hf_home=str(tmp_path)))  # nodes can fetch
    preflight_weights(runner, "acme/none", Profile(name="nocache", hf_hub_offline=True))  # default cache: unchecked
    with pytest.raises(WeightsError) as err:
        preflight_weights(runner, "acme/none", Profile(name="site", hf_home=str(tmp_path), hf_hub_offline=True),
                          vllm_args=["--revision=v2"])
    assert err.value.exit_code == 11
    assert "run `pbstk stage acme/none --profile site --revision v2` first, or pass --stage" in err.value.message
    assert "no revision v2" in err.value.message


def test_a_model_directory_needs_config_and_weights(tmp_path: Path) -> None:
    profile = Profile(name="site", hf_hub_offline=True)
    with pytest.raises(WeightsError, match="has no config.json"):
        preflight_weights(LocalRunner(), str(tmp_path), profile)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match="has no weight files"):
        preflight_weights(LocalRunner(), str(tmp_path), profile)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    preflight_weights(LocalRunner(), str(tmp_path), profile)


def test_revision_comes_from_the_vllm_arguments() -> None:
    assert revision_of([]) == "main"
    assert revision_of(["--revision", "abc"]) == "abc"
    assert revision_of(["--max-model-len=8", "--revision=v1.0"]) == "v1.0"


def test_the_worker_and_the_reader_agree_on_names() -> None:
    spec = importlib.util.spec_from_file_location("stage_weights", stage.WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    assert worker.MANIFEST_DIR == manifest.MANIFEST_DIR
    assert worker.RESULT_PREFIX == stage.RESULT_PREFIX
    assert worker.repo_folder("/c", "a/b") == manifest.repo_folder("/x", "a/b").replace("/x/hub", "/c")
