"""``pbstk stage`` and the launch preflight against a real ``huggingface_hub`` client and a loopback Hub stand-in
(tests/standins/hub.py): download, verify, manifest, a killed download, a corrupt byte, a gated repo, staging
over the real sshd, and launch/serve refusing an unstaged model before anything is queued."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import pbstk, until
from sshd import SshdInfo
from standins.hub import FakeHub, git_blob_sha1

from pbs_toolkit.jobs.store import JobStore

#: a Python with huggingface_hub plays the job environment's (the vLLM venv; read at import, like test_e2e_vllm)
_VENV = os.environ.get("PBSTK_TEST_VLLM_VENV", "")
HAS_HUB = bool(_VENV) and subprocess.run(  # noqa: S603 - argument list
    [f"{_VENV}/bin/python", "-c", "import huggingface_hub"], capture_output=True, check=False).returncode == 0
pytestmark = pytest.mark.skipif(not HAS_HUB, reason="PBSTK_TEST_VLLM_VENV (a Python with huggingface_hub) not set")
MODEL = "acme/tiny-stage"


def safetensors(nbytes: int) -> bytes:
    """A valid safetensors file of one F32 tensor (header JSON, then the data)."""
    count = nbytes // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, count * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + os.urandom(count * 4)


def tiny_model() -> dict[str, bytes]:
    """A tiny generated model: config, tokenizer, one weights file (large-file storage) and its index."""
    return {
        "config.json": json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                   "hidden_size": 128, "num_hidden_layers": 2}).encode(),
        "generation_config.json": b'{"eos_token_id": 2}',
        "tokenizer.json": json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}).encode(),
        "model.safetensors": safetensors(200_000),
    }


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add(MODEL, tiny_model())
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "user-hf"))  # the user's own token store: empty
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
            monkeypatch.delenv(var, raising=False)
        yield fake


def offline_profile(tmp_path: Path, scheduler: str = "local", venv: str = _VENV, **extra: str) -> Path:
    """A profile whose compute nodes are offline, with the Hub-capable Python as its job environment."""
    lines = [f"name: offline-{scheduler}", f"scheduler: {scheduler}", f"hf_home: {tmp_path}/shared-hf",
             "hf_hub_offline: true", "gpus_per_node: 0", 'walltime: "00:10:00"',
             "address: loopback", "bind_host: 127.0.0.1"] + ([f"venv: {venv}"] if venv else [])
    if scheduler == "pbs":
        lines += ["queue: workq", 'select: "{nodes}:ncpus=2"']
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / f"offline-{scheduler}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def repo_dir(tmp_path: Path) -> Path:
    return tmp_path / "shared-hf" / "hub" / ("models--" + MODEL.replace("/", "--"))


def blob_of(tmp_path: Path, name: str) -> Path:
    snapshot = next((repo_dir(tmp_path) / "snapshots").iterdir())
    return Path(os.path.realpath(snapshot / name))


def worker_pids(tmp_path: Path) -> list[int]:
    """Processes whose command line names this test's cache: the stage worker."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(tmp_path / "shared-hf").encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def stage(profile: Path, *args: str) -> tuple[int, str, str]:
    result = pbstk("stage", MODEL, "--profile", str(profile), *args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


def test_stage_downloads_verifies_and_writes_a_manifest(hub: FakeHub, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path)
    rc, out, err = stage(profile, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "stage" and doc["ok"] is True
    assert doc["counts"] == {"files": 4, "ok": 4, "missing": 0, "truncated": 0, "size": 0, "corrupt": 0,
                             "unchecked": 0}
    assert doc["unchecked"] == []  # the Hub listed every file
    algos = {row["file"]: row["algo"] for row in doc["files"]}
    assert algos["model.safetensors"] == "sha256" and algos["config.json"] == "git-sha1"
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert manifest["commit"] == hub.repos[MODEL].commit
    assert {f["file"]: f["size"] for f in manifest["files"]}["model.safetensors"] == len(
        hub.repos[MODEL].files["model.safetensors"])
    assert all(f["verified_at"] for f in manifest["files"])
    # --verify-only downloads nothing: not a single request reaches the Hub
    before = len(hub.requests)
    rc, out, err = stage(profile, "--verify-only")
    assert rc == 0, err
    assert "4/4 files" in out and "verified" in out
    assert len(hub.requests) == before


def test_a_corrupted_byte_is_found_and_named_then_repaired(hub: FakeHub, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path)
    assert stage(profile)[0] == 0
    blob = blob_of(tmp_path, "model.safetensors")
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    rc, out, err = stage(profile, "--verify-only", "--json")
    assert rc == 11
    doc = json.loads(out)
    bad = [row for row in doc["files"] if row["status"] != "ok"]
    assert [(row["file"], row["status"]) for row in bad] == [("model.safetensors", "corrupt")]
    assert "1 of 4 files failed verification" in err and "model.safetensors: corrupt" in err
    assert not list((repo_dir(tmp_path) / "pbstk-manifests").glob("*.json"))  # no longer looks staged
    # the launch preflight now refuses it
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 11 and "no verified manifest" in res.stderr
    # staging (not --verify-only) removes the bad blob and fetches it again
    rc, out, err = stage(profile)
    assert rc == 0, err
    assert blob_of(tmp_path, "model.safetensors").read_bytes() == hub.repos[MODEL].files["model.safetensors"]


def test_a_truncated_file_is_named_against_the_manifest(hub: FakeHub, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path)
    assert stage(profile)[0] == 0
    blob = blob_of(tmp_path, "model.safetensors")
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.truncate(1000)
    rc, _out, err = stage(profile, "--verify-only")
    assert rc == 11
    assert "model.safetensors: truncated (1000 bytes, expected" in err


def test_a_killed_download_leaves_nothing_looking_complete_and_the_next_stage_finishes(
        hub: FakeHub, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path)
    hub.stall.add("model.safetensors")
    proc = subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit", "stage", MODEL, "--profile", str(profile)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert hub.stalled.wait(60), "the download never started"
        until(lambda: list((repo_dir(tmp_path) / "blobs").glob("*.incomplete")), 30, "a partial blob")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    # the worker runs in a session of its own (like every command pbstk runs): it must end with pbstk
    until(lambda: not worker_pids(tmp_path), 30, "the worker to end with pbstk")
    snapshot = repo_dir(tmp_path) / "snapshots" / hub.repos[MODEL].commit
    assert not (snapshot / "model.safetensors").exists()  # the half file is no link of the snapshot
    assert not (repo_dir(tmp_path) / "pbstk-manifests").exists()
    rc, _out, err = stage(profile, "--verify-only")
    assert rc == 11 and "model.safetensors: missing" in err, err  # the listing huggingface_hub kept
    hub.stall.clear()
    hub.release.set()
    partial = next((repo_dir(tmp_path) / "blobs").glob("*.incomplete"))
    os.utime(partial, (0, 0))  # untouched for long: nobody is writing it any more
    rc, out, err = stage(profile, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["counts"]["ok"] == 4 and doc["removed_partials"] == 1
    assert not partial.exists()


def test_a_gated_repo_without_or_with_a_wrong_token_is_refused_in_one_line(
        hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = offline_profile(tmp_path)
    hub.repos[MODEL].gated = True
    hub.repos[MODEL].tokens = {"hf_good_token"}
    rc, out, err = stage(profile)
    assert rc == 11 and out == ""
    lines = [line for line in err.splitlines() if not line.startswith("pbstk: note: ")]
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: ")
    assert "gated" in err and "HF_TOKEN" in err and "hf auth login" in err
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token")
    rc, _out, err = stage(profile)
    assert rc == 11 and "gated" in err and "cannot access it" in err
    monkeypatch.setenv("HF_TOKEN", "hf_good_token")
    result = pbstk("-v", "stage", MODEL, "--profile", str(profile))
    assert result.exit_code == 0, result.output
    assert "hf_good_token" not in result.output  # the token travels on stdin, never in argv or the -v lines


def test_only_hub_ids_are_staged(hub: FakeHub, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path)
    for model in (str(tmp_path), "./model", "not a model"):
        res = pbstk("stage", model, "--profile", str(profile))
        assert res.exit_code == 2 and "not a Hub model id" in res.stderr
    res = pbstk("stage", MODEL, "--profile", str(profile), "--revision", "../../etc")
    assert res.exit_code == 2 and "--revision" in res.stderr


def test_launch_refuses_an_unstaged_model_with_nothing_queued_then_stage_submits(
        hub: FakeHub, fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path, "pbs")
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 11, res.output
    assert f"run `pbstk stage {MODEL} --profile offline-pbs` first, or pass --stage" in res.stderr
    calls = fakepbs / "calls.log"
    assert not calls.exists() or "qsub" not in calls.read_text()
    assert JobStore().all() == [] and JobStore().intents() == []
    assert not any(Path(os.environ["PBSTK_RUNS_ROOT"]).iterdir())  # no run directory either
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu", "--stage")
    assert res.exit_code == 0, res.output
    assert f"staging {MODEL}" in res.stderr
    assert "qsub" in calls.read_text()
    assert list((repo_dir(tmp_path) / "pbstk-manifests").glob("*.json"))
    pbstk("cancel", "--all")


def test_a_staged_model_passes_and_a_missing_file_is_refused(hub: FakeHub, fakepbs: Path, standins: Path,
                                                             tmp_path: Path) -> None:
    profile = offline_profile(tmp_path, "pbs")
    assert stage(profile)[0] == 0
    (next((repo_dir(tmp_path) / "snapshots").iterdir()) / "tokenizer.json").unlink()
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 11 and "tokenizer.json is missing" in res.stderr
    assert stage(profile)[0] == 0  # staging again fetches what is missing
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 0, res.output
    pbstk("cancel", "--all")


def test_a_model_directory_without_its_weights_is_refused(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    profile = offline_profile(tmp_path, "pbs")
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (model / "model-00001-of-00002.safetensors").write_bytes(safetensors(64))
    res = pbstk("launch", str(model), "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 11
    assert "model-00002-of-00002.safetensors (named by its index) is missing" in res.stderr
    (model / "model-00002-of-00002.safetensors").write_bytes(safetensors(64))
    res = pbstk("launch", str(model), "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 0, res.output
    pbstk("cancel", "--all")


def test_run_refuses_an_unstaged_model_and_its_stage_option_stages_it(hub: FakeHub, standins: Path,
                                                                        tmp_path: Path) -> None:
    """``pbstk run`` goes through the launch preflight: refused (exit 11) before anything is queued and COMMAND
    never runs; ``run --stage`` stages first, then the server comes up and COMMAND runs against it."""
    jobpy = tmp_path / "jobpy"  # the job's python3 is the Hub-capable one, its `vllm` the stand-in on PATH
    jobpy.mkdir()
    (jobpy / "python3").write_text(f'#!/bin/sh\nexec {_VENV}/bin/python3 "$@"\n')
    (jobpy / "python3").chmod(0o755)
    profile = offline_profile(tmp_path, venv="", setup=f'["export PATH={jobpy}:$PATH"]')
    ran = tmp_path / "ran"
    args = [sys.executable, "-m", "pbs_toolkit", "run", MODEL, "--profile", str(profile), "--preset", "cpu",
            "--timeout", "60"]
    command = ["--", "touch", str(ran)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    refused = subprocess.run(args + command, capture_output=True, text=True, env=env, timeout=120,  # noqa: S603
                             check=False)
    assert refused.returncode == 11, refused.stderr
    assert f"run `pbstk stage {MODEL} --profile offline-local` first, or pass --stage" in refused.stderr
    assert not ran.exists() and JobStore().all() == []
    staged = subprocess.run(args + ["--stage", *command], capture_output=True, text=True, env=env,  # noqa: S603
                            timeout=180, check=False)
    assert staged.returncode == 0, staged.stderr
    assert f"staging {MODEL}" in staged.stderr and ran.exists()
    assert list((repo_dir(tmp_path) / "pbstk-manifests").glob("*.json"))
    assert len(JobStore().all()) == 1  # one launch: the refused run recorded nothing


def test_serve_refuses_before_the_router_or_any_replica(hub: FakeHub, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # vllm-router
    profile = offline_profile(tmp_path)
    res = pbstk("serve", MODEL, "--profile", str(profile), "--preset", "cpu", "--replicas", "2")
    assert res.exit_code == 11 and "pbstk stage" in res.stderr, res.output
    assert JobStore().all() == []
    from pbs_toolkit.client import Client

    with Client() as c:
        assert c.services(all=True) == []  # not even recorded: the router never started


def test_staging_over_the_held_ssh_login(hub: FakeHub, login_node: SshdInfo, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """From a laptop: the worker runs on the login node (the real sshd), with the profile's Python there."""
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")  # forwarded on stdin; the stand-in repo is public
    profile = offline_profile(tmp_path, "pbs", ssh_host=login_node.alias)
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")  # the preflight asks the login node
    assert res.exit_code == 11 and "pbstk stage" in res.stderr, res.output
    result = pbstk("-v", "stage", MODEL, "--profile", str(profile), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["where"] == login_node.alias and doc["counts"]["ok"] == 4
    assert "hf_secret_value" not in result.output
    assert f"ssh {login_node.alias}" in result.stderr  # it did run there
    rc, _out, err = stage(profile, "--verify-only")
    assert rc == 0, err
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "cpu")
    assert res.exit_code == 0, res.output
    pbstk("cancel", "--all")


def test_a_job_python_without_huggingface_hub_is_one_line(hub: FakeHub, tmp_path: Path) -> None:
    venv = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # noqa: S603
    profile = offline_profile(tmp_path)
    profile.write_text(profile.read_text().replace(f"venv: {_VENV}", f"venv: {venv}"))
    rc, out, err = stage(profile)
    assert rc == 11 and out == ""
    assert "has no huggingface_hub (the profile's venv/setup give the job's Python)" in err


# -- a model the Hugging Face tools downloaded: no manifest, no cached listing, no network ----------------------

SHARDED = "acme/tiny-sharded"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def sharded_model() -> dict[str, bytes]:
    """Config, tokenizer (git-sha1 blobs), two weight shards (sha256 blobs) and the index that names them."""
    index = {"metadata": {"total_size": 0}, "weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}
    return {**{k: v for k, v in tiny_model().items() if k != "model.safetensors"},
            "model.safetensors.index.json": json.dumps(index).encode(),
            SHARDS[0]: safetensors(40_000), SHARDS[1]: safetensors(40_000)}


@pytest.fixture
def hf_snapshot(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The sharded model as transformers leaves it: ``hf_hub_download`` file by file, by the job environment's
    huggingface_hub, into the profile's cache; then offline (``HF_HUB_OFFLINE=1``). Its snapshot directory."""
    files = hub.add(SHARDED, sharded_model()).files
    cache = tmp_path / "shared-hf" / "hub"
    code = ("import sys, huggingface_hub as h\n"
            "for f in sys.argv[3:]: h.hf_hub_download(sys.argv[1], f, cache_dir=sys.argv[2])")
    subprocess.run([f"{_VENV}/bin/python", "-c", code, SHARDED, str(cache), *sorted(files)],  # noqa: S603
                   check=True, capture_output=True)
    folder = cache / ("models--" + SHARDED.replace("/", "--"))
    assert not (folder / "trees").exists() and not (folder / "pbstk-manifests").exists()  # nothing lists the files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder / "snapshots" / hub.repos[SHARDED].commit


def verify_offline(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    result = pbstk("stage", SHARDED, "--profile", str(offline_profile(tmp_path)), "--verify-only", *args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


def flip_first_byte(link: Path) -> bytes:
    """Flip the first byte of the blob ``link`` points at; the new content."""
    blob = Path(os.path.realpath(link))
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[0] ^= 0xFF
    blob.write_bytes(bytes(data))
    return bytes(data)


def test_verify_only_checks_a_snapshot_the_hf_tools_downloaded_without_the_hub(
        hub: FakeHub, hf_snapshot: Path, tmp_path: Path) -> None:
    before = len(hub.requests)
    rc, out, err = verify_offline(tmp_path, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["ok"] is True and doc["counts"]["ok"] == doc["counts"]["files"] == 6
    algos = {row["file"]: row["algo"] for row in doc["files"]}
    assert algos[SHARDS[1]] == "sha256" and algos["config.json"] == "git-sha1"
    assert doc["unchecked"] and doc["unchecked"][0].startswith(
        "completeness of the file list not checked without the Hub")
    # the list is not known whole: nothing is marked staged, so an offline launch still asks for `pbstk stage`
    assert doc["manifest"] is None and not (hf_snapshot.parent.parent / "pbstk-manifests").exists()
    rc, out, err = verify_offline(tmp_path)
    assert rc == 0 and "6/6 files" in out, err
    assert "pbstk: note: completeness of the file list not checked without the Hub" in err
    assert len(hub.requests) == before  # offline: not one request


def test_verify_only_names_a_flipped_byte_with_both_hashes(hf_snapshot: Path, tmp_path: Path) -> None:
    shard = flip_first_byte(hf_snapshot / SHARDS[1])  # a large-file-storage blob: named by its sha256
    config = flip_first_byte(hf_snapshot / "config.json")  # a small file: named by its git blob sha1
    rc, out, err = verify_offline(tmp_path, "--json")
    assert rc == 11
    rows = {row["file"]: row for row in json.loads(out)["files"]}
    assert rows[SHARDS[1]]["actual"] == hashlib.sha256(shard).hexdigest()
    assert rows[SHARDS[1]]["hash"] == Path(os.path.realpath(hf_snapshot / SHARDS[1])).name
    assert rows["config.json"]["actual"] == git_blob_sha1(config)
    assert rows[SHARDS[0]]["status"] == rows["tokenizer.json"]["status"] == "ok"
    rc, _out, err = verify_offline(tmp_path)
    assert rc == 11 and "2 of 6 files failed verification" in err
    assert (f"{SHARDS[1]}: corrupt (content hashes to {hashlib.sha256(shard).hexdigest()[:12]}, expected "
            f"{rows[SHARDS[1]]['hash'][:12]})") in err
    assert f"config.json: corrupt (content hashes to {git_blob_sha1(config)[:12]}, expected" in err


def test_verify_only_finds_a_shard_the_index_names_missing_and_a_link_without_its_blob(
        hf_snapshot: Path, tmp_path: Path) -> None:
    (hf_snapshot / SHARDS[0]).unlink()
    Path(os.path.realpath(hf_snapshot / "tokenizer.json")).unlink()
    rc, _out, err = verify_offline(tmp_path)
    assert rc == 11
    assert f"{SHARDS[0]}: missing (model.safetensors.index.json names it; not in the snapshot)" in err
    assert "tokenizer.json: missing (links to a blob that is not in the cache)" in err
    assert SHARDS[1] + ":" not in err  # the intact shard is not named
