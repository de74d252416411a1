"""``auto`` sizes the layout from what it can read about the model, and says so when it cannot.

Before: a local 70B-shaped checkpoint rendered for Polaris (a profile with an ``ssh_host``, so nothing was read)
got DP4 on 40 GB A100s, an OOM after the queue; a Hub id cached under the profile's ``hf_home`` was not found;
a model of unknown size got one replica per GPU without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers import pbstk

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "torch_dtype": "bfloat16"}


def _plan(model: str, *args: str) -> dict[str, object]:
    result = pbstk("presets", "show", "auto", "--model", model, *args, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def _checkpoint(path: Path, config: dict[str, object], total_size: int | None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if total_size is not None:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total_size},
                                                                       "weight_map": {}}))
    return path


def test_local_70b_checkpoint_for_polaris_is_not_dp4(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "llama70", LLAMA_70B, 141_107_412_992)
    plan = _plan(str(model), "--profile", "polaris")
    assert plan["params_b"] is not None and plan["tensor_parallel"] == 4, plan  # weights split over the node ...
    assert plan["pipeline_parallel"] == 2 and plan["data_parallel"] == 1, plan  # ... and 141 GB needs two nodes
    rendered = pbstk("render", str(model), "--profile", "polaris", "--account", "proj", "--nodes", "1")
    assert rendered.exit_code == 2 and "--nodes 1 is too few" in rendered.stderr, rendered.output
    assert len(rendered.stderr.strip().splitlines()) == 1


def test_weights_index_sizes_a_checkpoint_without_dimensions(tmp_path: Path) -> None:
    """A quantized or unusual config: the bytes on disk still tell the size (30 GB of bf16 = 15B: TP2)."""
    model = _checkpoint(tmp_path / "odd", {"torch_dtype": "bfloat16"}, 30_000_000_000)
    plan = _plan(str(model), "--profile", "generic-pbspro")
    assert plan["params_b"] == 15.0 and plan["tensor_parallel"] == 2, plan


def test_hub_id_found_in_the_profiles_hf_home(tmp_path: Path) -> None:
    snapshot = tmp_path / "hf" / "hub" / "models--acme--mystery" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_70B))
    result = pbstk("render", "acme/mystery", "--profile", "generic-pbspro", "--hf-home", str(tmp_path / "hf"),
                   "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "TP4", result.stdout
    assert "size unknown" not in result.stderr


def test_unknown_size_is_a_note_not_silence() -> None:
    result = pbstk("render", "acme/mystery", "--profile", "generic-pbspro")
    assert result.exit_code == 0, result.output
    assert "pbstk: note: model size unknown" in result.stderr, result.stderr
    known = pbstk("render", "acme/mystery-7B", "--profile", "generic-pbspro")
    assert "size unknown" not in known.stderr


class _Hub:
    """A loopback stand-in of the Hub's file API (``/{repo}/resolve/main/{file}``): what it serves, who asked."""

    def __init__(self, files: dict[str, dict[str, object]], gated: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.asked: list[tuple[str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hub.asked.append((self.path, self.headers.get("Authorization")))
                repo = self.path.split("/resolve/")[0].lstrip("/")
                body = files.get(self.path)
                if repo in gated and self.headers.get("Authorization") != "Bearer hf_good":
                    self.send_response(401)
                    self.end_headers()
                    return
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body or {"error": "not found"}).encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_hub_id_in_no_cache_is_sized_from_the_hubs_own_files(tmp_path: Path, monkeypatch: Any) -> None:
    """Not cached here: config.json and the weights index come from the Hub's HTTP API ($HF_ENDPOINT), with
    $HF_TOKEN as a header for a gated repository; without the token, the size is unknown and the note says so."""
    files = {"/acme/big/resolve/main/config.json": LLAMA_70B,
             "/acme/big/resolve/main/model.safetensors.index.json": {"metadata": {"total_size": 141_107_412_992}},
             "/acme/gated/resolve/main/config.json": LLAMA_70B}
    hub = _Hub(files, gated={"acme/gated"})
    try:
        monkeypatch.setenv("PBSTK_HUB_LOOKUP", "1")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        plan = _plan("acme/big", "--profile", "polaris")
        assert (plan["params_b"], plan["tensor_parallel"], plan["pipeline_parallel"]) == (70.554, 4, 2), plan
        assert [p for p, _ in hub.asked] == list(files)[:2]

        unknown = pbstk("render", "acme/gated", "--profile", "generic-pbspro", "--json")
        assert unknown.exit_code == 0 and "model size unknown" in unknown.stderr, unknown.output
        monkeypatch.setenv("HF_TOKEN", "hf_good")
        known = pbstk("render", "acme/gated", "--profile", "generic-pbspro", "--json")
        assert json.loads(known.stdout)["layout"] == "TP4" and "size unknown" not in known.stderr, known.output
        assert hub.asked[-1][1] == "Bearer hf_good"

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: nothing is asked
        asked = len(hub.asked)
        assert "model size unknown" in pbstk("render", "acme/big", "--profile", "generic-pbspro").stderr
        assert len(hub.asked) == asked
    finally:
        hub.server.shutdown()
