"""Rendered scripts run by real bash with the stand-in ``vllm``/``nvidia-smi`` on PATH.

What is asserted is what reaches vLLM: its argv and environment (the stand-in records both in
``argv.jsonl``), plus the ``server.json`` marker and the realtime log the script writes.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import kill_started_job

from pbs_toolkit.jobs.render import (
    OPTIONAL_PARTS,
    PORT_SPAN,
    START_DIR,
    START_PARTS,
    SWAP_HELPERS,
    RenderRequest,
    render,
    start_body,
)

GPU_B = "GPU-bbbbbbbb-1111-1111-1111-111111111111"
GPU_D = "GPU-dddddddd-3333-3333-3333-333333333333"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_window(count: int) -> int:
    """A port N with N..N+count-1 all free now, below the ephemeral range (for "another free port" tests)."""
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(20_000, 32_000 - count)
        try:
            with ExitStack() as stack:
                for p in range(port, port + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} free ports in a row")


def listen_on(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(8)
    return s


@dataclass
class Job:
    run_dir: Path
    record: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self.run_dir / "vllm.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict[str, Any]:
        path = self.run_dir / "server.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def starts(self) -> list[dict[str, Any]]:
        path = self.record / "argv.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def start(self, **env: str) -> None:
        full = dict(os.environ, PBSTK_TEST_STANDIN_DELAY="0.1")
        full.pop("CUDA_VISIBLE_DEVICES", None)
        full.update(env)
        # job.pbs is what PBS runs; it starts in $HOME and execs start_vllm.sh (same pid)
        self.proc = subprocess.Popen(["bash", str(self.run_dir / "job.pbs")], cwd=str(Path.home()),  # noqa: S603,S607
                                     env=full,
                                     start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_phase(self, *phases: str, timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state.get("phase") in phases:
                return state
            time.sleep(0.05)
        raise AssertionError(f"phase {self.state().get('phase')!r} is not {phases}; log:\n{self.log}")

    def wait_exit(self, timeout: float = 15) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill_all(self) -> None:
        kill_started_job(self.proc, int(self.state().get("pid") or 0))


@pytest.fixture
def make_job(standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Render (library call), write the run directory like ``launch`` does, and kill leftovers at the end."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    jobs: list[Job] = []

    def make(model: str = "Qwen/Qwen3-0.6B", *, api_key: str | None = None, **kw: Any) -> Job:
        run_dir = tmp_path / f"run{len(jobs)}"
        kw.setdefault("profile", "local-gpu")
        kw.setdefault("preset", "single")
        kw.setdefault("port", free_port())
        rendered = render(RenderRequest(model=model, run_dir=str(run_dir), **kw))
        run_dir.mkdir()
        for name, text in (("job.pbs", rendered.job_script), ("start_vllm.sh", rendered.start_script)):
            (run_dir / name).write_text(text)
            (run_dir / name).chmod(0o755)
        if api_key is not None:
            fd = os.open(run_dir / "api_key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(api_key)
        job = Job(run_dir, standins)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill_all()


def _http_status(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:  # noqa: S310
        return int(resp.status)


# --- GPUs ------------------------------------------------------------------------------------------------


def test_gpu_uuids_mapped_to_indices(make_job: Any) -> None:
    job = make_job(preset="dp2", gpus_per_node=2)
    job.start(CUDA_VISIBLE_DEVICES=f"{GPU_B},{GPU_D}")
    job.wait_phase("ready")
    (start,) = job.starts()
    assert start["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert start["argv"][1:3] == ["serve", "Qwen/Qwen3-0.6B"]
    assert "--data-parallel-size" in start["argv"]
    assert f"mapped CUDA_VISIBLE_DEVICES={GPU_B},{GPU_D} to 1,3" in job.log


def test_gpu_indices_pass_through(make_job: Any) -> None:
    job = make_job()
    job.start(CUDA_VISIBLE_DEVICES="2")
    job.wait_phase("ready")
    assert job.starts()[0]["env"]["CUDA_VISIBLE_DEVICES"] == "2"


def test_unknown_gpu_uuid_fails_clearly(make_job: Any) -> None:
    job = make_job(preset="dp2", gpus_per_node=2)
    job.start(CUDA_VISIBLE_DEVICES=f"{GPU_B},GPU-eeeeeeee-9999")
    assert job.wait_exit() != 0
    assert job.state()["phase"] == "failed"
    assert "error: GPU GPU-eeeeeeee-9999 from CUDA_VISIBLE_DEVICES is not listed by nvidia-smi" in job.log
    assert job.starts() == []


# --- port ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port_option", ["auto", None])
def test_busy_port_moves_to_another_free_one(make_job: Any, monkeypatch: pytest.MonkeyPatch, port_option: Any) -> None:
    port = free_port_window(2)
    monkeypatch.setenv("PBSTK_PORT", str(port))  # the requested port; --port auto / default may move from it
    job = make_job(port=port_option)
    with listen_on(port), listen_on(port + 1):
        job.start()
        state = job.wait_phase("ready")
    assert port + 2 <= state["port"] < port + PORT_SPAN  # somewhere in the window, never a busy port
    argv = job.starts()[0]["argv"]
    assert argv[argv.index("--port") + 1] == str(state["port"])
    assert _http_status(state["port"], "/health") == 200


def test_auto_port_fails_cleanly_when_the_whole_window_is_taken(make_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every port of the window busy: one clear line, and server.json stays valid JSON (the failed $(...) used to
    leave PORT empty). Near 65535 the window is cut at the last port."""
    base = 65535 - 20
    monkeypatch.setenv("PBSTK_PORT", str(base))
    job = make_job(port="auto")
    try:
        with ExitStack() as stack:
            for port in range(base, 65536):
                stack.enter_context(listen_on(port))
            job.start()
            assert job.wait_exit() != 0
    except OSError as exc:  # something else holds one of these ports right now
        pytest.skip(f"ports {base}..65535 are not all free: {exc}")
    state = job.state()
    assert state["phase"] == "failed" and state["port"] == 0
    assert f"error: no free port in {base}..65535 on" in job.log
    assert job.starts() == []


