"""``pbstk update-endpoint``, ``env`` and ``tunnel`` end to end: real jobs under the fake PBS with the
stand-in vLLM, registries of every format, real bash, and a real sshd for the tunnel."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launch, marker, until
from helpers import pbstk_raising as pbstk
from sshd import SshdInfo

from pbs_toolkit.endpoints.registry import read_endpoints

OTHERS = {
    "py": 'ENDPOINTS = {\n    # keep me\n    "other": {"model": "m", "url": "http://o:1/v1", "key": "K"},\n}\n',
    "toml": '# keep me\n[[endpoint]]\nendpoint_id = "other"\nmodel = "m"\nurl = "http://o:1/v1"\nkey = "K"\n',
    "yaml": "endpoints:\n  other:  # keep me\n    model: m\n    url: http://o:1/v1\n    key_env: K\n",
    "json": '{"endpoints": {"other": {"model": "m", "url": "http://o:1/v1", "key_env": "K"}}}\n',
}


def cli_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit.cli.main", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def get_models(base_url: str, key: str | None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(base_url + "/models", headers=headers)  # noqa: S310 - loopback
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
        return json.loads(answer.read())


def test_every_format_round_trips(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    record = launch("--name", "qwen-vl")
    m_url = None
    for fmt, text in OTHERS.items():
        path = tmp_path / f"endpoints.{fmt}"
        path.write_text(text)
        result = pbstk("update-endpoint", "--registry", str(path), "--timeout", "30")
        assert result.exit_code == 0, result.output
        entries = read_endpoints(path)
        assert set(entries) == {"other", "qwen-vl"}, fmt  # the alias defaults to --name
        entry = entries["qwen-vl"]
        m = marker(record)
        m_url = f"http://{m['address']}:{m['port']}/v1"
        assert (entry.model, entry.url, entry.key_env) == (MODEL, m_url, record.api_key_env)
        assert "0.0.0.0" not in path.read_text()
        if fmt in ("py", "toml"):  # the tools' own files keep their comments (pbstk's yaml/json need not)
            assert "keep me" in path.read_text()
        # the registry names the key's variable, never the key
        assert record.api_key and record.api_key not in path.read_text()
        assert entries["other"].url == "http://o:1/v1"
        again = pbstk("update-endpoint", "--registry", str(path), "--alias", "second", "--json")
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout)["alias"] == "second"
        assert set(read_endpoints(path)) == {"other", "qwen-vl", "second"}
    # an explicit --format overrides the suffix
    odd = tmp_path / "endpoints.conf"
    result = pbstk("update-endpoint", "--registry", str(odd), "--format", "toml")
    assert result.exit_code == 0, result.output
    assert read_endpoints(odd, "toml")["qwen-vl"].url == m_url
    # no --registry: pbstk's own registry in the (isolated) XDG data dir
    assert pbstk("update-endpoint").exit_code == 0
    assert read_endpoints(None)["qwen-vl"].url == m_url


def test_alias_defaults_to_a_slug_of_the_model(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    launch()
    path = tmp_path / "endpoints.py"
    result = pbstk("update-endpoint", "--registry", str(path), "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert list(read_endpoints(path)) == ["qwen3-vl-2b-instruct"]


def test_bad_input_fails_before_waiting(fakepbs: Path, standins: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")  # a server that never gets ready
    record = launch()
    unknown = pbstk("update-endpoint", "12345", "--registry", str(tmp_path / "e.py"))
    assert unknown.exit_code == 7 and "unknown job '12345'" in unknown.stderr
    broken = tmp_path / "endpoints.py"
    broken.write_bytes(b"ENDPOINTS = {\n  'a': {\n")
    before = broken.read_bytes()
    cases = [
        (["--registry", str(tmp_path / "missing" / "endpoints.py")], 8, "missing does not exist"),
        (["--registry", str(broken)], 8, str(broken)),
        (["--registry", str(tmp_path / "e.py"), "--alias", "bad\u00a0alias"], 8, "not printable"),
        (["--registry", str(tmp_path / "e.yaml"), "--alias", "two\nlines"], 8, "control character"),
        (["--registry", str(tmp_path / "e.txt")], 8, "cannot tell the registry format"),
    ]
    for args, code, message in cases:
        begin = time.monotonic()
        result = pbstk("update-endpoint", record.job_id, *args, "--timeout", "60")
        assert result.exit_code == code, (args, result.output)
        # the server never gets ready: a wait would last the whole --timeout 60 (and exit 6, not 8); 20 s is far
        # from both, even on a loaded machine
        assert time.monotonic() - begin < 20, f"{args} waited for the server"
        errors = result.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("pbstk: error: ") and message in errors[0], errors
    assert broken.read_bytes() == before
    assert not (tmp_path / "missing").exists()
    timeout = pbstk("update-endpoint", record.job_id, "--registry", str(tmp_path / "e.json"), "--timeout", "1")
    assert timeout.exit_code == 6 and "was not ready after 1 s" in timeout.stderr
    assert not (tmp_path / "e.json").exists()


def test_registry_written_only_once_ready(fakepbs: Path, standins: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "2.5")
    record = launch()
    path = tmp_path / "endpoints.toml"
    proc = cli_process("update-endpoint", "--registry", str(path), "--timeout", "30")
    m = until(lambda: (x := marker(record)).get("phase") == "starting" and x.get("pid") and x, what="start")
    first_answer = None
    while proc.poll() is None:  # the stand-in is starting: nothing written yet
        try:
            get_models(f"http://{m['address']}:{m['port']}/v1", record.api_key)
            first_answer = first_answer or time.monotonic()
        except OSError:
            assert not path.exists(), "written before the server answered"
        time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert first_answer is not None and path.exists()
    assert path.stat().st_mtime >= time.time() - (time.monotonic() - first_answer) - 0.1
    assert read_endpoints(path)[record.name].url == f"http://{m['address']}:{m['port']}/v1"


def test_env_evals_in_bash(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    record = launch()
    result = pbstk("env", "--timeout", "30")
    assert result.exit_code == 0, result.output
    script = tmp_path / "check.sh"
    script.write_text(
        'set -eu\neval "$1"\n'
        f'exec {sys.executable} -c "import json, os; print(json.dumps(dict(os.environ)))"\n'
    )
    env = {"PATH": os.environ["PATH"]}
    shown = subprocess.run(["bash", str(script), result.stdout], capture_output=True, text=True,  # noqa: S603,S607
                           env=env, check=True)
    values = json.loads(shown.stdout)
    m = marker(record)
    base = f"http://{m['address']}:{m['port']}/v1"
    assert values["OPENAI_BASE_URL"] == base and values["PBSTK_SERVER_ROOT"] == base[: -len("/v1")]
    assert values["OPENAI_API_KEY"] == record.api_key
    assert record.api_key_env and values[record.api_key_env] == record.api_key
    assert values["PBSTK_MODEL"] == MODEL
    assert get_models(values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"])["data"][0]["id"] == MODEL
    not_ready = pbstk("cancel", record.job_id)
    assert not_ready.exit_code == 0
    after = pbstk("env", record.job_id)
    assert after.exit_code == 5 and "not READY" in after.stderr


def test_env_without_key(fakepbs: Path, standins: Path) -> None:
    launch("--no-api-key")
    result = pbstk("env", "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert "export OPENAI_API_KEY=EMPTY" in result.stdout
    assert "export PBSTK_NO_KEY=EMPTY" in result.stdout  # the variable registries name for such a job


# -- tunnel over a real sshd ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    return out, err


@pytest.mark.ssh
def test_tunnel_and_via_tunnel_over_ssh(login_node: SshdInfo, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    record = launch("--ssh", login_node.alias)
    port = free_port()
    proc = cli_process("tunnel", record.job_id, "--local-port", str(port), "--timeout", "30")
    try:
        assert proc.stdout is not None
        first = until(proc.stdout.readline, timeout=30, what="the tunnel line")
        assert first.startswith(f"http://127.0.0.1:{port}/v1 -> http://")
        assert get_models(f"http://127.0.0.1:{port}/v1", record.api_key)["data"][0]["id"] == MODEL
    finally:
        _stop(proc)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).recv(1)
    # update-endpoint --via-tunnel registers the local URL and keeps the tunnel open until Ctrl-C
    path = tmp_path / "endpoints.py"
    proc = cli_process("update-endpoint", "--registry", str(path), "--via-tunnel", "--timeout", "30")
    try:
        assert proc.stdout is not None
        until(proc.stdout.readline, timeout=30, what="the registry line")
        url = read_endpoints(path)[record.name].url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert get_models(url, record.api_key)["data"][0]["id"] == MODEL
    finally:
        _stop(proc)
    assert pbstk("cancel", record.job_id).exit_code == 0


def _hint_url(line: str) -> str:
    """The ``--local-url`` of ``update-endpoint --via-tunnel``'s ``pbstk env`` hint."""
    assert "--local-url" in line, line
    return line.split("--local-url ", 1)[1].split(")", 1)[0].strip("'\"")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_via_tunnel_hint_and_env_give_the_tunnel_and_closing_it_removes_the_entry(
        fakepbs: Path, standins: Path, tmp_path: Path, stop: signal.Signals) -> None:
    record = launch("--name", "tun")
    path = tmp_path / "endpoints.yaml"
    path.write_text(OTHERS["yaml"])
    proc = cli_process("update-endpoint", record.job_id, "--registry", str(path), "--via-tunnel", "--timeout", "30")
    try:
        assert proc.stdout is not None
        until(proc.stdout.readline, timeout=30, what="the registry line")
        hint = until(proc.stdout.readline, timeout=10, what="the env hint")
        url = read_endpoints(path)["tun"].url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert _hint_url(hint) + "/v1" == url, hint  # the hint names the tunnel, not the node
        env = pbstk("env", record.job_id, "--local-url", _hint_url(hint))
        assert f"export OPENAI_BASE_URL={url}" in env.stdout, env.stdout
        assert get_models(url, record.api_key)["data"][0]["id"] == MODEL
    finally:
        proc.send_signal(stop)  # Ctrl-C, or a plain `kill` of a backgrounded update-endpoint
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert set(read_endpoints(path)) == {"other"}, path.read_text()  # the dead tunnel URL went with it
    assert f"removed 'tun' -> {url}" in err
    assert pbstk("cancel", record.job_id).exit_code == 0


def test_via_tunnel_refuses_keep_after_end(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    from helpers import pbstk as plain

    record = launch()
    result = plain("update-endpoint", record.job_id, "--registry", str(tmp_path / "e.yaml"), "--via-tunnel",
                   "--keep-after-end")
    assert plain("cancel", record.job_id).exit_code == 0
    assert result.exit_code == 2 and "--keep-after-end with --via-tunnel" in result.stderr, result.output
    assert not (tmp_path / "e.yaml").exists()
