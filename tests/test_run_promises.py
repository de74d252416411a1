"""``pbstk run`` keeps the promises of docs/campaigns.md and docs/registries.md (issue 32): the server is drained
before it is cancelled, a run takes out of a registry only what it put there, options are refused before
anything is queued, an interrupt says what happened once, and the job's end is recorded where run ends it.

Real parts: pbstk as a subprocess, the local scheduler and the fake PBS running the stand-in ``vllm``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import helpers
import pytest
from helpers import MODEL

from pbs_toolkit.jobs.store import JobStore

TESTS = Path(__file__).resolve().parent
LOCAL = ("--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto")
PBS = ("--profile", "generic-pbspro", "--preset", "dp4", "--port", "auto")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS.parent), **extra}


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, check=False, env=env or _env())


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test runner may have it ignored: Ctrl-C must act


def _popen(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args], env=env or _env(), text=True,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)  # noqa: PLW1509 - before exec, nothing else


def _running(base_url: str, key: str) -> float:
    request = urllib.request.Request(base_url.removesuffix("/v1") + "/metrics",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - loopback
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


# -- 1. the single-job drain -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "pbs"])
def test_a_request_in_flight_when_command_ends_completes(where: str, standins: Path, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    """COMMAND hands its URL and key out and ends while a slow request runs: run drains before it cancels."""
    if where == "pbs":
        request.getfixturevalue("fakepbs")
    options = LOCAL if where == "local" else PBS
    seen, go = tmp_path / "seen", tmp_path / "go"
    command = f'echo "$OPENAI_BASE_URL $OPENAI_API_KEY" > {seen}.tmp && mv {seen}.tmp {seen}; ' \
              f'while [ ! -e {go} ]; do sleep 0.1; done'
    proc = _popen("run", MODEL, *options, "--name", "dr", "--", "sh", "-c", command)
    answer: dict[str, Any] = {}
    try:
        helpers.until(seen.exists, timeout=90, what="COMMAND to start")
        base_url, key = seen.read_text().split()

        def slow() -> None:
            body = json.dumps({"prompt": "hi", "max_tokens": 4, "standin_delay_s": 4}).encode()
            post = urllib.request.Request(f"{base_url}/completions", data=body, method="POST",
                                          headers={"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(post, timeout=60) as reply:  # noqa: S310 - loopback
                    answer["status"] = reply.status
            except OSError as exc:
                answer["error"] = repr(exc)

        client = threading.Thread(target=slow)
        client.start()
        helpers.until(lambda: _running(base_url, key) >= 1, timeout=30, what="the slow request to run")
        go.touch()  # COMMAND ends with the request in flight
        _, err = proc.communicate(timeout=120)
        client.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert answer == {"status": 200}, (answer, err)
    job = JobStore().find("dr").job_id
    assert f"pbstk: draining {job}: 1 request(s) still in flight" in err, err
    assert err.index("pbstk: draining") < err.index(f"pbstk: cancelled {job}"), err


# -- 3. refused before anything is queued ----------------------------------------------------------------


def test_bad_registry_and_entry_options_are_refused_before_qsub(standins: Path, fakepbs: Path,
                                                                tmp_path: Path) -> None:
    readonly = tmp_path / "ro"
    readonly.mkdir()
    (readonly / "endpoints.yaml").write_text("endpoints: {}\n")
    readonly.chmod(0o555)
    (tmp_path / "adir").mkdir()
    cases = [
        (("--registry", str(tmp_path / "endpoints.txt")), 8, "cannot tell the registry format"),
        (("--registry", str(readonly / "endpoints.yaml")), 8, str(readonly)),
        (("--registry", "/dev/null"), 8, "/dev/null"),
        (("--registry", str(tmp_path / "adir")), 8, "adir"),
        (("--registry", str(tmp_path / "e.py"), "--alias", "two\nlines"), 8, "alias"),
        (("--registry", str(tmp_path / "e.py"), "--format", "toml"), 8, "does not match the suffix"),
        (("--alias", "qwen"), 2, "--registry"),
        (("--format", "yaml"), 2, "--registry"),
    ]
    try:
        for options, code, says in cases:
            refused = cli("run", MODEL, *PBS, "--name", "bad", *options, "--", "true")
            assert refused.returncode == code, (options, refused.stderr)
            lines = refused.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("pbstk: error: ") and says in lines[0], (options, lines)
            assert helpers.fake_jobs(fakepbs) == {}, options  # no qsub happened
        reused = cli("run", "--reuse", "nosuch", "--registry", "/dev/null", "--", "true")
        assert reused.returncode == 8 and "/dev/null" in reused.stderr, reused.stderr
    finally:
        readonly.chmod(0o755)
    assert not list(JobStore().all())  # nothing launched, nothing recorded
    assert not (tmp_path / "e.py").exists()


# -- 2. a run removes only what it added ---------------------------------------------------------------------

HAND_WRITTEN = '''# my endpoints, kept by hand
ENDPOINTS = {
    "theirs": {"model": "m", "url": "http://10.0.0.9:8000/v1", "key": "EMPTY"},  # a colleague's
}
'''


def _launched(name: str) -> str:
    out = cli("launch", MODEL, *LOCAL, "--name", name, "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[1]


def _url(job: str) -> str:
    return str(helpers.status_of(job)["url"])


def test_run_reuse_puts_back_the_alias_it_re_pointed(standins: Path, tmp_path: Path) -> None:
    """``update-endpoint svc --alias other``, then ``run --reuse j1 --alias other``: during the run ``other``
    is j1's; after it the file is as it was, byte for byte, and svc's entry is still svc's to take back."""
    registry, during = tmp_path / "endpoints.py", tmp_path / "during.py"
    registry.write_text(HAND_WRITTEN)
    svc, j1 = _launched("svc"), _launched("j1")
    added = cli("update-endpoint", svc, "--registry", str(registry), "--alias", "other")
    assert added.returncode == 0, added.stderr
    before = registry.read_bytes()
    ran = cli("run", "--reuse", j1, "--registry", str(registry), "--alias", "other", "--",
              "cp", str(registry), str(during))
    assert ran.returncode == 0, ran.stderr
    assert _url(j1) in during.read_text() and _url(svc) not in during.read_text()  # j1's during the run
    assert registry.read_bytes() == before, ran.stderr  # svc's again, byte for byte
    assert "put 'other'" in ran.stderr and "back as it was" in ran.stderr, ran.stderr
    # the store knows the entry as svc's again: svc's end takes it out (it would stay there otherwise)
    assert cli("cancel", svc).returncode == 0
    assert "other" not in registry.read_text() and "theirs" in registry.read_text()
    assert helpers.status_of(j1)["state"] == "READY"
    assert cli("cancel", j1).returncode == 0


