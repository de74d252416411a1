"""Where a Hub model lives in a Hugging Face cache and where ``pbstk stage`` leaves its manifest.

The manifest is written by the worker (``server/stage_weights.py``, which must stay standard-library only and so
repeats these names); this module reads it. Layout under ``HF_HOME/hub``::

    models--ORG--NAME/refs/REVISION            the commit a branch or tag names
    models--ORG--NAME/snapshots/COMMIT/FILE    links into blobs/, named by the file's sha256 or git sha1
    models--ORG--NAME/pbstk-manifests/COMMIT.json
        {"schema": 1, "repo", "revision", "commit", "verified_at",
         "files": [{"file", "size", "hash", "algo", "verified_at"}]}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.transports.base import Runner

MANIFEST_DIR = "pbstk-manifests"
#: a Hub repository id (``org/name``, or a bare name), as ``render`` tells one from a path
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache(hf_home: str) -> str:
    """The Hub cache under ``hf_home`` (what ``HF_HOME`` makes ``HF_HUB_CACHE``)."""
    return hf_home.rstrip("/") + "/hub"


def repo_folder(hf_home: str, repo: str) -> str:
    return f"{hub_cache(hf_home)}/models--{repo.replace('/', '--')}"


@dataclass(frozen=True)
class ManifestFile:
    file: str
    size: int
    hash: str


@dataclass(frozen=True)
class Manifest:
    repo: str
    commit: str
    verified_at: str
    files: tuple[ManifestFile, ...]
    path: str

    @property
    def snapshot(self) -> str:
        """The snapshot directory the manifest describes (vLLM can load it as a model directory)."""
        return self.path.rsplit("/", 2)[0] + f"/snapshots/{self.commit}"


def _read(runner: Runner, path: str) -> bytes | None:
    try:
        return runner.read_bytes(path)
    except (OSError, PbstkError):
        return None


def commit_of(runner: Runner, hf_home: str, repo: str, revision: str) -> str | None:
    """The commit ``revision`` names in the cache (a commit id is itself), or ``None`` if the cache has no ref."""
    if _COMMIT.match(revision):
        return revision
    data = _read(runner, f"{repo_folder(hf_home, repo)}/refs/{revision}")
    text = data.decode("utf-8", "replace").strip() if data else ""
    return text if _COMMIT.match(text) else None


def load_manifest(runner: Runner, hf_home: str, repo: str, commit: str) -> Manifest | None:
    """The manifest ``pbstk stage`` wrote for ``commit``, or ``None`` (absent, unreadable, not ours)."""
    path = f"{repo_folder(hf_home, repo)}/{MANIFEST_DIR}/{commit}.json"
    data = _read(runner, path)
    try:
        doc: Any = json.loads(data) if data else None
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("commit") != commit or not isinstance(doc.get("files"), list):
        return None
    files = []
    for row in doc["files"]:
        if not (isinstance(row, dict) and isinstance(row.get("file"), str) and isinstance(row.get("size"), int)):
            return None
        files.append(ManifestFile(row["file"], row["size"], str(row.get("hash", ""))))
    return Manifest(str(doc.get("repo", repo)), commit, str(doc.get("verified_at", "")), tuple(files), path)


#: sizes of files, one line each, ``-`` for a missing one: one command for a whole snapshot, not one per file
_SIZES = 'for f; do if [ -e "$f" ]; then stat -L -c %s -- "$f"; else echo -; fi; done'


def file_sizes(runner: Runner, paths: list[str]) -> list[int | None]:
    """The size of each of ``paths`` (``None``: missing), read where they are in one command."""
    if not paths:
        return []
    result = runner.run(["bash", "-c", _SIZES, "pbstk-sizes", *paths], env={"LC_ALL": "C"}, timeout=120.0)
    lines = result.stdout.splitlines()
    if len(lines) != len(paths) or not all(line == "-" or line.isdigit() for line in lines):
        return [runner.size(p) for p in paths]  # no GNU stat there: one look per file
    return [None if line == "-" else int(line) for line in lines]
