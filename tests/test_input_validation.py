"""Every input is checked at the edge: one ``pbstk: error:`` line, exit 2, nothing written or submitted.

Issue 11, points 7 and 9: each case below was a traceback (or a job that could never work) before. The CLI runs
for real (click's runner, or ``python -m pbs_toolkit`` where stderr of other threads matters); a case is checked
*before* anything else: with no job launched, a bad ``tunnel``/``wait`` option must exit 2, not 7 ("no jobs").
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from conftest import read_calls
from helpers import MODEL, pbstk

from pbs_toolkit.cli.options import check_display_name
from pbs_toolkit.endpoints.entry import EndpointEntry, validate_entry
from pbs_toolkit.errors import RegistryError, UsageError
from pbs_toolkit.jobs.render import RenderedJob, run_dir_error, run_dir_errors
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.settings.presets import params_from_config
from pbs_toolkit.transports import LocalRunner


def assert_refused(result: Result, *needles: str, code: int = 2) -> str:
    """Exit ``code``, and stderr is exactly one ``pbstk: error:`` line containing every needle."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def assert_nothing_launched(user: Path) -> None:
    assert JobStore().all() == []
    assert list((user / "runs").iterdir()) == []


# -- options: numbers, durations, ports, counts ---------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["tunnel", "--local-port", "70000"], "--local-port 70000"),
    (["tunnel", "--local-port", "-1"], "--local-port -1"),
    (["update-endpoint", "--via-tunnel", "--local-port", "99999"], "--local-port 99999"),
    (["wait", "--timeout", "nan"], "--timeout 'nan'"),
    (["wait", "--timeout", "-5"], "--timeout '-5'"),
    (["wait", "--timeout", "0"], "--timeout '0'"),
    (["tunnel", "--timeout", "inf"], "--timeout 'inf'"),
    (["update-endpoint", "--timeout", "-1"], "--timeout '-1'"),
    (["env", "--timeout", "nan"], "--timeout 'nan'"),
    (["metrics", "--interval", "-1"], "--interval '-1'"),
    (["metrics", "--watch", "nan"], "--watch 'nan'"),
    (["bench", "--timeout", "nan"], "--timeout 'nan'"),
    (["bench", "--num-prompts", "-3"], "--num-prompts -3"),
    (["launch", MODEL, "--timeout", "nan"], "--timeout 'nan'"),
    (["launch", MODEL, "--gpus-per-node", "1e20"], "--gpus-per-node '1e20'"),
    (["launch", MODEL, "--gpus-per-node", "100000"], "--gpus-per-node 100000"),
    (["launch", MODEL, "--nodes", "0"], "--nodes 0"),
    (["launch", MODEL, "--nodes", "99999999999999999999999"], "--nodes"),
    (["launch", MODEL, "--walltime", "99999999999999999999:00:00"], "at most 10000 hours"),
    (["launch", MODEL, "--walltime", "10001:00:00"], "at most 10000 hours"),
    # a profile named: without one, a machine with sbatch or qsub on PATH (CI's has sbatch) refuses that first
    (["launch", MODEL, "-P", "local", "--vllm-arg", ""], "--vllm-arg '' is empty"),
    (["launch", MODEL, "-P", "local", "--vllm-arg", "  "], "is empty"),
    (["render", MODEL, "--vllm-arg=--max-model-len=4096", "--vllm-arg", ""], "is empty"),
])
def test_bad_option_is_one_line_before_anything(isolated_user: Path, args: list[str], needle: str) -> None:
    assert_refused(pbstk(*args), needle)
    assert_nothing_launched(isolated_user)


def test_reasonable_bounds_still_pass() -> None:
    result = pbstk("launch", MODEL, "--dry-run", "--walltime", "9999:00:00", "--gpus-per-node", "0",
                   "--timeout", "0.5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dry_run"] is True


def test_tunnel_refuses_a_port_out_of_range_without_a_socket() -> None:
    from pbs_toolkit.transports.tunnel import start_tunnel

    for port in (70000, -1):
        with pytest.raises(UsageError, match="between 0"):
            start_tunnel(LocalRunner(), "127.0.0.1", 1, local_port=port)


# -- names that reach the registry ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--served-model-name", "qwen\nsmall"], "--served-model-name"),
    (["--served-model-name", "qwen\u200bsmall"], "'\\u200b'"),  # zero-width space: invisible in a registry
    (["--served-model-name", "qwen\x1b[31m"], "'\\x1b'"),
    (["--served-model-name", " "], "non-empty"),
    (["--name", "qwen\u2028x"], "--name"),
    (["--name", "qwen "], "whitespace"),
])
def test_names_get_the_registrys_rule_at_launch(isolated_user: Path, args: list[str], needle: str) -> None:
    assert_refused(pbstk("launch", MODEL, *args), needle)
    assert_nothing_launched(isolated_user)


