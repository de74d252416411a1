"""Settings order: flag > PBSTK_* variable > user config.yaml (per-profile section > top level) > profile >
package defaults; user presets and profiles replace shipped ones; YAML errors name the file, line and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError, UsageError
from pbs_toolkit.jobs.render import RenderedJob, RenderRequest, render
from pbs_toolkit.settings.config import resolve_settings
from pbs_toolkit.settings.presets import list_presets, load_preset
from pbs_toolkit.settings.profiles import list_profiles, load_profile

RUN_DIR = "/scratch/runs/cfg"


def write_config(text: str) -> Path:
    path = paths.user_config_dir() / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_user(kind: str, name: str, text: str) -> Path:
    d = paths.user_config_dir() / kind
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.yaml"
    path.write_text(text)
    return path


def _render(**kw: Any) -> RenderedJob:
    kw.setdefault("preset", "dp4")
    return render(RenderRequest(model="Qwen/Qwen3-VL-2B-Instruct", run_dir=RUN_DIR, **kw))


def directive(job: RenderedJob, option: str) -> str | None:
    for line in job.job_script.splitlines():
        if line.startswith(f"#PBS {option} "):
            return line.split(" ", 2)[2]
    return None


def test_user_dir_is_isolated(isolated_user: Path) -> None:
    assert paths.user_config_dir() == isolated_user / "config" / "pbstk"


# --- precedence ------------------------------------------------------------------------------------------

#: layers from weakest to strongest; each case enables the layers up to and including one
LAYERS = ["defaults", "profile", "config", "per_profile", "env", "flag"]


def _setup_layers(upto: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Prepare every layer up to ``upto``; return the render kwargs (profile and, for "flag", the flags)."""
    enabled = LAYERS[: LAYERS.index(upto) + 1]
    if "profile" in enabled:
        write_user("profiles", "site", "queue: profq\naccount: profacct\nwalltime: '03:00:00'\ngpus_per_node: 4\n")
    else:  # a profile that sets none of the three: package defaults apply
        write_user("profiles", "site", "gpus_per_node: 4\n")
    config = ""
    if "config" in enabled:
        config += "queue: cfgq\naccount: cfgacct\nwalltime: '04:00:00'\n"
    if "per_profile" in enabled:
        config += "profiles:\n  site:\n    queue: ppq\n    account: ppacct\n    walltime: '05:00:00'\n"
        config += "  other:\n    queue: otherq\n"  # another profile's section never applies
    if config:
        write_config(config)
    if "env" in enabled:
        monkeypatch.setenv("PBSTK_QUEUE", "envq")
        monkeypatch.setenv("PBSTK_ACCOUNT", "envacct")
        monkeypatch.setenv("PBSTK_WALLTIME", "06:00:00")
    kw: dict[str, Any] = {"profile": "site"}
    if "flag" in enabled:
        kw.update(queue="flagq", account="flagacct", walltime="07:00:00")
    return kw


