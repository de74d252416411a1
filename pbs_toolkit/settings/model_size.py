"""What ``auto`` knows about a model's size: its ``config.json`` from the Hugging Face cache, and the weights' bytes
on disk (``model.safetensors.index.json``'s ``metadata.total_size``, else one ``model.safetensors``); for a Hub id
that is in no cache here, the same two files from the Hub's HTTP API (:func:`hub_lookup`).

The bytes on disk are the best measure of the memory the weights take (quantized checkpoints included); the
parameter count from ``config.json`` times the dtype's bytes comes next; a size in the name last. A model
whose size stays unknown gets a note at render and launch time instead of a silent guess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.transports.base import Runner

INDEX_FILE = "model.safetensors.index.json"
#: no checkpoint is larger (a 10T-parameter fp32 model is 40 TB); a larger total_size is junk
_MAX_BYTES = 10**14


def hf_cache_config(model: str, hf_home: str | None = None) -> dict[str, Any] | None:
    """``config.json`` of Hub id ``model`` if it is in a local Hugging Face cache: the profile's ``hf_home`` when
    it exists on this machine, then ``$HF_HOME``, then ``~/.cache/huggingface``."""
    homes = [hf_home, os.environ.get("HF_HOME"), str(Path.home() / ".cache" / "huggingface")]
    for home in dict.fromkeys(os.path.expanduser(h) for h in homes if h):
        snapshots = Path(home) / "hub" / ("models--" + model.replace("/", "--")) / "snapshots"
        try:
            configs = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
        except OSError:  # a name too long to look up is simply not in the cache
            configs = []
        for config in configs:
            try:
                data = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                return data
    return None


def checkpoint_bytes(model_dir: str, runner: Runner | None) -> int | None:
    """Bytes of the weights in ``model_dir`` (read through ``runner``, else on this machine), or ``None``."""

    def read(name: str) -> bytes:
        path = f"{model_dir.rstrip('/')}/{name}"
        return runner.read_bytes(path) if runner is not None else Path(path).read_bytes()

    try:
        index = json.loads(read(INDEX_FILE))
        total = index.get("metadata", {}).get("total_size") if isinstance(index, dict) else None
    except (OSError, ValueError, AttributeError):
        total = None
    if total is None:
        path = f"{model_dir.rstrip('/')}/model.safetensors"
        try:
            total = runner.size(path) if runner is not None else os.path.getsize(path)
        except OSError:
            total = None
    return _weight_bytes(total)


def _weight_bytes(total: object) -> int | None:
    """A weights index's ``total_size`` if it is a plausible byte count, else ``None``."""
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total <= _MAX_BYTES:
        return None
    return total


def hub_lookup(model: str) -> tuple[dict[str, Any] | None, int | None]:
    """``(config.json, weights bytes)`` of Hub id ``model`` from the Hub's HTTP API (``$HF_ENDPOINT``, else
    huggingface.co; ``$HF_TOKEN`` as a header for gated models), each ``None`` when it cannot be had. Asked only
    where pbstk runs, never on a compute node, and not at all with ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` set
    or ``PBSTK_HUB_LOOKUP=0``; ``PBSTK_HUB_TIMEOUT`` seconds per file (default 3): a slow Hub costs a launch that
    much, then ``auto`` says the size is unknown."""
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline or os.environ.get("PBSTK_HUB_LOOKUP", "1") == "0":
        return None, None
    import httpx

    base = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = env_float("PBSTK_HUB_TIMEOUT", 3.0, lambda v: 0 < v <= 60)
    with httpx.Client(timeout=timeout, headers=headers, follow_redirects=True) as http:

        def get(name: str) -> dict[str, Any] | None:
            try:
                answer = http.get(f"{base}/{model}/resolve/main/{name}")
                data = answer.json() if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            return data if isinstance(data, dict) else None

        config = get("config.json")
        if config is None:  # gated, missing, unreachable: the index is not worth a second wait
            return None, None
        meta = (get(INDEX_FILE) or {}).get("metadata")
    return config, _weight_bytes(meta.get("total_size") if isinstance(meta, dict) else None)


def json_file(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or ``None`` (missing, unreadable, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_weights(model: str, model_path: str, runner: Runner | None) -> int | None:
    """Bytes of a model directory's weights (its safetensors index), read where the directory is."""
    if model_path.startswith("/"):
        return checkpoint_bytes(model_path, runner if runner is not None and runner.name != "local" else None)
    if model.startswith("/"):  # rendered for a remote host without connecting: the same path here, if shared
        return checkpoint_bytes(model, None)
    return None


UNKNOWN_SIZE_NOTE = ("model size unknown (no config.json or weights index readable here, no size in its name): "
                     "auto gave every GPU its own replica, which a model over ~7B will not fit; pass --preset "
                     "(e.g. tp4) or set gpu_memory_gb in the profile with a readable model directory")