def _answers_with_key(port: int, key: str) -> bool:
    """The server on ``port`` is the one holding ``key`` (a foreign one says 401)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:  # noqa: S310 - loopback
            return int(resp.status) == 200
    except OSError:
        return False


def test_twenty_servers_on_one_node_with_port_auto_all_come_up(
    make_job: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """20 start scripts at once with --port auto on one host (issue 11: 6 of 20 failed after 5 port attempts, since
    all began at the requested port and moved up one by one). Each must end up serving on its own port, proven with
    its own key; a script that gives up fails the test at once."""
    base = free_port_window(PORT_SPAN)
    monkeypatch.setenv("PBSTK_PORT", str(base))
    venv = _fake_venv(tmp_path)
    jobs = [make_job(profile="local", preset="cpu", venv=str(venv), port="auto", api_key=f"key-{i}")
            for i in range(20)]
    for job in jobs:
        job.start()

    def all_ours() -> list[int] | None:
        states = [job.state() for job in jobs]
        for job, state in zip(jobs, states):
            assert state.get("phase") != "failed" and job.proc is not None and job.proc.poll() is None, job.log
        if not all(state.get("phase") == "ready" for state in states):
            return None
        ports = [int(state["port"]) for state in states]
        return ports if all(_answers_with_key(p, f"key-{i}") for i, p in enumerate(ports)) else None

    deadline = time.monotonic() + 60
    ports = all_ours()
    while ports is None and time.monotonic() < deadline:
        time.sleep(0.2)
        ports = all_ours()
    assert ports is not None, "not all 20 servers came up:\n" + "\n".join(job.log[-300:] for job in jobs)
    assert len(set(ports)) == 20 and all(base <= p < base + PORT_SPAN for p in ports)


def test_fixed_busy_port_fails(make_job: Any) -> None:
    port = free_port()
    job = make_job(port=port)
    with listen_on(port):
        job.start()
        assert job.wait_exit() != 0
    assert job.state()["phase"] == "failed"
    assert f"error: port {port} is already in use" in job.log and "--port auto" in job.log
    assert job.starts() == []


# --- API key ---------------------------------------------------------------------------------------------


def _models_status(port: int, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_api_key_in_config_file_not_env_argv_nor_log(make_job: Any) -> None:
    """vLLM <= 0.22 hashes every VLLM_* variable into its compile cache key and writes the values into the cache's
    cache_key_factors.json: the key reaches vLLM through a 0600 `--config` YAML file, never VLLM_API_KEY."""
    key = "k3y-" + os.urandom(8).hex()
    job = make_job(api_key=key)
    assert stat.S_IMODE((job.run_dir / "api_key").stat().st_mode) == 0o600
    job.start(VLLM_API_KEY="from-the-site-env")  # a site's own VLLM_API_KEY is not passed on either
    state = job.wait_phase("ready")
    (start,) = job.starts()
    assert "VLLM_API_KEY" not in start["env"]
    assert not any(key in arg for arg in start["argv"])
    assert "--api-key" not in start["argv"]
    config = job.run_dir / "vllm_api_key.yaml"
    assert start["argv"][start["argv"].index("--config") + 1] == str(config)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert yaml.safe_load(config.read_text()) == {"api-key": key}
    # vLLM <= 0.22 prints the key in its "non-default args" line: the log is as private as the key file
    assert stat.S_IMODE((job.run_dir / "vllm.log").stat().st_mode) == 0o600
    assert key not in job.log and key not in (job.run_dir / "server.json").read_text()
    assert _models_status(state["port"], None) == 401
    assert _models_status(state["port"], "wrong") == 401
    assert _models_status(state["port"], key) == 200


def test_api_key_in_env_for_vllm_without_config(make_job: Any) -> None:
    """vLLM before 0.6 has no --config: the key goes in the environment there, as before."""
    key = "k3y-" + os.urandom(8).hex()
    job = make_job(api_key=key, vllm_version="0.5.4")
    job.start()
    state = job.wait_phase("ready")
    (start,) = job.starts()
    assert start["env"]["VLLM_API_KEY"] == key
    assert "--config" not in start["argv"] and not (job.run_dir / "vllm_api_key.yaml").exists()
    assert _models_status(state["port"], key) == 200


def test_api_key_with_odd_characters_fails_before_vllm(make_job: Any) -> None:
    job = make_job(api_key="it's\nnot: safe")
    job.start()
    assert job.wait_phase("failed")["phase"] == "failed"
    assert job.starts() == [] and not (job.run_dir / "vllm_api_key.yaml").exists()
    assert "holds characters other than" in job.log


def test_no_api_key_file_no_key(make_job: Any) -> None:
    job = make_job()
    job.start()
    job.wait_phase("ready")
    assert "VLLM_API_KEY" not in job.starts()[0]["env"]
    assert "--config" not in job.starts()[0]["argv"] and not (job.run_dir / "vllm_api_key.yaml").exists()


# --- eager fallback and fatal errors ---------------------------------------------------------------------


def test_compile_failure_restarts_once_eager(make_job: Any) -> None:
    job = make_job()
    job.start(PBSTK_TEST_STANDIN_MODE="compile-fail-once")
    state = job.wait_phase("ready")
    first, second = job.starts()
    assert "--enforce-eager" not in first["argv"]
    assert second["argv"][-1] == "--enforce-eager"
    assert first["argv"] == second["argv"][:-1]
    assert state["eager_fallback"] is True and state["attempt"] == 2
    assert _http_status(state["port"], "/health") == 200
    assert "restarting once with --enforce-eager" in job.log


def test_fatal_error_no_eager_restart(make_job: Any) -> None:
    job = make_job()
    job.start(PBSTK_TEST_STANDIN_MODE="fatal")
    rc = job.wait_exit()
    assert rc != 0
    state = job.state()
    assert state["phase"] == "failed" and state["exit_code"] == rc and state["eager_fallback"] is False
    assert len(job.starts()) == 1
    assert "CUDA out of memory" in job.log and "before it was ready" in job.log


def test_eager_preset_passes_enforce_eager(make_job: Any) -> None:
    job = make_job(preset="single-eager")
    job.start()
    job.wait_phase("ready")
    assert job.starts()[0]["argv"][-1] == "--enforce-eager"


# --- environment -----------------------------------------------------------------------------------------


def _fake_venv(root: Path) -> Path:
    """A venv whose activate exports a marker and whose ``python`` is the stand-in vLLM."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "site" / "vllm").mkdir(parents=True)
    (venv / "site" / "vllm" / "__init__.py").write_text("")  # what the start script's install check finds
    (venv / "bin" / "activate").write_text(
        f'export PBSTK_TEST_VENV_MARKER=activated\nexport PATH="{venv}/bin:$PATH"\n'
        f'export PYTHONPATH="{venv}/site"\n'
    )
    python = venv / "bin" / "python"
    # `python -c ...` (the install check) is a real Python; `python -m vllm...` is the stand-in server
    python.write_text(
        '#!/bin/sh\n[ "$1" = -c ] && exec python3 "$@"\n'
        f'exec python3 {Path(__file__).parent / "standins" / "vllm"} "$@"\n'
    )
    python.chmod(0o755)
    return venv


