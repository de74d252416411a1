"""Fetch and verify one Hub model in a Hugging Face cache; run by ``pbstk stage`` with the job environment's Python.

Standard library + ``huggingface_hub`` only: pbstk sends this file over stdin to the login node (no copy is left
there) and runs it with the Python the profile's ``setup``/``venv`` give, so what it downloads is laid out by the
same ``huggingface_hub`` that vLLM will read it with. The first stdin line is a JSON object of inputs that must not
be in argv (the token); the rest is this file. It prints one line ``PBSTK-STAGE-RESULT {json}`` last.

Every file of the snapshot is checked against the name of the blob it links to, which the Hub cache takes from
the file's ETag: the sha256 of a large-file-storage file (64 hex digits), the git blob sha1 of a small one (40).
With the Hub reachable, the file list, sizes and hashes are also compared with the Hub's own listing. A snapshot
that passes gets a manifest ``<repo folder>/pbstk-manifests/<commit>.json``; one that fails loses its manifest, so
nothing incomplete is left looking staged.

``--verify-only`` of a snapshot that has neither a manifest nor huggingface_hub's cached listing (one the Hugging
Face tools downloaded file by file, or an older huggingface_hub) checks what it can offline: each file present
against its blob's name and every shard a ``*.index.json`` names; the file list itself is not checked (only the Hub
knows it), the answer says so, and no manifest is written.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import errno
import hashlib
import json
import os
import re
import sys
import tempfile
import time

RESULT_PREFIX = "PBSTK-STAGE-RESULT "
MANIFEST_DIR = "pbstk-manifests"
MANIFEST_SCHEMA = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 8 << 20
#: statuses that fail a check; ``unchecked`` (a file with no hash to compare) fails only a listed snapshot
BAD = ("missing", "truncated", "size", "corrupt")
#: what an offline check of a snapshot without a listing cannot tell
NO_LISTING = "completeness of the file list not checked without the Hub"


def repo_folder(cache: str, repo: str) -> str:
    return os.path.join(cache, "models--" + repo.replace("/", "--"))


def algo_of(name: str) -> str | None:
    """The hash a blob name is: ``sha256`` (large-file-storage files), ``git-sha1`` (small files) or ``None``."""
    if _SHA256.match(name):
        return "sha256"
    if _SHA1.match(name):
        return "git-sha1"
    return None


def file_hash(path: str, algo: str, size: int) -> str:
    digest = hashlib.sha256() if algo == "sha256" else hashlib.sha1(b"blob %d\0" % size)  # noqa: S324 - git's id
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(snapshot: str, name: str, want: dict[str, object] | None) -> dict[str, object]:
    """One file's result: status ``ok``, ``missing``, ``truncated``, ``size`` (larger than expected), ``corrupt``
    (content does not hash to its blob's name or to the Hub's hash: ``actual`` is what it hashes to) or
    ``unchecked`` (no hash to compare with), with size, hash and algo."""
    path = os.path.join(snapshot, name)
    row: dict[str, object] = {"file": name, "status": "ok"}
    try:
        size = os.stat(path).st_size
    except OSError:
        where = "links to a blob that is not in the cache" if os.path.islink(path) else "not in the snapshot"
        return {**row, "status": "missing", "detail": where}
    row["size"] = size
    blob = os.path.basename(os.path.realpath(path)) if os.path.islink(path) else ""
    expected = str(want["hash"]) if want and want.get("hash") else (blob if algo_of(blob) else "")
    algo = algo_of(expected)
    if algo is None:
        return {**row, "status": "unchecked", "detail": "no hash to check it against (not a Hub cache link)"}
    if blob and algo_of(blob) and blob != expected:
        return {**row, "status": "corrupt", "hash": blob, "algo": algo_of(blob),
                "detail": f"links to blob {blob[:12]}, the Hub says {expected[:12]}"}
    want_size = want.get("size") if want else None
    if isinstance(want_size, int) and size != want_size:
        status = "truncated" if size < want_size else "size"
        return {**row, "status": status, "detail": f"{size} bytes, expected {want_size}"}
    got = file_hash(path, algo, size)
    row.update(hash=expected, algo=algo)
    if got != expected:
        return {**row, "status": "corrupt", "actual": got,
                "detail": f"content hashes to {got[:12]}, expected {expected[:12]}"}
    return row


def offline_listing(manifest_path: str, tree_path: str) -> dict[str, dict[str, object]] | None:
    """``{file: {size, hash}}`` without the Hub: the manifest pbstk wrote, else the tree listing that
    huggingface_hub (1.x and later) keeps beside the snapshot before it downloads; ``None`` if neither."""
    manifest = read_json(manifest_path)
    rows = manifest.get("files") if manifest else None
    if isinstance(rows, list):
        return {str(r["file"]): {"size": r.get("size"), "hash": r.get("hash")} for r in rows
                if isinstance(r, dict) and "file" in r}
    tree = read_json(tree_path)
    files = tree.get("files") if tree and tree.get("format_version") == 1 else None
    if not isinstance(files, dict):
        return None
    return {str(name): {"size": e.get("size"), "hash": e.get("lfs_sha256") or e.get("blob_id")}
            for name, e in files.items() if isinstance(e, dict)}


def read_json(path: str) -> dict[str, object] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_atomic(path: str, data: dict[str, object]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def hub_listing(api: object, repo: str, commit: str) -> dict[str, dict[str, object]]:
    """``{file: {size, hash}}`` from the Hub (``model_info(files_metadata=True)``: every huggingface_hub has it)."""
    info = api.model_info(repo, revision=commit, files_metadata=True)  # type: ignore[attr-defined]
    listing = {}
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        listing[s.rfilename] = {"size": getattr(s, "size", None), "hash": sha or getattr(s, "blob_id", None)}
    return listing


def resolve_commit(folder: str, revision: str) -> str | None:
    if _SHA1.match(revision):
        return revision
    try:
        with open(os.path.join(folder, "refs", revision), encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text if _SHA1.match(text) else None  # it names files: nothing but a commit id


def classify(exc: BaseException, has_token: bool) -> tuple[str, str]:
    """(kind, message) for an exception of huggingface_hub or the OS, by class name (stable across versions)."""
    names = {c.__name__ for c in type(exc).__mro__}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if "GatedRepoError" in names:
        how = "the token cannot access it: accept its terms on its Hub page" if has_token else \
            "no token: set HF_TOKEN or run `hf auth login`, after accepting its terms on its Hub page"
        return "gated", f"the model is gated and {how}"
    if "RevisionNotFoundError" in names:
        return "revision", "the Hub has no such revision of the model"
    if "RepositoryNotFoundError" in names or status == 401:
        how = "" if has_token else " (no token: set HF_TOKEN or run `hf auth login` if it is private)"
        return "not_found", f"the Hub has no model of that name, or it is private{how}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk", f"no space left to download into the cache: {exc.strerror}"
    if "LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names or "ConnectError" in names:
        return "network", "cannot reach the Hub from here (check HF_ENDPOINT and the proxy)"
    first = str(exc).strip().splitlines()
    return "error", f"{type(exc).__name__}: {first[0] if first else ''}"[:300]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def download(args: argparse.Namespace, token: str | None,
             result: dict[str, object]) -> tuple[str, dict[str, dict[str, object]] | None] | None:
    """Download what is missing: (the commit, the Hub's listing of it or ``None`` when the Hub went away after the
    download); ``None`` once ``result`` holds the error."""
    try:
        import huggingface_hub as hub
    except ImportError:
        result["error"] = {"kind": "no_hub", "message": f"{sys.executable} has no huggingface_hub "
                           "(the profile's venv/setup give the job's Python)"}
        return None
    has_token = bool(token or getattr(hub, "get_token", lambda: None)())
    try:
        path = hub.snapshot_download(args.repo, revision=args.revision, cache_dir=args.cache, token=token)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one classified line
        kind, message = classify(exc, has_token)
        result["error"] = {"kind": kind, "message": message}
        return None
    commit = os.path.basename(path)
    try:
        return commit, hub_listing(hub.HfApi(token=token), args.repo, commit)
    except Exception:  # noqa: BLE001 - the Hub went away after the download: check against the cached list
        return commit, None


def stage(args: argparse.Namespace, token: str | None) -> dict[str, object]:
    os.environ["HF_HUB_OFFLINE"] = "1" if args.verify_only else "0"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    folder = repo_folder(args.cache, args.repo)
    result: dict[str, object] = {"repo": args.repo, "revision": args.revision, "cache": args.cache,
                                 "verify_only": args.verify_only, "ok": False, "error": None}
    listing: dict[str, dict[str, object]] | None = None
    commit = resolve_commit(folder, args.revision)
    if not args.verify_only:
        fetched = download(args, token, result)
        if fetched is None:
            return result
        commit, listing = fetched
    result["commit"] = commit
    if commit is None:
        result["error"] = {"kind": "not_staged", "message": f"not in the cache {args.cache} (no refs/{args.revision})"}
        return result
    snapshot = os.path.join(folder, "snapshots", commit)
    manifest_path = os.path.join(folder, MANIFEST_DIR, commit + ".json")
    result.update(snapshot=snapshot, manifest=None, unchecked=[])
    if listing is None:  # verify-only: the manifest's list, else the listing huggingface_hub cached
        listing = offline_listing(manifest_path, os.path.join(folder, "trees", commit + ".json"))
    if listing is None:  # nothing lists the files: check what is there, say what is not known
        return check_unlisted(result, args, snapshot, commit)
    files = verify(snapshot, listing, args.jobs)
    if not args.verify_only and any(r["status"] != "ok" for r in files):
        repaired = repair(args, token, snapshot, listing, files)  # a bad blob is never downloaded over by itself
        files = verify(snapshot, listing, args.jobs) if repaired else files
    result["files"] = files
    result["ok"] = all(r["status"] == "ok" for r in files)
    if result["ok"] and not args.verify_only:
        result["removed_partials"] = remove_stale_partials(os.path.join(folder, "blobs"))
    result["manifest"] = mark(manifest_path, args, commit, files if result["ok"] else None)
    return result


def mark(manifest_path: str, args: argparse.Namespace, commit: str, files: list[dict[str, object]] | None
         ) -> str | None:
    """Write the manifest of a snapshot whose ``files`` all passed (its path), or remove it (``None``): nothing
    incomplete stays marked staged."""
    if files is None:
        try:
            os.unlink(manifest_path)
        except FileNotFoundError:
            pass
        return None
    stamp = now()
    write_atomic(manifest_path, {"schema": MANIFEST_SCHEMA, "repo": args.repo, "revision": args.revision,
                                 "commit": commit, "verified_at": stamp,
                                 "files": [{"file": r["file"], "size": r["size"], "hash": r["hash"],
                                            "algo": r["algo"], "verified_at": stamp} for r in files]})
    return manifest_path


def check_unlisted(result: dict[str, object], args: argparse.Namespace, snapshot: str,
                   commit: str) -> dict[str, object]:
    """``--verify-only`` with no manifest and no cached listing: the files present and the shards the indexes
    name, checked; what only the Hub could tell, in ``unchecked``; no manifest (the list is not known whole)."""
    if not os.path.isdir(snapshot):
        result["error"] = {"kind": "not_staged", "message": f"not in the cache {args.cache} (no snapshot "
                           f"{commit[:12]} of {args.revision})"}
        return result
    files = verify_unlisted(snapshot, args.jobs)
    result["files"] = files
    result["unchecked"] = [f"{NO_LISTING} (no manifest and no cached listing of commit {commit[:12]}): a file "
                           f"the Hub lists and the snapshot lacks is not found; nothing was marked staged"]
    result["ok"] = not any(r["status"] in BAD for r in files)
    return result


def remove_stale_partials(blobs: str, older_than: float = 3600.0) -> int:
    """Remove ``*.incomplete`` blobs nobody wrote to for ``older_than`` seconds: downloads killed midway (newer
    huggingface_hub names each attempt uniquely and never resumes it); a download in progress keeps its fresh."""
    removed = 0
    cutoff = time.time() - older_than
    for name in os.listdir(blobs) if os.path.isdir(blobs) else []:
        path = os.path.join(blobs, name)
        try:
            if name.endswith(".incomplete") and os.stat(path).st_mtime < cutoff:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def verify(snapshot: str, listing: dict[str, dict[str, object]], jobs: int) -> list[dict[str, object]]:
    names = sorted(listing)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # hashlib frees the GIL
        return list(pool.map(lambda n: check_file(snapshot, n, listing[n] or None), names))


def present_files(snapshot: str) -> list[str]:
    """Every file of the snapshot (``/``-separated, links into blobs/ included, broken ones too), sorted."""
    names = []
    for top, dirs, files in os.walk(snapshot):
        dirs.sort()
        rel = os.path.relpath(top, snapshot)
        names += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in files]
    return sorted(names)


def shards_named(snapshot: str, names: list[str]) -> dict[str, str]:
    """``{shard: index file}`` for every shard the ``*.index.json`` files (``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json``) name in their ``weight_map``, relative to the snapshot."""
    shards: dict[str, str] = {}
    for index in (n for n in names if n.endswith(".index.json")):
        doc = read_json(os.path.join(snapshot, index))
        weight_map = doc.get("weight_map") if doc else None
        folder = os.path.dirname(index)
        for shard in weight_map.values() if isinstance(weight_map, dict) else []:
            if isinstance(shard, str):
                shards.setdefault(f"{folder}/{shard}" if folder else shard, index)
    return shards


def verify_unlisted(snapshot: str, jobs: int) -> list[dict[str, object]]:
    """A snapshot nothing lists (no manifest, no cached tree, no Hub): each file present against the hash its
    blob is named by, and each shard an index names (a missing one is ``missing``). Not scan_cache_dir: it scans
    every model of a shared cache and drops a whole repo into its warnings over one broken link."""
    names = present_files(snapshot)
    rows = {str(r["file"]): r for r in verify(snapshot, {n: {} for n in names}, jobs)}
    for shard, index in shards_named(snapshot, names).items():
        if shard not in rows:
            rows[shard] = {"file": shard, "status": "missing", "detail": f"{index} names it; not in the snapshot"}
    return [rows[name] for name in sorted(rows)]


def repair(args: argparse.Namespace, token: str | None, snapshot: str, listing: dict[str, dict[str, object]],
           files: list[dict[str, object]]) -> bool:
    """Remove bad files (their link and blob) and download them again, once."""
    import huggingface_hub as hub

    bad = [str(r["file"]) for r in files if r["status"] != "ok"]
    for name in bad:
        path = os.path.join(snapshot, name)
        blob = os.path.realpath(path) if os.path.islink(path) else None
        for p in (path, blob):
            if p:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    try:
        hub.snapshot_download(args.repo, revision=os.path.basename(snapshot), cache_dir=args.cache, token=token)
    except Exception:  # noqa: BLE001 - the second check reports what is still wrong
        return True
    return True


def exit_with_parent() -> None:
    """End this worker when pbstk (or the SSH session that started it) is gone: it runs in a session of its own,
    so nothing else would stop a download that nobody will read the answer of."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    exit_with_parent()
    parser = argparse.ArgumentParser(prog="stage_weights")
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", default="main")
    parser.add_argument("--cache", required=True, help="the hub cache directory (HF_HOME/hub)")
    parser.add_argument("--verify-only", action="store_true")
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    inputs = globals().get("PBSTK_INPUT") or {}
    token = inputs.get("token") if isinstance(inputs, dict) else None
    try:
        result = stage(args, token or None)
    except OSError as exc:
        kind, message = classify(exc, bool(token))
        result = {"repo": args.repo, "ok": False, "error": {"kind": kind, "message": message}}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
