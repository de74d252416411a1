"""A loopback stand-in for the Hugging Face Hub's HTTP API, enough for a real ``huggingface_hub`` client's
``snapshot_download`` and ``model_info(files_metadata=True)`` (point ``HF_ENDPOINT`` at :attr:`FakeHub.url`).

What it serves, as the Hub does (huggingface_hub's ``file_download.py``, ``_snapshot_download.py``, ``hf_api.py``
and ``utils/_http.py`` read these):

- ``GET /api/models/{repo}/revision/{rev}`` (``?blobs=true``: sizes, ``blobId``, ``lfs``): ``sha`` is the commit;
- ``GET /api/models/{repo}/tree/{rev}`` (``recursive``): ``[{type, oid, size, path, lfs: {oid, size, pointerSize}}]``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``; ``ETag`` the git blob sha1 of a small file;
  for a large-file-storage file (weights, anything over 10 kB) ``X-Linked-Etag`` = its sha256 and
  ``X-Linked-Size``; ``Content-Length``; ``Range: bytes=N-`` answered with 206;
- errors with ``X-Error-Code``: ``RepoNotFound`` (401, also for a private repo without a token), ``RevisionNotFound``
  (404), ``EntryNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with one that has no access).

Faults: ``stall`` names a file whose GET sends half its bytes and then waits for :attr:`FakeHub.release` (a
download killed midway); ``corrupt`` names files served with one byte flipped (a bad mirror).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/]+)(?P<rest>/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


@dataclass
class HubRepo:
    files: dict[str, bytes]
    gated: bool = False
    tokens: set[str] = field(default_factory=set)
    commit: str = ""

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1()  # noqa: S324 - a made-up commit id
            for name in sorted(self.files):
                digest.update(name.encode() + b"\0" + self.files[name])
            self.commit = digest.hexdigest()

    @staticmethod
    def is_lfs(name: str, data: bytes) -> bool:
        return name.endswith(LFS_SUFFIXES) or len(data) > 10_000

    def entry(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        row: dict[str, Any] = {"size": len(data), "blob_id": git_blob_sha1(data)}
        if self.is_lfs(name, data):
            row["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return row


class FakeHub:
    """``with FakeHub() as hub: hub.add("org/tiny", {...}); os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.stall: set[str] = set()
        self.corrupt: set[str] = set()
        self.release = threading.Event()
        self.stalled = threading.Event()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hub.handle(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub.handle(self, body=False)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes], **kw: Any) -> HubRepo:
        self.repos[repo] = HubRepo(dict(files), **kw)
        return self.repos[repo]

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # -- the API -------------------------------------------------------------------------------------------------

    def handle(self, req: http.server.BaseHTTPRequestHandler, *, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(req.path).path)
        self.requests.append((req.command, path))
        api, resolve = _API.match(path), _RESOLVE.match(path)
        match = api or resolve
        repo = self.repos.get(match["repo"]) if match else None
        if match is None:  # an API this stand-in does not have (the client's telemetry): the Hub's plain 404
            return self.error(req, 404, "", "Not found")
        if repo is None:
            return self.error(req, 401, "RepoNotFound", "Repository not found")
        if match["rev"] not in ("main", repo.commit):
            return self.error(req, 404, "RevisionNotFound", "Invalid rev id")
        if api:
            return self.api(req, repo, api["what"], match["repo"], body)
        name = resolve["file"] if resolve else ""
        if repo.gated:
            auth = req.headers.get("Authorization", "")
            token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
            if token not in repo.tokens:
                return self.error(req, 403 if token else 401, "GatedRepo",
                                  f"Access to model {match['repo']} is restricted and you are not in the "
                                  f"authorized list. Visit https://huggingface.co/{match['repo']} to ask for access.")
        if name not in repo.files:
            return self.error(req, 404, "EntryNotFound", "Entry not found")
        self.file(req, repo, name, body)

    def api(self, req: http.server.BaseHTTPRequestHandler, repo: HubRepo, what: str, repo_id: str,
            body: bool) -> None:
        if what == "revision":
            siblings = []
            for name in sorted(repo.files):
                e = repo.entry(name)
                row: dict[str, Any] = {"rfilename": name, "size": e["size"], "blobId": e["blob_id"]}
                if "lfs" in e:
                    row["lfs"] = e["lfs"]
                siblings.append(row)
            doc: Any = {"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                        "private": False, "disabled": False, "gated": "manual" if repo.gated else False,
                        "downloads": 0, "likes": 0, "tags": [], "siblings": siblings}
        else:
            doc = []
            for name in sorted(repo.files):
                e = repo.entry(name)
                item: dict[str, Any] = {"type": "file", "oid": e["blob_id"], "size": e["size"], "path": name}
                if "lfs" in e:
                    item["lfs"] = {"oid": e["lfs"]["sha256"], "size": e["size"], "pointerSize": 134}
                doc.append(item)
        data = json.dumps(doc).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)

    def file(self, req: http.server.BaseHTTPRequestHandler, repo: HubRepo, name: str, body: bool) -> None:
        data = repo.files[name]
        entry = repo.entry(name)
        if name in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        ranged = re.match(r"^bytes=(\d+)-$", req.headers.get("Range", ""))
        if ranged and body:
            start = min(int(ranged[1]), len(data))
        req.send_response(206 if start else 200)
        req.send_header("X-Repo-Commit", repo.commit)
        req.send_header("ETag", f'"{entry["blob_id"]}"')
        if "lfs" in entry:
            req.send_header("X-Linked-Etag", f'"{entry["lfs"]["sha256"]}"')
            req.send_header("X-Linked-Size", str(len(data)))
        req.send_header("Accept-Ranges", "bytes")
        if start:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.send_header("Content-Length", str(len(data) - start))
        req.end_headers()
        if not body:
            return
        if name in self.stall:
            half = (len(data) - start) // 2
            req.wfile.write(data[start:start + half])
            req.wfile.flush()
            self.stalled.set()
            self.release.wait(60)
            req.close_connection = True
            return
        req.wfile.write(data[start:])

    @staticmethod
    def error(req: http.server.BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)