def test_site_environment_reaches_vllm(make_job: Any, tmp_path: Path) -> None:
    from pbs_toolkit import paths

    venv = _fake_venv(tmp_path)
    profiles = paths.user_config_dir() / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "testsite.yaml").write_text(
        "scheduler: local\ngpus_per_node: 1\naddress: loopback\nbind_host: 127.0.0.1\n"
        f"venv: {venv}\nhf_home: {tmp_path}/hf home\nhf_hub_offline: true\n"
        f"vllm_cache_root: {tmp_path}/vllm-cache\nvllm_entrypoint: api_server\n"
        "env:\n  MY_SITE_VAR: site value\n"
    )
    job = make_job(profile="testsite", env={"EXTRA_VAR": "from --env"})
    job.start()
    job.wait_phase("ready")
    (start,) = job.starts()
    env = start["env"]
    assert env["PBSTK_TEST_VENV_MARKER"] == "activated"
    assert env["HF_HOME"] == f"{tmp_path}/hf home"
    assert env["HF_HUB_OFFLINE"] == "1"
    # the profile's root, keyed by what invalidates a compile cache (docs/coldstart.md)
    keyed = Path(env["VLLM_CACHE_ROOT"])
    assert keyed.parent.parent.parent == tmp_path / "vllm-cache" and keyed.is_dir() and keyed.name == "DP1"
    assert env["MY_SITE_VAR"] == "site value" and env["EXTRA_VAR"] == "from --env"
    assert env["PBSTK_TEST_STANDIN_DELAY"] == "0.1"  # the caller's environment is kept (no -V needed)
    assert start["argv"][1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-0.6B"]


def test_missing_venv_fails_clearly(make_job: Any, tmp_path: Path) -> None:
    job = make_job(venv=str(tmp_path / "no-such-venv"))
    job.start()
    assert job.wait_exit() != 0
    assert job.state()["phase"] == "failed"
    assert "cannot activate the Python environment" in job.log
    assert job.starts() == []


# --- hostile values --------------------------------------------------------------------------------------


def test_hostile_values_arrive_as_single_arguments(make_job: Any, tmp_path: Path) -> None:
    trap = tmp_path / "trap"
    trap.mkdir()
    evil = f"x; touch {trap}/pwned $(touch {trap}/pwned2) `touch {trap}/pwned3` \"quotes\" 'single' & |"
    model = tmp_path / "models" / evil
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    hostile_arg = f"$(touch {trap}/pwned4); touch {trap}/pwned5 'q' \"dq\" \\"
    hostile_env = f"it's $(touch {trap}/pwned6) `touch {trap}/pwned7` ${{HOME}}"
    served = f"served $(touch {trap}/pwned8)"
    job = make_job(str(model), name="safe-name", served_model_name=served,
                   vllm_args=["--chat-template", hostile_arg], env={"HOSTILE": hostile_env})
    job.start()
    job.wait_phase("ready")
    (start,) = job.starts()
    argv = start["argv"]
    assert argv[1] == "serve" and argv[2] == str(model.resolve())
    assert argv[argv.index("--chat-template") + 1] == hostile_arg
    assert argv[argv.index("--served-model-name") + 1] == served
    assert start["env"]["HOSTILE"] == hostile_env
    assert sorted(p.name for p in trap.iterdir()) == []
    assert not list(job.run_dir.glob("pwned*"))


# --- cancellation ----------------------------------------------------------------------------------------


def test_sigterm_cancels_and_stops_vllm(make_job: Any) -> None:
    job = make_job()
    job.start()
    state = job.wait_phase("ready")
    server_pid = int(state["pid"])
    os.kill(server_pid, 0)  # the stand-in runs
    assert job.proc is not None
    job.proc.send_signal(signal.SIGTERM)  # what PBS sends the job script on qdel / walltime
    assert job.wait_exit() == 143
    state = job.state()
    assert state["phase"] == "cancelled" and state["exit_code"] == 143
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"vLLM stand-in {server_pid} still runs after SIGTERM to the job script")
    assert "received a stop signal" in job.log


