"""Profiles that work as shipped: placeholders filled from the resolved settings (or refused before anything is
written), every profile key settable in config.yaml, and ``config show`` / ``profiles show`` naming the layer
that set each value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import Result
from helpers import MODEL, pbstk

from pbs_toolkit import paths
from pbs_toolkit.jobs.store import JobStore


def write_config(text: str) -> Path:
    path = paths.user_config_dir() / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_profile(name: str, text: str) -> Path:
    d = paths.user_config_dir() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.yaml"
    path.write_text(text)
    return path


def render(*args: str) -> Result:
    return pbstk("render", MODEL, "--preset", "dp4", "--run-dir", "/scratch/runs/x", *args)


def settings_line(result: Result, name: str) -> str:
    """The value assignment ``NAME=...`` in the rendered start script."""
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"{name}=")]
    assert len(lines) == 1, result.stdout
    return lines[0].split("=", 1)[1]


def one_error(result: Result) -> str:
    """The single ``pbstk: error:`` line of a refused command (exit 2, no traceback, nothing else)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.stderr
    return lines[0]


# --- the shipped polaris profile ---------------------------------------------------------------------------


def test_polaris_headline_command_fills_the_project_into_its_caches() -> None:
    result = render("--profile", "polaris", "--account", "MYPROJ")
    assert settings_line(result, "HF_HOME_DIR") == "/eagle/projects/MYPROJ/hf_cache"
    assert settings_line(result, "VLLM_CACHE_DIR") == "/eagle/projects/MYPROJ/vllm_cache"
    assert "YOUR_PROJECT" not in result.stdout and "{account}" not in result.stdout


def test_polaris_account_from_config_yaml_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    write_config("account: FROMCFG\n")
    assert settings_line(render("--profile", "polaris"), "HF_HOME_DIR") == "/eagle/projects/FROMCFG/hf_cache"
    monkeypatch.setenv("PBSTK_ACCOUNT", "FROMENV")
    assert settings_line(render("--profile", "polaris"), "HF_HOME_DIR") == "/eagle/projects/FROMENV/hf_cache"


def test_shipped_profiles_hold_no_literal_placeholder() -> None:
    shipped = Path(__file__).parent.parent / "pbs_toolkit" / "settings" / "profiles"
    for path in shipped.glob("*.yaml"):
        assert "YOUR_PROJECT" not in path.read_text(), path


# --- placeholders refused before anything is written --------------------------------------------------------


def test_unfilled_placeholder_is_one_error_naming_key_and_fix(tmp_path: Path, isolated_user: Path) -> None:
    write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\nhf_home: /data/{account}/hf\n")
    out = tmp_path / "out"
    line = one_error(pbstk("render", MODEL, "--preset", "dp4", "--profile", "site", "-o", str(out)))
    assert "hf_home" in line and "{account}" in line
    assert "--account" in line and "PBSTK_ACCOUNT" in line and "'account:'" in line
    assert "--hf-home" in line and "PBSTK_HF_HOME" in line
    assert not out.exists()  # nothing written
    dry = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "site", "--dry-run")
    assert "hf_home" in one_error(dry)
    real = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "site")
    assert "hf_home" in one_error(real)
    assert JobStore().all() == [] and JobStore().intents() == []
    assert list((isolated_user / "runs").iterdir()) == []


@pytest.mark.parametrize("where", ["profile", "config"])
def test_literal_your_project_is_refused(where: str) -> None:
    if where == "profile":
        write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\nvllm_cache_root: /p/YOUR_PROJECT/c\n")
    else:
        write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\n")
        write_config("profiles:\n  site:\n    vllm_cache_root: /p/YOUR_PROJECT/c\n")
    line = one_error(render("--profile", "site", "--account", "A"))
    assert "vllm_cache_root" in line and "YOUR_PROJECT" in line and "--vllm-cache-root" in line


def test_unknown_placeholder_is_refused() -> None:
    write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\nsetup: ['cd /x/{acount}']\n")
    line = one_error(render("--profile", "site", "--account", "A"))
    assert "{acount}" in line and "setup" in line