@pytest.mark.parametrize(
    ("upto", "queue", "account", "walltime"),
    [
        ("defaults", None, None, "01:00:00"),
        ("profile", "profq", "profacct", "03:00:00"),
        ("config", "cfgq", "cfgacct", "04:00:00"),
        ("per_profile", "ppq", "ppacct", "05:00:00"),
        ("env", "envq", "envacct", "06:00:00"),
        ("flag", "flagq", "flagacct", "07:00:00"),
    ],
)
def test_precedence(upto: str, queue: str | None, account: str | None, walltime: str,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    job = _render(**_setup_layers(upto, monkeypatch))
    lines = job.job_script.splitlines()
    assert directive(job, "-q") == queue
    assert directive(job, "-A") == account
    assert f"#PBS -l walltime={walltime}" in lines


def test_profile_chosen_by_config_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_settings({}).profile == "local"
    write_config("profile: generic-pbspro\npreset: tp4\n")
    assert (resolve_settings({}).profile, resolve_settings({}).preset) == ("generic-pbspro", "tp4")
    monkeypatch.setenv("PBSTK_PROFILE", "polaris")
    monkeypatch.setenv("PBSTK_PRESET", "dp4")
    assert (resolve_settings({}).profile, resolve_settings({}).preset) == ("polaris", "dp4")
    flags = resolve_settings({"profile": "local-gpu", "preset": "single"})
    assert (flags.profile, flags.preset) == ("local-gpu", "single")


def test_per_profile_preset_and_account(monkeypatch: pytest.MonkeyPatch) -> None:
    write_config("account: TOP\nprofiles:\n  polaris:\n    account: POL\n    preset: tp2dp2\n")
    job = render(RenderRequest(model="Qwen/Qwen3-VL-2B-Instruct", profile="polaris", run_dir=RUN_DIR))
    assert directive(job, "-A") == "POL" and job.preset.name == "tp2dp2"
    other = _render(profile="generic-pbspro")
    assert directive(other, "-A") == "TOP"


def test_unquoted_yaml_walltime_is_understood() -> None:
    # YAML 1.1 reads an unquoted 02:30:00 as the integer 9000 (base 60); PBS also takes plain seconds.
    write_config("walltime: 02:30:00\n")
    assert "#PBS -l walltime=02:30:00" in _render(profile="generic-pbspro").job_script


def test_env_integer_must_be_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_GPUS_PER_NODE", "four")
    with pytest.raises(ConfigError, match="PBSTK_GPUS_PER_NODE"):
        _render(profile="generic-pbspro")


def test_env_gpus_per_node_is_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    # explicit: a smaller preset is not shrunk to fit it (a larger one spans nodes: test_multinode_render.py)
    monkeypatch.setenv("PBSTK_GPUS_PER_NODE", "4")
    with pytest.raises(UsageError, match="requests 4"):
        _render(profile="generic-pbspro", preset="dp2")
    monkeypatch.setenv("PBSTK_GPUS_PER_NODE", "2")
    assert "ngpus=2" in _render(profile="generic-pbspro", preset="dp2").job_script


# --- user presets and profiles ---------------------------------------------------------------------------


def test_user_preset_overrides_shipped() -> None:
    path = write_user("presets", "dp4", "summary: mine\ntensor_parallel: 2\ndata_parallel: 2\n")
    preset = load_preset("dp4")
    assert (preset.source, preset.layout(), preset.summary) == (str(path), "TP2xDP2", "mine")
    assert [p.source for p in list_presets() if p.name == "dp4"] == [str(path)]
    job = _render(profile="generic-pbspro", preset="dp4")
    assert "--tensor-parallel-size 2" in job.start_script and "--max-num-seqs" not in job.start_script


def test_user_preset_new_name_listed() -> None:
    write_user("presets", "mine", "data_parallel: 2\n")
    assert "mine" in [p.name for p in list_presets()]
    assert _render(profile="generic-pbspro", preset="mine").preset.layout() == "DP2"


def test_user_profile_overrides_shipped() -> None:
    path = write_user("profiles", "polaris", "queue: myq\ngpus_per_node: 4\nselect: '{nodes}:system=polaris'\n")
    profile = load_profile("polaris")
    assert (profile.source, profile.queue, profile.account_required) == (str(path), "myq", False)
    assert [p.source for p in list_profiles() if p.name == "polaris"] == [str(path)]
    job = _render(profile="polaris")  # no account needed any more
    assert directive(job, "-q") == "myq" and directive(job, "-A") is None


def test_profile_by_path(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.yaml"
    path.write_text("name: elsewhere\nqueue: farq\ngpus_per_node: 4\n")
    assert directive(_render(profile=str(path)), "-q") == "farq"


# --- errors name the file, the line and the key ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["config", "presets", "profiles"])
def test_malformed_yaml_names_file_and_line(kind: str) -> None:
    text = "queue: ok\nbroken: [unclosed\nother: 1\n"
    path = write_config(text) if kind == "config" else write_user(kind, "bad", text)
    with pytest.raises(ConfigError) as err:
        if kind == "config":
            resolve_settings({})
        elif kind == "presets":
            load_preset("bad")
        else:
            load_profile("bad")
    message = str(err.value)
    assert message.startswith(f"{path}: malformed YAML")
    assert "line 3" in message or "line 2" in message


@pytest.mark.parametrize(
    ("kind", "text", "key"),
    [
        ("config", "qeueu: x\n", "'qeueu'"),
        ("config", "profiles:\n  polaris:\n    qeueu: x\n", "'profiles.polaris.qeueu'"),
        ("config", "profiles: [polaris]\n", "'profiles'"),
        ("config", "profiles:\n  polaris: debug\n", "'profiles.polaris'"),
        ("presets", "tensor_paralel: 2\n", "'tensor_paralel'"),
        ("presets", "data_parallel: two\n", "'data_parallel'"),
        ("presets", "vllm_args: {max-num-seqs: 4}\n", "max-num-seqs"),
        ("profiles", "gpus_per_nod: 4\n", "'gpus_per_nod'"),
        ("profiles", "hf_hub_offline: maybe\n", "'hf_hub_offline'"),
        ("profiles", "address: anywhere\n", "'address'"),
    ],
)
def test_bad_key_names_file_and_key(kind: str, text: str, key: str) -> None:
    path = write_config(text) if kind == "config" else write_user(kind, "bad", text)
    with pytest.raises(ConfigError) as err:
        if kind == "config":
            resolve_settings({"profile": "generic-pbspro"})
        elif kind == "presets":
            load_preset("bad")
        else:
            load_profile("bad")
    assert str(err.value).startswith(f"{path}: ")
    assert key in str(err.value)


def test_top_level_must_be_mapping() -> None:
    path = write_config("- a\n- b\n")
    with pytest.raises(ConfigError, match=f"^{path}: expected a mapping"):
        resolve_settings({})


def test_a_single_replica_runs_the_engine_of_a_data_parallel_rank() -> None:
    # N `single` replicas behind `pbstk serve` stand for dpN: with 256 sequences where a dp2 rank had 512, a
    # 2-replica service at c=1024 held 512 requests at once where dp2 held 1,024 (0.87x its tokens/s, 4x H200)
    engine = ("--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization")
    single = load_preset("single").vllm_args
    for name in ("dp2", "dp4", "dp8"):
        assert {flag: single.get(flag) for flag in engine} == {flag: load_preset(name).vllm_args.get(flag)
                                                               for flag in engine}
