"""Cold start (docs/coldstart.md): containers, the keyed compile cache, node-local JIT caches and the wait for
another engine's compile, run by real bash with the stand-ins (`vllm`, `apptainer`) on PATH.

The torch and vLLM versions the start script reads come from real package metadata: a ``*.dist-info`` directory
on PYTHONPATH is what ``importlib.metadata`` finds for an installed package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import kill_started_job, until

from pbs_toolkit.jobs.render import render
from pbs_toolkit.settings.launch_settings import RenderRequest

MODEL = "Qwen/Qwen3-0.6B"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_packages(root: Path, torch: str, vllm: str = "0.11.0") -> Path:
    """A site directory whose metadata says torch ``torch`` and vLLM ``vllm`` are installed."""
    for name, version in (("torch", torch), ("vllm", vllm)):
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


class Job:
    def __init__(self, run_dir: Path, record: Path) -> None:
        self.run_dir, self.record = run_dir, record
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self.run_dir / "vllm.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict[str, Any]:
        path = self.run_dir / "server.json"
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}

    def records(self, name: str) -> list[dict[str, Any]]:
        path = self.record / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def start(self, **env: str) -> None:
        self.record.mkdir(exist_ok=True)
        # each job a node of its own (its own stand-in GPUs): jobs that share a compile cache, not a GPU
        full = dict(os.environ, PBSTK_TEST_STANDIN_DELAY="0.1", PBSTK_TEST_RECORD=str(self.record),
                    PBSTK_TEST_GPU_NODE=self.run_dir.name)
        full.pop("CUDA_VISIBLE_DEVICES", None)
        full.update(env)
        self.proc = subprocess.Popen(["bash", str(self.run_dir / "job.sh")], cwd=str(self.run_dir),  # noqa: S603,S607
                                     env=full, start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_phase(self, *phases: str, timeout: float = 20) -> dict[str, Any]:
        return dict(until(lambda: self.state() if self.state().get("phase") in phases else None, timeout,
                          f"phase in {phases}; log:\n{self.log}"))

    def kill(self) -> None:
        kill_started_job(self.proc, int(self.state().get("pid") or 0))


@pytest.fixture
def make_job(standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    jobs: list[Job] = []

    def make(profile: dict[str, Any] | None = None, **kw: Any) -> Job:
        run_dir = tmp_path / f"run{len(jobs)}"
        data = {"name": "cs", "scheduler": "local", "gpus_per_node": 1, "address": "loopback",
                "bind_host": "127.0.0.1", **(profile or {})}
        prof = tmp_path / f"profile{len(jobs)}.yaml"
        prof.write_text(json.dumps(data))  # JSON is YAML
        kw.setdefault("preset", "single")
        rendered = render(RenderRequest(model=MODEL, run_dir=str(run_dir), profile=str(prof), port=free_port(), **kw))
        run_dir.mkdir()
        for name, text in (("job.sh", rendered.job_script), ("start_vllm.sh", rendered.start_script)):
            (run_dir / name).write_text(text)
            (run_dir / name).chmod(0o755)
        job = Job(run_dir, tmp_path / f"record{len(jobs)}")
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


# --- containers ----------------------------------------------------------------------------------------------


def test_container_profile_renders_shellcheck_clean_scripts(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    prof = tmp_path / "site.yaml"
    prof.write_text(json.dumps({
        "name": "site", "scheduler": "pbs", "queue": "debug", "gpus_per_node": 4, "hf_home": str(tmp_path / "hf home"),
        "vllm_cache_root": str(tmp_path / "cache"), "container": str(tmp_path / "img's" / "vllm.sif"),
        "container_runtime": "singularity"}))
    files = []
    for preset, nodes in (("dp2", 1), ("dp8", 2)):
        rendered = render(RenderRequest(model=MODEL, profile=str(prof), preset=preset, nodes=nodes, account="P",
                                        run_dir=str(tmp_path / f"run-{preset}")))
        assert rendered.container_command is not None
        assert rendered.container_command[:3] == ["singularity", "exec", "--nv"]
        assert rendered.container_command[rendered.container_command.index("serve") - 2] == str(
            tmp_path / "img's" / "vllm.sif")
        assert any(note.startswith("vLLM starts in a container: singularity exec --nv") for note in rendered.notes)
        assert "container_command" in rendered.to_dict()
        for name, text in (("job.pbs", rendered.job_script), ("start_vllm.sh", rendered.start_script)):
            path = tmp_path / f"{preset}-{name}"
            path.write_text(text)
            files.append(str(path))
    for path in files:
        subprocess.run(["bash", "-n", path], check=True)  # noqa: S603,S607
    check = subprocess.run(["shellcheck", *files], capture_output=True, text=True)  # noqa: S603,S607
    assert check.returncode == 0, check.stdout


def test_vllm_starts_inside_the_container_with_the_directories_bound(make_job: Any, tmp_path: Path) -> None:
    image = tmp_path / "images" / "vllm 0.22.sif"
    image.parent.mkdir()
    image.write_bytes(b"SIF")
    hf, cache = tmp_path / "hf home", tmp_path / "vllm cache"
    job = make_job({"container": str(image), "hf_home": str(hf), "vllm_cache_root": str(cache)})
    (job.run_dir / "api_key").write_text("sekrit")
    job.start()
    job.wait_phase("ready")
    # two commands run in the image: the version query for the cache key, then vLLM
    query, call = job.records("container.jsonl")
    assert query["argv"][query["argv"].index(str(image)) + 1:][:2] == ["python", "-c"]
    argv = call["argv"]
    assert call["runtime"] == "apptainer" and argv[:2] == ["exec", "--nv"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    # the JIT directory (PBSTK_JIT_DIR, under the test's /tmp) is not bound: the runtime binds /tmp itself
    assert binds == [str(job.run_dir), str(hf), str(cache)]
    rest = argv[argv.index(str(image)) + 1:]
    assert rest[:3] == ["vllm", "serve", MODEL] and "--port" in rest
    assert "sekrit" not in json.dumps(argv)  # never in argv: in a 0600 file under RUN_DIR, which is bound
    assert rest[rest.index("--config") + 1] == str(job.run_dir / "vllm_api_key.yaml")
    (start,) = job.records("argv.jsonl")  # the stand-in vllm ran inside; no VLLM_API_KEY (the compile cache key)
    assert "VLLM_API_KEY" not in start["env"]
    assert "vLLM runs in a container: apptainer exec --nv" in job.log


def test_missing_runtime_or_image_fails_before_vllm(make_job: Any, tmp_path: Path) -> None:
    job = make_job({"container": str(tmp_path / "nowhere.sif")})
    job.start()
    job.wait_phase("failed")
    assert f"error: container image {tmp_path / 'nowhere.sif'} not found" in job.log
    assert job.records("container.jsonl") == [] and job.records("argv.jsonl") == []
    image = tmp_path / "ok.sif"
    image.write_bytes(b"SIF")
    job = make_job({"container": str(image)})
    job.start(PATH=f"{tmp_path / 'empty-bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    job.wait_phase("failed")
    assert "error: apptainer is not on PATH" in job.log


def test_container_runtime_is_checked(tmp_path: Path) -> None:
    from pbs_toolkit.errors import ConfigError

    prof = tmp_path / "bad.yaml"
    prof.write_text(json.dumps({"name": "bad", "scheduler": "local", "container": "x.sif",
                                "container_runtime": "docker"}))
    with pytest.raises(ConfigError, match="container_runtime' must be one of apptainer, singularity"):
        render(RenderRequest(model=MODEL, profile=str(prof), run_dir=str(tmp_path / "r")))


# --- compile cache ------------------------------------------------------------------------------------------


def test_compile_cache_is_keyed_and_jit_caches_stay_node_local(make_job: Any, tmp_path: Path) -> None:
    site = fake_packages(tmp_path / "site", torch="2.11.0+cu130", vllm="0.22.1")
    cache = tmp_path / "cache"
    job = make_job({"vllm_cache_root": str(cache)}, preset="dp2", gpus_per_node=2)
    job.start(PYTHONPATH=str(site), PBSTK_JIT_DIR=str(tmp_path / "jit"))
    job.wait_phase("ready")
    env = job.records("argv.jsonl")[0]["env"]
    root = Path(env["VLLM_CACHE_ROOT"])
    assert root.parent.parent == cache / "torch-2.11.0-cu130_vllm-0.22.1" and root.name == "DP2"
    assert root.parent.name.startswith("qwen3-0.6b-") and root.is_dir()
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "jit" / "triton")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "jit" / "flashinfer")
    assert (tmp_path / "jit").stat().st_mode & 0o777 == 0o700
    # torch >= 2.10 shares the cache safely: no lock, no marker
    assert not (root / ".pbstk-compiling").exists() and not (root / ".pbstk-compiled").exists()


def test_every_key_shares_one_modelinfos_so_a_new_layout_skips_the_registry_subprocess(make_job: Any,
                                                                                        tmp_path: Path) -> None:
    """vLLM keeps what its registry learnt of a model class in VLLM_CACHE_ROOT/modelinfos (else a fresh Python process
    imports torch and vLLM to learn it: 27-35 s on a lent H100 host). Keys per layout must not each start empty."""
    site = fake_packages(tmp_path / "site", torch="2.11.0", vllm="0.22.1")
    cache = tmp_path / "cache"
    roots = []
    for preset, gpus in (("single", 1), ("dp2", 2)):
        job = make_job({"vllm_cache_root": str(cache)}, preset=preset, gpus_per_node=gpus)
        job.start(PYTHONPATH=str(site), PBSTK_JIT_DIR=str(tmp_path / "jit"))
        job.wait_phase("ready")
        roots.append(Path(job.records("argv.jsonl")[0]["env"]["VLLM_CACHE_ROOT"]))
        job.kill()
    assert roots[0] != roots[1] and {r.name for r in roots} == {"DP1", "DP2"}
    shared = cache / "modelinfos"
    for root in roots:
        assert (root / "modelinfos").resolve() == shared.resolve()
    # what one key's engine wrote (vLLM writes it atomically, keyed by the module's hash), the other key reads
    (roots[0] / "modelinfos" / "qwen3.json").write_text("{}")
    assert (roots[1] / "modelinfos" / "qwen3.json").read_text() == "{}"
    # a key that already has its own modelinfos (written before this change) keeps it
    own = cache / "torch-2.11.0_vllm-0.22.1" / roots[0].parent.name / "TP2"
    (own / "modelinfos").mkdir(parents=True)
    job = make_job({"vllm_cache_root": str(cache)}, preset="tp2", gpus_per_node=2)
    job.start(PYTHONPATH=str(site), PBSTK_JIT_DIR=str(tmp_path / "jit"))
    job.wait_phase("ready")
    assert Path(job.records("argv.jsonl")[0]["env"]["VLLM_CACHE_ROOT"]) == own
    assert not (own / "modelinfos").is_symlink()


def _keyed_root(cache: Path) -> Path:
    return next(cache.glob("torch-*/*/*"))


def test_old_torch_second_engine_waits_for_the_first_compile(make_job: Any, tmp_path: Path) -> None:
    site = fake_packages(tmp_path / "site", torch="2.9.1")
    cache = tmp_path / "cache"
    first, second = (make_job({"vllm_cache_root": str(cache)}) for _ in range(2))
    first.start(PYTHONPATH=str(site), PBSTK_TEST_STANDIN_DELAY="1.5")
    lock = until(lambda: next(cache.glob("torch-*/*/*/.pbstk-compiling"), None), 10, "the first engine's lock")
    second.start(PYTHONPATH=str(site))
    until(lambda: "another engine is compiling" in second.log, 10, f"the second engine waiting:\n{second.log}")
    assert second.records("argv.jsonl") == []  # not started while the first compiles
    first.wait_phase("ready")
    second.wait_phase("ready")
    done = lock.parent / ".pbstk-compiled"
    assert done.exists()
    until(lambda: not lock.exists(), 5, "no lock left (the second engine found the cache filled)")
    assert "first (torch" not in second.log  # it did not take the lock: it found the cache filled
    timeline = (second.run_dir / "startup.log").read_text().splitlines()
    marks = {line.split()[0]: float(line.split()[1]) for line in timeline if not line.startswith("log ")}
    first_api = next(float(line.split()[1]) for line in (first.run_dir / "startup.log").read_text().splitlines()
                     if line.startswith("api "))
    assert marks["compile-wait"] <= first_api <= marks["compile-wait-end"] <= marks["vllm"]
    # a third engine finds the cache filled and does not wait
    third = make_job({"vllm_cache_root": str(cache)})
    third.start(PYTHONPATH=str(site))
    third.wait_phase("ready")
    assert "another engine is compiling" not in third.log and "compile-wait" not in (
        third.run_dir / "startup.log").read_text()


def test_old_torch_wait_is_bounded_and_new_torch_never_waits(make_job: Any, tmp_path: Path) -> None:
    old, new = fake_packages(tmp_path / "old", torch="2.9.1"), fake_packages(tmp_path / "new", torch="2.10.0")
    cache = tmp_path / "cache"
    job = make_job({"vllm_cache_root": str(cache), "env": {"PBSTK_COMPILE_WAIT_S": "1"}})
    script = (job.run_dir / "start_vllm.sh").read_text()
    model, layout = (script.split(f"{name}=")[1].split("\n")[0] for name in ("CACHE_KEY_MODEL", "CACHE_KEY_LAYOUT"))
    for torch in ("2.9.1", "2.10.0"):
        lock = cache / f"torch-{torch}_vllm-0.11.0" / model / layout / ".pbstk-compiling"
        lock.mkdir(parents=True)
        (lock / "owner").write_text(f"{int(time.time())} othernode 99.pbs\n")  # an owner that never finishes
    job.start(PYTHONPATH=str(old))
    job.wait_phase("ready")
    assert "did not finish in 1 s; starting anyway" in job.log
    job2 = make_job({"vllm_cache_root": str(cache), "env": {"PBSTK_COMPILE_WAIT_S": "1"}})
    job2.start(PYTHONPATH=str(new))
    job2.wait_phase("ready")
    assert "another engine is compiling" not in job2.log
    # PBSTK_COMPILE_SERIAL=1 (the profile's env) serialises the compile whatever the torch
    job3 = make_job({"vllm_cache_root": str(cache), "env": {"PBSTK_COMPILE_WAIT_S": "1", "PBSTK_COMPILE_SERIAL": "1"}})
    job3.start(PYTHONPATH=str(new))
    job3.wait_phase("ready")
    assert "did not finish in 1 s; starting anyway" in job3.log


def test_every_node_of_a_multinode_job_starts_in_the_image(make_job: Any, tmp_path: Path) -> None:
    image = tmp_path / "vllm.sif"
    image.write_bytes(b"SIF")
    job = make_job({"container": str(image), "gpus_per_node": 1}, preset="dp2", nodes=2)
    job.start()
    job.wait_phase("ready", timeout=30)
    starts = [c["argv"] for c in job.records("container.jsonl") if "serve" in c["argv"]]
    assert len(starts) == 2 and all(a[:2] == ["exec", "--nv"] and str(image) in a for a in starts)
    assert sum("--headless" in a for a in starts) == 1  # the head and its worker, both inside


def test_an_owner_that_fails_leaves_the_compile_to_the_next_engine(make_job: Any, tmp_path: Path) -> None:
    site = fake_packages(tmp_path / "site", torch="2.9.1")
    cache = tmp_path / "cache"
    job = make_job({"vllm_cache_root": str(cache)})
    job.start(PYTHONPATH=str(site), PBSTK_TEST_STANDIN_MODE="fatal")
    job.wait_phase("failed")
    assert job.proc is not None and job.proc.wait(timeout=10) != 0
    root = _keyed_root(cache)
    assert "compiling into" in job.log
    assert not (root / ".pbstk-compiling").exists() and not (root / ".pbstk-compiled").exists()


def test_an_owner_cancelled_while_compiling_releases_the_lock(make_job: Any, tmp_path: Path) -> None:
    site = fake_packages(tmp_path / "site", torch="2.9.1")
    cache = tmp_path / "cache"
    job = make_job({"vllm_cache_root": str(cache)})
    job.start(PYTHONPATH=str(site), PBSTK_TEST_STANDIN_MODE="hang")
    job.wait_phase("starting")
    root = _keyed_root(cache)
    assert (root / ".pbstk-compiling").is_dir()
    assert job.proc is not None
    os.kill(job.proc.pid, signal.SIGTERM)  # the scheduler's cancel reaches the start script
    job.wait_phase("cancelled")
    until(lambda: not (root / ".pbstk-compiling").exists(), 10, "the lock released")
    assert not (root / ".pbstk-compiled").exists()


def test_container_path_takes_the_account_placeholder(tmp_path: Path) -> None:
    prof = tmp_path / "site.yaml"
    prof.write_text(json.dumps({"name": "site", "scheduler": "pbs", "queue": "debug",
                                "container": "/eagle/projects/{account}/images/vllm.sif"}))
    rendered = render(RenderRequest(model=MODEL, profile=str(prof), account="P1", run_dir=str(tmp_path / "r")))
    assert "CONTAINER_IMAGE=/eagle/projects/P1/images/vllm.sif\n" in rendered.start_script
