"""Profile key ``stage_to``: each node of a two-node job launched on the fake PBS copies the staged model to its
own disk, checks the sizes against the manifest, and the stand-in vLLM is started on the copy; the copy's time is
a phase marker. Real ``pbstk launch`` (preflight included), real rendered scripts (shellcheck-clean), real bash."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import pbstk

from pbs_toolkit.jobs.render import RenderRequest, render
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.weights.stage import WORKER

FAKEPBS = Path(__file__).parent / "fakepbs"
MODEL = "acme/tiny-copy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hub_cache(hf_home: Path, files: dict[str, bytes]) -> str:
    """A Hub cache of MODEL laid out as huggingface_hub lays it out (blobs named by hash, snapshot links, ref, tree
    listing), then verified by the stage worker (``--verify-only`` needs no huggingface_hub): its manifest."""
    repo = hf_home / "hub" / ("models--" + MODEL.replace("/", "--"))
    commit = hashlib.sha1(b"".join(sorted(files.values()))).hexdigest()  # noqa: S324 - a made-up commit
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    tree = {}
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
        tree[name] = {"size": len(data), "blob_id": "0" * 40, "lfs_sha256": blob, "lfs_size": len(data)}
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "trees").mkdir()
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    out = subprocess.run([sys.executable, str(WORKER), "--repo", MODEL, "--cache", str(hf_home / "hub"),  # noqa: S603
                          "--verify-only"], capture_output=True, text=True, check=True).stdout
    assert '"ok": true' in out, out
    return commit


@pytest.fixture
def fake_site(standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_DELAY", "0.1")
    monkeypatch.setenv("PATH", f"{FAKEPBS / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKEPBS_HOME", str(tmp_path / "fakepbs"))
    monkeypatch.setenv("FAKEPBS_KILL_DELAY", "1")
    monkeypatch.setenv("FAKEPBS_EXITING_DELAY", "0.2")
    (tmp_path / "fakepbs").mkdir()
    site: dict[str, Any] = {"jobs": [], "record": standins}
    yield site
    pbstk("cancel", "--all")


def profile_file(tmp_path: Path, stage_to: Path, parallel: int = 8) -> Path:
    path = tmp_path / "copysite.yaml"
    path.write_text(f"name: copysite\nscheduler: pbs\nqueue: workq\nselect: \"{{nodes}}:ncpus=8:ngpus=4\"\n"
                    f"gpus_per_node: 4\nhf_home: {tmp_path}/shared-hf\nhf_hub_offline: true\n"
                    f"stage_to: {stage_to}\nstage_to_parallel: {parallel}\naddress: short\nnode_launcher: pbsdsh\n")
    return path


def launch_two_nodes(profile: Path) -> Path:
    """``pbstk launch`` of MODEL over two nodes (dp8: 2 nodes of 4 GPUs) on the fake PBS; its run directory."""
    res = pbstk("launch", MODEL, "--profile", str(profile), "--preset", "dp8", "--port", "auto")
    assert res.exit_code == 0, res.output  # the preflight found the model staged
    record = JobStore().find(None)
    return Path(record.run_dir)


def wait(what: str, check: Any, run_dir: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("vllm*.log")))
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def markers(run_dir: Path) -> dict[str, dict[str, str]]:
    found = {}
    for path in (run_dir / "phases").glob("stage-copy*"):
        found[path.name] = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return found


@pytest.mark.parametrize("parallel", [8, 1])
def test_each_node_copies_the_staged_model_and_serves_the_copy(fake_site: dict[str, Any], tmp_path: Path,
                                                               parallel: int) -> None:
    files = {"config.json": b'{"model_type": "qwen3"}', "model.safetensors": os.urandom(150_000)}
    commit = hub_cache(tmp_path / "shared-hf", files)
    local = tmp_path / "node-local"
    run_dir = launch_two_nodes(profile_file(tmp_path, local, parallel))
    subprocess.run(["shellcheck", "-s", "bash", str(run_dir / "start_vllm.sh")], check=True)  # noqa: S603,S607
    argv_file = fake_site["record"] / "argv.jsonl"
    wait("both nodes' vLLM", lambda: argv_file.exists() and len(argv_file.read_text().splitlines()) == 2, run_dir)
    dest = local / "pbstk-models" / f"tiny-copy-{commit}"
    for start in (json.loads(line) for line in argv_file.read_text().splitlines()):
        argv = start["argv"]
        assert str(dest) in argv, argv  # vLLM loads the node-local copy, not the shared cache
        assert "--served-model-name" in argv and MODEL in argv  # clients still ask for the Hub id
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == files
    assert not list((local / "pbstk-models").glob(".copy.*"))  # no half copy left beside it
    found = markers(run_dir)
    assert set(found) == {"stage-copy", "stage-copy.node1"}
    for marker in found.values():
        assert int(marker["start"]) <= int(marker["end"]) and marker["to"] == str(dest)
        assert int(marker["bytes"]) == sum(len(v) for v in files.values())
    timeline = (run_dir / "startup.log").read_text().split()
    assert "stage" in timeline and "staged" in timeline  # the head's copy is the start-up phase stage_copy
    if parallel == 1:  # one node at a time: node 1 starts once node 0's copy ended
        assert int(found["stage-copy.node1"]["start"]) >= int(found["stage-copy"]["end"])
        assert "waiting for node 0's copy" in (run_dir / "vllm.node1.log").read_text()


def test_a_changed_blob_is_refused_before_queuing(fake_site: dict[str, Any], tmp_path: Path) -> None:
    """The shared blob changed after staging: the launch preflight (sizes against the manifest) refuses it."""
    files = {"config.json": b"{}", "model.safetensors": os.urandom(50_000)}
    hub_cache(tmp_path / "shared-hf", files)
    blob = next((tmp_path / "shared-hf").glob("hub/*/blobs/" + hashlib.sha256(files["model.safetensors"]).hexdigest()))
    with blob.open("r+b") as f:
        f.truncate(100)
    res = pbstk("launch", MODEL, "--profile", str(profile_file(tmp_path, tmp_path / "node-local")), "--preset", "dp8")
    assert res.exit_code == 11 and "model.safetensors is 100 bytes, not 50000" in res.stderr
    assert JobStore().all() == []


def test_a_node_that_cannot_copy_fails_the_job_before_vllm(fake_site: dict[str, Any], tmp_path: Path) -> None:
    """The node's disk is unusable (here: a file where the directory should be): the job fails with the reason."""
    hub_cache(tmp_path / "shared-hf", {"config.json": b"{}", "model.safetensors": os.urandom(5_000)})
    (tmp_path / "not-a-dir").write_text("")
    run_dir = launch_two_nodes(profile_file(tmp_path, tmp_path / "not-a-dir" / "scratch"))

    def reason() -> str:
        try:
            doc = json.loads((run_dir / "server.json").read_text())
        except (OSError, ValueError):
            return ""
        return str(doc.get("reason") or "") if doc.get("phase") == "failed" else ""

    wait("the job to fail", reason, run_dir)
    assert "stage_to: cannot create" in reason() and "not-a-dir/scratch/pbstk-models" in reason()
    assert not (fake_site["record"] / "argv.jsonl").exists()  # vLLM never started