def test_placeholders_fill_setup_env_and_runs_root_but_leave_shell_braces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PBSTK_RUNS_ROOT")  # the profile's runs_root, placeholder and all
    write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\n"
                  "setup: ['module use /proj/{project}/modules', 'export P=${HOME}/{account}']\n"
                  "env: {SCRATCH: '/scratch/{account}/{user}'}\n"
                  f"runs_root: {tmp_path}/{{account}}/runs\n")
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "site", "--account", "ACC")
    assert result.exit_code == 0, result.output
    assert "'module use /proj/ACC/modules'" in result.stdout
    assert "'export P=${HOME}/ACC'" in result.stdout
    assert "SCRATCH=/scratch/ACC/" in result.stdout
    assert f"RUN_DIR={tmp_path}/ACC/runs/" in result.stdout


def test_user_placeholder_takes_the_ssh_user() -> None:
    write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\nssh_host: alice@login.invalid\n"
                  "hf_home: /home/{user}/hf\n")
    assert settings_line(render("--profile", "site"), "HF_HOME_DIR") == "/home/alice/hf"


# --- every profile key from config.yaml ---------------------------------------------------------------------


def test_config_yaml_sets_caches_setup_env_offline_and_backend_section() -> None:
    write_config(
        "account: ACC\n"
        "hf_home: /global/hf\n"
        "env:\n  FOO: global\n  http_proxy: null\n"
        "profiles:\n"
        "  polaris:\n"
        "    vllm_cache_root: /mine/vllm\n"
        "    hf_hub_offline: false\n"
        "    setup: ['module load mine']\n"
        "    env: {BAR: '2', FOO: per-profile}\n"
        "    pbs: {queue: preemptable, filesystems: 'home:grand'}\n"
    )
    result = render("--profile", "polaris")
    assert settings_line(result, "HF_HOME_DIR") == "/global/hf"
    assert settings_line(result, "VLLM_CACHE_DIR") == "/mine/vllm"
    assert settings_line(result, "HF_HUB_OFFLINE_ON") == "false"
    assert "#PBS -q preemptable" in result.stdout and "#PBS -l filesystems=home:grand" in result.stdout
    header = result.stdout.split("SITE_SETUP=(", 1)[1].split(")", 1)[0]
    assert header.split() == ["'module", "load", "mine'"]
    exports = result.stdout.split("ENV_EXPORTS=(", 1)[1].split(")", 1)[0].split()
    # the profile's https_proxy kept, http_proxy removed (null), FOO from the per-profile section wins
    assert exports == ["https_proxy=http://proxy.alcf.anl.gov:3128", "FOO=per-profile", "BAR=2"]


def test_flag_and_env_beat_config_for_cache_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    write_config("hf_home: /cfg/hf\nvllm_cache_root: /cfg/vc\n")
    monkeypatch.setenv("PBSTK_HF_HOME", "/env/hf")
    monkeypatch.setenv("PBSTK_VLLM_CACHE_ROOT", "/env/vc")
    result = render("--profile", "generic-pbspro", "--hf-home", "/flag/hf")
    assert settings_line(result, "HF_HOME_DIR") == "/flag/hf"
    assert settings_line(result, "VLLM_CACHE_DIR") == "/env/vc"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("setup: {a: b}\n", "'setup' must be a list of strings"),
        ("env: [A]\n", "'env' must be a mapping"),
        ("env: {A: [1]}\n", "'env.A' must be a string"),
        ("hf_hub_offline: maybe\n", "'hf_hub_offline' must be true or false"),
        ("cpus_per_node: many\n", "'cpus_per_node' must be an integer"),
        ("hf_home: [a]\n", "'hf_home' must be a string"),
        ("pbs: {qeue: x}\n", "unknown key 'pbs.qeue'"),
        ("pbs: {queue: x}\nqueue: y\n", "'queue' is given both"),
        ("profiles:\n  polaris:\n    pbs: debug\n", "'profiles.polaris.pbs' must be a mapping"),
        ("profiles:\n  polaris:\n    setup: 3\n", "'profiles.polaris.setup' must be a list"),
    ],
)
def test_config_yaml_type_errors_name_file_and_key(text: str, key: str) -> None:
    path = write_config(text)
    line = one_error(render("--profile", "generic-pbspro"))
    assert line.startswith(f"pbstk: error: {path}: ") and key in line