def test_run_reuse_keeps_the_jobs_own_alias_and_the_readme_pairing(standins: Path, tmp_path: Path) -> None:
    """An alias that already pointed at the reused job (`update-endpoint j1 --alias mine`, the README's
    `update-endpoint qwen` then `run --reuse qwen --registry R`) is the user's: still there, still j1's, after."""
    registry, data = tmp_path / "endpoints.py", tmp_path / "endpoints.yaml"
    registry.write_text(HAND_WRITTEN)
    j1 = _launched("qwen")
    assert cli("update-endpoint", j1, "--registry", str(registry), "--alias", "mine").returncode == 0
    assert cli("update-endpoint", "qwen", "--registry", str(data)).returncode == 0  # alias: the job's name
    py_before, yaml_before = registry.read_bytes(), data.read_bytes()
    for options in (("--registry", str(registry), "--alias", "mine"), ("--registry", str(data))):
        ran = cli("run", "--reuse", "qwen", *options, "--", "true")
        assert ran.returncode == 0, ran.stderr
    assert registry.read_bytes() == py_before and data.read_bytes() == yaml_before
    # still recorded as the job's: its end takes both out, as update-endpoint promised
    assert cli("cancel", j1).returncode == 0
    assert "mine" not in registry.read_text() and "theirs" in registry.read_text()
    assert "qwen" not in data.read_text()


def test_run_that_launches_puts_back_a_hand_written_entry(standins: Path, tmp_path: Path) -> None:
    """A run that launched its own server over the user's own alias (no job wrote it) restores it too, and a
    new alias is still removed."""
    registry = tmp_path / "endpoints.py"
    registry.write_text(HAND_WRITTEN)
    before = registry.read_bytes()
    for alias in ("theirs", "fresh"):
        ran = cli("run", MODEL, *LOCAL, "--name", f"l-{alias}", "--registry", str(registry), "--alias", alias,
                  "--", "true")
        assert ran.returncode == 0, ran.stderr
        assert registry.read_bytes() == before, (alias, ran.stderr)