def test_a_stop_during_the_site_setup_says_so_and_marks_the_job_cancelled(make_job: Any, tmp_path: Path) -> None:
    """A cancel before vLLM starts (here a slow venv activation; on a cluster the compile wait or a module load)
    used to kill the script with no word in the log and the marker left at "setup" (CI saw `pbstk logs -f` end
    with nothing after a cancel)."""
    venv = tmp_path / "slow-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("echo activating the slow venv\nsleep 30\n")
    job = make_job(venv=str(venv))
    job.start()
    deadline = time.monotonic() + 15
    while "activating the slow venv" not in job.log:
        assert time.monotonic() < deadline, job.log
        time.sleep(0.05)
    assert job.proc is not None
    os.killpg(job.proc.pid, signal.SIGTERM)  # PBS, Slurm and the local scheduler signal the whole session
    assert job.wait_exit() == 143
    state = job.state()
    assert state["phase"] == "cancelled" and state["exit_code"] == 143
    assert "received a stop signal before vLLM started" in job.log
    assert not job.starts()  # vLLM never started


# --- the static body and the marker ----------------------------------------------------------------------

#: the static body: server/start/'s parts, concatenated in START_PARTS order, as every start script ends
BODY_TEXT = start_body()


@pytest.fixture
def body_file(tmp_path: Path) -> Path:
    """The static body alone, in one file, for shellcheck."""
    path = tmp_path / "body.sh"
    path.write_text(BODY_TEXT, encoding="utf-8")
    return path


