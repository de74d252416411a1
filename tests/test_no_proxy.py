"""``pbstk env`` exports NO_PROXY/no_proxy with the endpoint's host (issue 21, item 8), and pbstk's own requests
to an endpoint ignore the shell's proxy.

Login shells on ALCF set ``http_proxy``; a client then sends requests for a compute node to a proxy that cannot
reach it. Here the proxy is a loopback port that refuses every connection: with the shell's variables alone
curl and the OpenAI SDK fail (the setup is live), with ``eval "$(pbstk env)"`` they reach the stand-in server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.endpoints.no_proxy import no_proxy_value


def refusing_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connections are refused


@pytest.fixture
def ready_job(fakepbs: Path, standins: Path) -> str:
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                   "--name", "proxied", "--wait", "--timeout", "30")
    assert result.exit_code == 0, result.output
    return result.stdout.split()[1]


def proxy_env(port: int) -> dict[str, str]:
    proxy = f"http://127.0.0.1:{port}"
    return {"http_proxy": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "HTTPS_PROXY": proxy,
            "NO_PROXY": "example.org", "no_proxy": "example.org,.internal"}


def run_in_shell(exports: str, env: dict[str, str], program: str) -> subprocess.CompletedProcess[str]:
    """``program`` in bash after ``eval "$exports"`` (empty: the shell's variables alone)."""
    return subprocess.run(["bash", "-c", f'eval "$1"; {program}', "bash", exports],  # noqa: S603,S607
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30)


CURL = 'curl -sS --max-time 10 -o /dev/null -w "%{http_code}" -H "Authorization: Bearer $OPENAI_API_KEY" ' \
       '"$OPENAI_BASE_URL/models"'
OPENAI = (f"{sys.executable} -c 'import openai; "
          "print(openai.OpenAI(max_retries=0, timeout=10).models.list().data[0].id)'")


def test_env_exports_no_proxy_and_clients_bypass_the_proxy(ready_job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = proxy_env(refusing_port())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = pbstk("env", ready_job)
    assert result.exit_code == 0, result.output
    exports = result.stdout
    values = dict(line[len("export "):].split("=", 1) for line in exports.splitlines())
    host = values["OPENAI_BASE_URL"].split("//", 1)[1].rsplit(":", 1)[0]
    assert values["NO_PROXY"] == values["no_proxy"] == f"example.org,.internal,{host}"  # appended, not replaced

    key_only = "\n".join(line for line in exports.splitlines() if "PROXY" not in line.upper())
    refused = run_in_shell(key_only, env, CURL)  # the proxy is live: without NO_PROXY curl goes through it
    assert refused.returncode != 0 and refused.stdout in ("", "000"), (refused.stdout, refused.stderr)
    assert run_in_shell(key_only, env, OPENAI).returncode != 0

    direct = run_in_shell(exports, env, CURL)
    assert (direct.returncode, direct.stdout) == (0, "200"), direct.stderr
    sdk = run_in_shell(exports, env, OPENAI)
    assert sdk.returncode == 0 and sdk.stdout.strip() == MODEL, sdk.stderr
    json_env = pbstk("env", ready_job, "--json")
    assert '"NO_PROXY"' in json_env.stdout


def test_bench_ignores_the_shells_proxy(ready_job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in proxy_env(refusing_port()).items():
        monkeypatch.setenv(key, value)
    result = pbstk("bench", ready_job, "--client", "builtin", "-c", "1", "--num-prompts", "2", "--input-len", "4",
                   "--output-len", "3")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, "node7"),
    ({"NO_PROXY": "a, b", "no_proxy": "b,c"}, "a,b,c,node7"),
    ({"no_proxy": "node7,x"}, "node7,x"),
    ({"NO_PROXY": "*"}, "*"),
])
def test_no_proxy_value_appends_once(environ: dict[str, str], expected: str) -> None:
    assert no_proxy_value("http://node7:8000/v1", environ) == expected