# -- the end recorded where run ends it ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "pbs"])
def test_pbstk_jobs_shows_the_end_once_run_has_ended(where: str, standins: Path, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    if where == "pbs":
        request.getfixturevalue("fakepbs")
    ran = cli("run", MODEL, *(LOCAL if where == "local" else PBS), "--name", "fin", "--", "true")
    assert ran.returncode == 0, ran.stderr
    # no status call in between: the store already has the end
    assert JobStore().find("fin").final_state == "CANCELLED"
    listed = cli("jobs")
    assert listed.returncode == 0 and "fin" not in listed.stdout, listed.stdout
    everything = cli("jobs", "--all")
    assert "CANCELLED" in everything.stdout and "active" not in everything.stdout, everything.stdout


# -- an interrupt says what happened, once --------------------------------------------------------------------


def _stderr_lines(proc: subprocess.Popen[str]) -> tuple[list[str], threading.Thread]:
    """``proc``'s stderr lines as they come, and the thread that reads them (it ends with the pipe)."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in iter(proc.stderr.readline, ""):
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def test_sigint_during_qsub_is_cancelled_and_said_once(standins: Path, fakepbs: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    helpers.set_faults(fakepbs, slow_qsub=2.0)
    proc = _popen("run", MODEL, *PBS, "--name", "sub", "--", "touch", str(marker))
    with helpers.interrupting(proc, 60) as interrupt:
        helpers.until(lambda: helpers.fake_jobs(fakepbs), timeout=60, what="qsub to create the job")
        err = interrupt()
    assert proc.returncode == 130, err
    job = JobStore().find("sub").job_id
    assert "stop it with" not in err and "left as it is" not in err, err  # it is not left: run cancels it
    assert f"pbstk: interrupted while {job} was submitted" in err and f"pbstk: cancelled {job}" in err, err
    assert not marker.exists()
    helpers.until(lambda: set(helpers.fake_jobs(fakepbs).values()) == {"F"}, timeout=30, what="the job to end")


ROUTER = Path(sys.executable).parent / "vllm-router"


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
def test_ctrl_c_during_a_services_wait_cancels_it_and_says_so_once(standins: Path, isolated_user: Path,
                                                                   tmp_path: Path) -> None:
    helpers.local_service_profile(isolated_user, ROUTER)
    env = _env(PBSTK_SERVICE_POLL_S="0.5", PBSTK_TEST_STANDIN_MODE="hang")
    proc = _popen("run", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "2", "--name", "sw",
                  "--", "true", env=env)
    lines, reader = _stderr_lines(proc)
    try:
        helpers.until(lambda: any(line.startswith("pbstk: launched sw") for line in lines), timeout=90,
                      what="the service to be launched and waited for")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    err = "".join(lines)
    assert proc.returncode == 130, err
    assert "left as it is" not in err and "pbstk cancel sw" not in err, err  # it was not left: it was cancelled
    assert err.count("SIGINT received before COMMAND ran") == 1 and err.count("pbstk: cancelled sw") == 1, err
    status = cli("status", "sw", "--json", env=env)
    assert json.loads(status.stdout)[0]["state"] == "CANCELLED", status.stdout


def test_run_through_a_tunnel_puts_back_the_jobs_own_alias(standins: Path, tmp_path: Path) -> None:
    """With --via-tunnel the entry (the tunnel's URL) is also taken back when the tunnel closes: that must not
    undo the put-back, nor forget that the entry is the reused job's."""
    registry = tmp_path / "endpoints.py"
    registry.write_text(HAND_WRITTEN)
    j1 = _launched("tj")
    assert cli("update-endpoint", j1, "--registry", str(registry), "--alias", "mine").returncode == 0
    before = registry.read_bytes()
    ran = cli("run", "--reuse", j1, "--via-tunnel", "--registry", str(registry), "--alias", "mine", "--", "true")
    assert ran.returncode == 0, ran.stderr
    assert "through a tunnel" in ran.stderr, ran.stderr
    assert registry.read_bytes() == before, ran.stderr
    assert "it now points to" not in ran.stderr, ran.stderr  # no account of a removal that did not happen
    assert cli("cancel", j1).returncode == 0
    assert "mine" not in registry.read_text()  # still the job's: its end took it out


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")
def test_the_readme_service_pairing_keeps_the_services_entry(standins: Path, isolated_user: Path,
                                                             tmp_path: Path) -> None:
    """README: `serve --name qwen`, `update-endpoint qwen --registry R`; docs/campaigns.md: `run --reuse qwen
    --registry R`. The service's entry is there after the run, and the service's cancel still takes it out."""
    helpers.local_service_profile(isolated_user, ROUTER)
    env = _env(PBSTK_SERVICE_POLL_S="0.5", PBSTK_TEST_STANDIN_DELAY="0")
    registry = tmp_path / "endpoints.py"
    served = cli("serve", MODEL, "--profile", "svc", "--preset", "single", "--replicas", "2", "--name", "qwen",
                 "--wait", env=env)
    assert served.returncode == 0, served.stderr
    try:
        assert cli("update-endpoint", "qwen", "--registry", str(registry), env=env).returncode == 0
        before = registry.read_bytes()
        assert b"qwen" in before
        ran = cli("run", "--reuse", "qwen", "--registry", str(registry), "--", "true", env=env)
        assert ran.returncode == 0, ran.stderr
        assert registry.read_bytes() == before, ran.stderr
    finally:
        assert cli("cancel", "qwen", env=env).returncode == 0
    assert "qwen" not in registry.read_text()