def test_rendered_script_is_header_then_static_body(make_job: Any) -> None:
    """Each launch writes its own start_vllm.sh; everything after the settings header is the static body."""
    job = make_job()
    text = (job.run_dir / "start_vllm.sh").read_text()
    body = BODY_TEXT
    assert text.startswith("#!/bin/bash\n") and text.endswith(body)
    assert "{%" not in body and "{{" not in body


def test_static_body_is_its_parts_in_order() -> None:
    """The body is split by concern into server/start/: every file there is a listed part (a new one not added to
    START_PARTS would silently be left out of every start script), each begins with a comment line saying what it
    holds, and each ends its last line, so the concatenation never glues two lines together."""
    shipped = sorted(p.name for p in START_DIR.iterdir() if p.name != "__pycache__")  # Python's, where it compiled
    assert shipped == sorted(START_PARTS + OPTIONAL_PARTS + SWAP_HELPERS)
    assert len(set(START_PARTS)) == len(START_PARTS)
    for name in START_PARTS + OPTIONAL_PARTS:
        text = (START_DIR / name).read_text(encoding="utf-8")
        assert text.startswith("# ") and text.endswith("\n"), name
    assert BODY_TEXT.startswith("# shellcheck shell=bash\n") and BODY_TEXT.rstrip().endswith('exit "$RC"')