@pytest.mark.parametrize("text", ["qwen", "Qwen/Qwen3-VL-2B-Instruct", "名前", "a b", "a\nb", "a\tb", "a\u200bb",
                                  "a\u2028b", "a\x7fb", " a", "a ", ""])
def test_launch_and_registry_agree_on_names(tmp_path: Path, text: str) -> None:
    """Same rule both places: whatever launch accepts the registry accepts, as alias and as model."""
    try:
        check_display_name("--name", text)
        launch_ok = True
    except UsageError:
        launch_ok = False
    try:
        validate_entry(EndpointEntry(alias=text, model=text, url="http://h:1/v1", key_env="K"), "yaml",
                       tmp_path / "e.yaml")
        registry_ok = True
    except RegistryError:
        registry_ok = False
    assert launch_ok == registry_ok
    # and the rule itself: agreement alone would also pass if both refused every name
    assert launch_ok == (text in ("qwen", "Qwen/Qwen3-VL-2B-Instruct", "名前", "a b")), repr(text)


# -- the API key ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, needle", [
    ("secret\nX-Injected: 1", "control character"),
    ("ключ-секрет", "Latin-1"),
    ("tab\there", "control character"),
    (" padded", "whitespace"),
    ("-e3ZxK_Q2", "starts with '-'"),  # vLLM reads `--api-key -e3...` as an option and exits 2
])
def test_api_key_that_cannot_be_a_header_is_refused_before_qsub(
    fakepbs: Path, isolated_user: Path, monkeypatch: pytest.MonkeyPatch, key: str, needle: str
) -> None:
    monkeypatch.setenv("MY_KEY", key)
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--api-key-env", "MY_KEY")
    line = assert_refused(result, "--api-key-env MY_KEY", needle)
    assert key.strip() not in line  # the secret itself is never printed
    assert read_calls(fakepbs, "qsub") == []
    assert_nothing_launched(isolated_user)


def test_a_key_pbstk_makes_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """token_urlsafe starts with '-' once in 64: such a key made vLLM exit 2 at start (`--api-key -...`)."""
    import secrets

    from pbs_toolkit.jobs.launch import new_api_key

    drawn = iter(["-first-draw", "_second", "third"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    assert new_api_key() == "_second"


# -- config.yaml ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key", [
    ("port: abc\n", "'port'"),
    ('nodes: "x"\n', "'nodes'"),
    ("profile: {a: 1}\n", "'profile'"),
    ("preset: [1]\n", "'preset'"),
    ("gpus_per_node: 1.5e20\n", "'gpus_per_node'"),
    ("queue: [a, b]\n", "'queue'"),
    ("profiles:\n  local:\n    port: [1]\n", "'profiles.local.port'"),
    ("default_presets:\n  m: {x: 1}\n", "'default_presets.m'"),
])
def test_config_yaml_value_of_the_wrong_type(isolated_user: Path, text: str, key: str) -> None:
    config = isolated_user / "config" / "pbstk" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    assert_refused(pbstk("render", MODEL), str(config), key)


def test_config_yaml_not_utf8(isolated_user: Path) -> None:
    config = isolated_user / "config" / "pbstk" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_bytes(b"queue: caf\xe9\n")
    assert_refused(pbstk("render", MODEL), str(config), "not UTF-8")


@pytest.mark.parametrize("text, needle", [
    ("gpus_per_node: 1000\n", "between 0 and 64"),
    ("nodes: 100000000\n", "between 1 and 10000"),
    ("walltime: 99999999999999999999:00:00\n", "at most 10000 hours"),
])
def test_config_yaml_values_out_of_bounds(isolated_user: Path, text: str, needle: str) -> None:
    config = isolated_user / "config" / "pbstk" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    assert_refused(pbstk("render", MODEL, "--profile", "generic-pbspro"), needle)


# -- the profile's select template ----------------------------------------------------------------------------


@pytest.mark.parametrize("select", ["{nodes.__class__}", "{nodes.__class__.__mro__}", "{nodes[0]}", "{nodes!r}",
                                    "{nodes:>9}", "{0}", "{}", "{gpus}", "ncpus={cpus_per_node"])