def test_no_stage_to_leaves_the_start_script_as_it_was(tmp_path: Path) -> None:
    plain = render(RenderRequest(model=MODEL, run_dir=str(tmp_path / "r"), profile="generic-pbspro",
                                 preset="single", port=8000)).start_script
    assert "pbstk_stage_copy()" not in plain and "STAGE_TO=" not in plain


def test_stage_to_must_be_an_absolute_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nscheduler: pbs\nstage_to: scratch/models\n")
    res = pbstk("render", MODEL, "--profile", str(path), "--preset", "single")
    assert res.exit_code == 2 and "key 'stage_to' must be an absolute path" in res.stderr


def test_the_copy_settings_cannot_be_overridden_by_env(tmp_path: Path) -> None:
    profile = profile_file(tmp_path, tmp_path / "node-local")
    text = render(RenderRequest(model=MODEL, run_dir=str(tmp_path / "r"), profile=str(profile), preset="dp8",
                                port=8000)).start_script
    assigned = {line.split("=", 1)[0] for line in text.splitlines() if line.startswith("STAGE_")}
    assert assigned == {"STAGE_TO", "STAGE_REVISION", "STAGE_PARALLEL"}
    for name in sorted(assigned):
        res = pbstk("render", MODEL, "--profile", str(profile), "--preset", "dp8", "--env", f"{name}=/elsewhere")
        assert res.exit_code == 2 and f"would overwrite the start script's own setting {name}" in res.stderr