def test_static_body_is_shellcheck_clean(body_file: Path) -> None:
    """The body alone, as it is in the package: no rendering stands between shellcheck and what runs."""
    proc = subprocess.run(["shellcheck", "-f", "gcc", str(body_file)], capture_output=True, text=True,  # noqa: S603,S607
                          check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_static_body_writes_only_enum_phases() -> None:
    """Every ``pbstk_state`` call names a ``$PHASE_<NAME>`` of :class:`Phase`, and every phase is written."""
    from pbs_toolkit.server.phases import Phase

    calls = re.findall(r"pbstk_state (\S+)", BODY_TEXT)
    assert calls
    names = set()
    for arg in calls:
        match = re.fullmatch(r'"\$PHASE_([A-Z]+)"', arg)
        assert match, f"pbstk_state {arg}: not a phase variable"
        names.add(match.group(1))
    assert names == {phase.name for phase in Phase}


def test_static_body_alone_catches_a_misspelt_setting(tmp_path: Path) -> None:
    """The body declares the header's settings instead of disabling SC2154 for the whole file, so shellcheck of
    the body alone flags a name nothing assigns (``$PHASE_SETUPP`` was accepted while the disable was global)."""
    body = BODY_TEXT
    assert "disable=SC2154" not in body
    assert 'pbstk_state "$PHASE_SETUP"\n' in body
    bad = tmp_path / "start_vllm.sh"
    bad.write_text(body.replace('pbstk_state "$PHASE_SETUP"\n', 'pbstk_state "$PHASE_SETUPP"\n', 1))
    proc = subprocess.run(["shellcheck", "-f", "gcc", str(bad)], capture_output=True, text=True,  # noqa: S603,S607
                          check=False, timeout=60)
    assert proc.returncode != 0 and "PHASE_SETUPP" in proc.stdout, proc.stdout + proc.stderr


def test_static_body_declares_exactly_the_header_settings() -> None:
    """The body's ``declare`` list is what the header assigns: a setting added to the header without its
    declaration (or a declaration left after a setting went) fails here, not in a job."""
    from pbs_toolkit.jobs.plan import start_script_settings

    declared: set[str] = set()
    optional = "".join((START_DIR / name).read_text(encoding="utf-8") for name in OPTIONAL_PARTS)
    for line in (BODY_TEXT + optional).splitlines():  # the multi-model settings are declared in models.sh
        if line.startswith("declare "):
            declared.update(word for word in line.split()[1:] if not word.startswith("-"))
    assert declared == set(start_script_settings())


#: values a marker must survive: quotes, backslashes, every control character, UTF-8, bytes that are not UTF-8
HOSTILE = ['plain', 'q"uote', 'back\\slash\\', '\\"', 'new\nline\r\ttab', "".join(chr(i) for i in range(1, 32)),
           "ünïcødé €", "$(id) `id` 'single' &&& \\&", "", '{"a": 1}, "b": [', "1234.pbs[5].server_x-y@z:1/2+3"]


def _marker_functions() -> str:
    body = BODY_TEXT
    keys = body[body.index("PBSTK_NUMBER_KEYS="):]
    keys = keys[: keys.index("\nMARKER_EXTRA=") + 1]
    out = [keys]
    for name in ("pbstk_safe", "pbstk_marker", "pbstk_marker_get"):
        function = body[body.index(f"\n{name}() {{") + 1:]
        out.append(function[: function.index("\n}\n") + 3])
    return "".join(out)


@pytest.mark.parametrize("value", HOSTILE)
def test_marker_writer_needs_no_escaping(value: str, tmp_path: Path) -> None:
    """``pbstk_marker`` writes a hostile string as printable text without ``"`` or ``\\`` (nothing to escape):
    Python's json reads the marker, bash's ``pbstk_marker_get`` reads the same value back, and a plain value
    (a job id, a host name) comes back unchanged."""
    marker = tmp_path / "m.json"
    script = _marker_functions() + (
        'pbstk_marker "$1" "host=$2" port=8000 pid=x exit_code= eager=true "reason=$2"\n'
        'pbstk_marker_get v "$1" host; printf "%s\\n" "$v"\n'
        'pbstk_marker_get v "$1" port; printf "%s\\n" "$v"\n'
        'pbstk_marker_get v "$1" pid; printf "[%s]\\n" "$v"\n'
    )
    for locale in ("C", "C.UTF-8"):
        env = dict(os.environ, LC_ALL=locale)
        out = subprocess.run(["bash", "-c", script, "bash", str(marker), value],  # noqa: S603,S607
                             capture_output=True, env=env, check=True, timeout=10).stdout.decode()
        raw = marker.read_bytes()
        data = json.loads(raw)
        written = data["host"]
        assert b"\\" not in raw and raw.count(b'"') == 2 * 6 + 2 * 2  # keys and two strings: nothing escaped
        assert "\n" not in written and '"' not in written and "\\" not in written
        assert all(ch.isprintable() for ch in written), written
        if re.fullmatch(r"[\w.@:/+\[\]-]*", value, re.ASCII):
            assert written == value
        assert data == {"host": written, "port": 8000, "pid": None, "exit_code": None, "eager": True,
                        "reason": written}
        assert out.splitlines() == [written, "8000", "[]"]


def test_python_reads_markers_of_the_old_escaping_writer() -> None:
    """Run directories of jobs started by an older pbstk hold markers with JSON escapes (the old
    ``pbstk_json_str``): status still reads them."""
    from pbs_toolkit.jobs.nodes import parse_node
    from pbs_toolkit.jobs.rundir import parse_marker

    old = (b'{"phase": "failed", "job_id": "evil\\"1\\\\2\\n3\\u0001.pbs", "host": "n\\u00fc", "address": "10.0.0.1", '
           b'"port": 8000, "pid": 42, "attempt": 1, "eager_fallback": false, "nnodes": 2, '
           b'"reason": "node 1 (host x) failed: a\\nb", "exit_code": 1, "updated": 1700000000}\n')
    marker, problem = parse_marker(old)
    assert problem is None and marker is not None
    assert marker["job_id"] == 'evil"1\\2\n3\x01.pbs' and marker["host"] == "nü" and marker["port"] == 8000
    assert marker["reason"] == "node 1 (host x) failed: a\nb" and marker["exit_code"] == 1
    node = parse_node(b'{"rank": 1, "nnodes": 2, "host": "h\\"x", "address": "a", "phase": "failed", "pid": 7, '
                      b'"exit_code": 3, "attempt": 2, "reason": "r\\n", "updated": 1700000001}\n', 1)
    assert node is not None and node.host == 'h"x' and node.exit_code == 3 and node.attempt == 2


def test_marker_is_valid_json_for_hostile_job_id(make_job: Any) -> None:
    """A job id with a newline and control characters used to end up raw in server.json (unreadable marker);
    now it arrives cut down to printable text, and a real job id (``1234.pbs[5].server``) unchanged."""
    job = make_job()
    job.start(PBS_JOBID='evil"1\\2\n3\t4\x015.pbs')
    state = job.wait_phase("ready")
    assert state["job_id"] == "evil'1/2 3 4 5.pbs"


def test_setup_lines_run_at_top_level(make_job: Any) -> None:
    """Profile setup lines run as if written inline: a block may span lines, ``declare`` stays global."""
    from pbs_toolkit import paths

    profiles = paths.user_config_dir() / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "setupsite.yaml").write_text(
        "scheduler: local\ngpus_per_node: 1\naddress: loopback\nbind_host: 127.0.0.1\nsetup:\n"
        "  - 'declare -x SETUP_DECLARED=\"a b\"'\n  - 'if true; then'\n  - '  export SETUP_BLOCK=1'\n  - 'fi'\n"
    )
    job = make_job(profile="setupsite")
    job.start()
    job.wait_phase("ready")
    (start,) = job.starts()
    assert start["env"]["SETUP_DECLARED"] == "a b" and start["env"]["SETUP_BLOCK"] == "1"