def test_select_accepts_only_plain_fixed_placeholders(isolated_user: Path, select: str) -> None:
    profile = isolated_user / "site.yaml"
    profile.write_text(f"scheduler: pbs\nselect: '{select}'\n")
    line = assert_refused(pbstk("render", MODEL, "--profile", str(profile)), str(profile), "'select'")
    assert "class" not in line.split("placeholder", 1)[-1].replace("__class__", "")


def test_select_plain_placeholders_and_literal_braces_render(isolated_user: Path) -> None:
    profile = isolated_user / "site.yaml"
    profile.write_text("scheduler: pbs\ngpus_per_node: 4\nselect: '{nodes}:ngpus={gpus_per_node}:x={{y}}'\n")
    result = pbstk("render", MODEL, "--profile", str(profile), "--preset", "dp4")
    assert result.exit_code == 0, result.output
    assert "#PBS -l select=1:ngpus=4:x={y}" in result.stdout


# -- models ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["a" * 300, "org/" + "b" * 300, "./" + "c" * 300])
def test_model_name_too_long_for_the_filesystem(isolated_user: Path, model: str) -> None:
    assert_refused(pbstk("launch", model, "--scheduler", "local"), f"({len(model)} characters)")
    assert_nothing_launched(isolated_user)


@pytest.mark.parametrize("junk", [
    {"hidden_size": 1e308},
    {"hidden_size": 4096, "vocab_size": 1e308},
    {"num_local_experts": 1e300},
    {"num_attention_heads": 0},
    {"hidden_size": "1e999"},
    {"intermediate_size": -5},
    {"head_dim": [1]},
])
def test_model_config_json_with_junk_numbers(tmp_path: Path, junk: dict[str, object]) -> None:
    """Huge or non-numeric sizes make the size unknown (auto: one replica per GPU), never a traceback."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, **junk}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))  # json writes 1e308 as 1e+308 (valid JSON)
    assert params_from_config(config) is None
    result = pbstk("launch", str(model), "--dry-run", "--json", "--profile", "generic-pbspro", "--preset", "auto")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "DP4"


# -- run directory and render -o ------------------------------------------------------------------------------


def _runs_root_cases(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "file instead of a directory": str(a_file),
        "under a file": f"{a_file}/runs",
        "missing and not creatable": "/proc/pbstk-missing/runs",
    }


@pytest.mark.parametrize("case", ["file instead of a directory", "under a file", "missing and not creatable"])
def test_runs_root_that_cannot_hold_a_run_dir(fakepbs: Path, isolated_user: Path, tmp_path: Path,
                                              case: str) -> None:
    root = _runs_root_cases(tmp_path)[case]
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--runs-root", root)
    assert_refused(result, "cannot create the run directory", root)
    assert read_calls(fakepbs, "qsub") == []
    assert JobStore().all() == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_runs_root_read_only(fakepbs: Path, tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir(mode=0o555)
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--runs-root", str(root))
    assert_refused(result, "permission denied")
    assert read_calls(fakepbs, "qsub") == []


@pytest.mark.parametrize("code, reason", [
    (errno.ENOSPC, "no space left"), (errno.EDQUOT, "quota"), (errno.EROFS, "read-only"),
    (errno.ENAMETOOLONG, "too long"), (errno.EIO, "Input/output error"),
])
def test_run_dir_error_names_the_cause(code: int, reason: str) -> None:
    error = run_dir_error(OSError(code, os.strerror(code)), "/runs/x")
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert reason in error.message and "/runs/x" in error.message and "--runs-root" in error.message


def test_disk_full_while_writing_the_run_dir_is_one_usage_error(tmp_path: Path) -> None:
    """A full disk cannot be made without root, and tests write nothing outside tmp_path (opening /dev/full
    with "wb" creates a regular file in /dev where it is missing): the write fails as a full disk's does."""

    class DevFull(LocalRunner):
        def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    @run_dir_errors
    def write(runner: LocalRunner, rendered: RenderedJob) -> None:
        runner.makedirs(rendered.run_dir)
        runner.write_bytes(f"{rendered.run_dir}/job.pbs", b"#!/bin/bash\n")

    rendered = type("R", (), {"run_dir": str(tmp_path / "run")})()
    with pytest.raises(UsageError, match="no space left on the device"):
        write(DevFull(), rendered)