# --- config show / profiles show ----------------------------------------------------------------------------


def test_config_show_names_each_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    write_config("profile: polaris\naccount: ACC\nqueue: globalq\nenv: {FOO: x}\n"
                 "profiles:\n  polaris:\n    pbs: {queue: prof}\n    hf_hub_offline: false\n")
    monkeypatch.setenv("PBSTK_WALLTIME", "00:30:00")
    result = pbstk("config", "show", "--json", "--venv", "/flag/venv")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["profile"], doc["profile_source"]) == ("polaris", "config.yaml (global)")
    s = doc["settings"]
    assert s["queue"] == {"value": "prof", "source": "config.yaml (profiles.polaris)"}
    assert s["account"] == {"value": "ACC", "source": "config.yaml (global)"}
    assert s["walltime"] == {"value": "00:30:00", "source": "PBSTK_WALLTIME"}
    assert s["venv"] == {"value": "/flag/venv", "source": "flag --venv"}
    assert s["hf_hub_offline"] == {"value": False, "source": "config.yaml (profiles.polaris)"}
    assert s["gpus_per_node"] == {"value": 4, "source": "profile polaris"}
    assert s["bind_host"] == {"value": "0.0.0.0", "source": "package default"}
    assert s["hf_home"] == {"value": "/eagle/projects/ACC/hf_cache", "source": "profile polaris",
                            "template": "/eagle/projects/{account}/hf_cache"}
    assert s["env"]["source"] == "profile polaris + config.yaml (global)"
    assert s["env"]["value"]["FOO"] == "x"
    assert doc["problems"] == []


def test_profiles_show_text_and_unfilled_warning() -> None:
    result = pbstk("profiles", "show", "polaris")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("profile: polaris  (argument NAME; file ")
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[3:]}
    assert rows["ssh_host"].split()[1:] == ["polaris.alcf.anl.gov", "profile", "polaris"]
    assert "/eagle/projects/{account}/hf_cache" in rows["hf_home"]
    assert "a launch would be refused" in result.stderr and "needs an account" not in result.stdout
    assert pbstk("profiles", "show", "polaris", "-A", "P").stderr == ""


def test_profiles_listing_unchanged() -> None:
    result = pbstk("profiles", "--json")
    assert result.exit_code == 0, result.output
    names = {p["name"] for p in json.loads(result.stdout)}
    assert {"local", "polaris", "generic-pbspro", "local-gpu"} <= names
    assert pbstk("profiles").stdout.splitlines()[0].split()[:2] == ["NAME", "SCHEDULER"]


def test_show_of_unknown_profile_is_one_error() -> None:
    assert "unknown profile 'nope'" in one_error(pbstk("profiles", "show", "nope"))
    assert "unknown profile 'nope'" in one_error(pbstk("config", "show", "--profile", "nope"))


def test_launch_refuses_an_unfilled_placeholder_before_any_ssh_login() -> None:
    """The refusal comes before anything touches the SSH host: a closed loopback port would make it exit 4.
    (A regression guard: the SSH runner connects lazily, and render checks placeholders before paths.)"""
    write_profile("site", "scheduler: pbs\nqueue: q\ngpus_per_node: 4\nssh_host: 'nobody@127.0.0.1:9'\n"
                  "vllm_cache_root: /proj/{account}/vc\n")
    line = one_error(pbstk("launch", MODEL, "--preset", "dp4", "--profile", "site"))
    assert "vllm_cache_root" in line and "{account}" in line