# --- AMX CPUs: the tile permission asked in every Python process (issue 29's SIGILL) -------------------------------

def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return path


def _has_amx() -> bool:
    return "amx_tile" in Path("/proc/cpuinfo").read_text().split()


def test_amx_cpu_every_python_process_asks_for_the_tile_permission(make_job: Any, tmp_path: Path) -> None:
    job = make_job()
    job.start(PBSTK_CPUINFO=str(_cpuinfo(tmp_path, "avx512f amx_bf16 amx_tile amx_int8")))
    job.wait_phase("ready")
    (start,) = job.starts()
    env = start["env"]
    prelude = job.run_dir / "python-amx"
    assert env["PYTHONPATH"].split(":")[0] == str(prelude)
    # the stand-in is a Python process: the prelude ran in it, and asked (granted only where the CPU has AMX)
    assert env["PBSTK_AMX"] == ("granted" if _has_amx() else "refused")
    assert "asks for the AMX tile permission" in job.log


def test_no_amx_no_prelude(make_job: Any, tmp_path: Path) -> None:
    job = make_job()
    job.start(PBSTK_CPUINFO=str(_cpuinfo(tmp_path, "avx512f avx512_bf16")))
    job.wait_phase("ready")
    (start,) = job.starts()
    assert "PBSTK_AMX" not in start["env"]
    assert "python-amx" not in start["env"].get("PYTHONPATH", "")
    assert not (job.run_dir / "python-amx").exists()


def test_amx_prelude_runs_the_environments_own_sitecustomize(make_job: Any, tmp_path: Path) -> None:
    job = make_job()
    job.start(PBSTK_CPUINFO=str(_cpuinfo(tmp_path, "amx_tile")))
    job.wait_phase("ready")
    own = tmp_path / "own-site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    env = dict(os.environ, PYTHONPATH=f"{job.run_dir / 'python-amx'}:{own}")
    out = subprocess.run(["python3", "-c", "import os; print(os.environ.get('PBSTK_AMX'), "  # noqa: S603,S607
                          "os.environ.get('OWN_SITECUSTOMIZE'))"], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["granted" if _has_amx() else "refused", "ran"]