@pytest.mark.parametrize("out", ["/proc/foo", "/proc/self/pbstk"])
def test_render_output_dir_that_cannot_be_written(out: str) -> None:
    assert_refused(pbstk("render", MODEL, "-o", out), out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_render_output_dir_read_only(tmp_path: Path) -> None:
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    assert_refused(pbstk("render", MODEL, "-o", str(out)), str(out))
    assert list(out.iterdir()) == []


# -- SSH ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, needle", [
    (b"Host login\n  HostName 127.0.0.1\n  Port notaport\n", "bad port 'notaport'"),
    (b"Host login\n  HostName 127.0.0.1\n  Port 99999\n", "bad port '99999'"),
    (b"Host login\n  HostName 127.0.0.1\n  ConnectTimeout nan\n", "bad connecttimeout 'nan'"),
    (b"Host login\n  HostName caf\xe9\n", "not UTF-8"),
    (b"Host login\n  HostName 127.0.0.1\n  ProxyCommand nc \"unbalanced %h %p\n", "bad proxycommand"),
    (b"Match exec \"false\nHost login\n  HostName 127.0.0.1\n", "No closing quotation"),
])
def test_ssh_config_junk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     config: bytes, needle: str) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_bytes(config)
    monkeypatch.setenv("HOME", str(home))
    result = pbstk("launch", MODEL, "--ssh", "login", "--preset", "dp4", "--profile", "generic-pbspro")
    assert_refused(result, str(home / ".ssh" / "config"), needle)


@pytest.fixture
def dropping_login_node() -> Iterator[int]:
    """A login node that accepts TCP connections and closes them at once (sshd over MaxStartups, a firewall
    reset): paramiko's transport thread fails reading the banner."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=2)
    server.close()


def test_dropped_connection_prints_no_paramiko_traceback(tmp_path: Path, dropping_login_node: int) -> None:
    """A real process: paramiko logs from its own thread, which click's runner would not show."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host login\n  HostName 127.0.0.1\n  Port {dropping_login_node}\n"
                                          "  User nobody\n")
    env = {**os.environ, "HOME": str(home)}
    proc = subprocess.run(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit", "launch", MODEL, "--ssh", "login", "--accept-new-host-key",
         "--preset", "dp4", "--profile", "generic-pbspro"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"pbstk: error: cannot reach 127.0.0.1:{dropping_login_node}: ")
    assert "Traceback" not in proc.stderr


# -- presets and profiles from YAML ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, needle", [
    ("vllm_args: {--max-model-len: .inf}\n", "finite"),
    ("vllm_args: {--gpu-memory-utilization: .nan}\n", "finite"),
    ("tensor_parallel: 100000000000000000000\n", "at most 1024"),
])
def test_preset_yaml_numbers_out_of_bounds(isolated_user: Path, text: str, needle: str) -> None:
    preset = isolated_user / "config" / "pbstk" / "presets" / "odd.yaml"
    preset.parent.mkdir(parents=True)
    preset.write_text(text)
    assert_refused(pbstk("render", MODEL, "--preset", "odd", "--profile", "generic-pbspro"), str(preset), needle)


@pytest.mark.parametrize("version", ["0.11\n", "0.11 0.12", "0.11\x1b"])
def test_vllm_version_on_one_line(version: str) -> None:
    assert_refused(pbstk("render", MODEL, "--vllm-version", version), "'vllm_version'")


# -- output files of long commands ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["metrics", "--export", "/proc/pbstk-metrics.jsonl"], "--export /proc/pbstk-metrics.jsonl"),
    (["tune", MODEL, "--output", "/proc/pbstk-tune.json"], "--output /proc/pbstk-tune.json"),
    (["tune", MODEL, "--png", "/proc/self/pbstk.png"], "--png /proc/self/pbstk.png"),
    (["tune", MODEL, "--output", "FIFO"], "not a regular file"),  # a FIFO of the test's own, never /dev/null
    (["tune", MODEL, "--concurrency", "1,99999999999"], "concurrencies must be integers from 1 to 10000"),
])
def test_output_file_is_checked_before_waiting_or_launching(isolated_user: Path, args: list[str],
                                                            needle: str) -> None:
    if "FIFO" in args:
        fifo = isolated_user / "out.fifo"
        os.mkfifo(fifo)
        args = [str(fifo) if a == "FIFO" else a for a in args]
    assert_refused(pbstk(*args), needle)
    assert_nothing_launched(isolated_user)


def test_output_file_check_writes_nothing(tmp_path: Path) -> None:
    from pbs_toolkit.cli.options import check_writable_file

    existing = tmp_path / "old.json"
    existing.write_text("keep")
    check_writable_file("--output", str(existing))
    check_writable_file("--output", str(tmp_path / "new.json"))
    assert existing.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json", "user"]


@pytest.mark.parametrize("option, what", [("--profile", "profile file"), ("--preset", "preset file")])
def test_profile_or_preset_path_too_long(option: str, what: str) -> None:
    assert_refused(pbstk("render", MODEL, option, "p" * 300 + ".yaml"), what, "too long")
