"""Image+text load for vision-language models (perf/images.py): ``bench``/``tune --images N --image-size WxH``.

The built-in client sends chat messages with N base64 PNGs, which the stand-in vLLM counts as prompt tokens and
refuses, as vLLM does, beyond the server's ``--limit-mm-per-prompt`` (so a ``--text-only`` server turns image load
away); ``vllm bench serve`` gets its ``random-mm`` dataset through the chat endpoint.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from helpers import pbstk

from pbs_toolkit.perf.bench import vllm_bench_argv
from pbs_toolkit.perf.images import ImageLoad, image_load, png_noise

VL_CONFIG = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
             "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 2048, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936},
             "vision_config": {"depth": 24, "hidden_size": 1024, "model_type": "qwen3_vl"}, "image_token_id": 151655}
IMAGE_TOKENS = 64  # what the stand-in counts for an image


@pytest.fixture
def vl_model(tmp_path: Path) -> str:
    model = tmp_path / "models" / "qwen3-vl-shaped"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(VL_CONFIG))
    return str(model)


def launch(model: str, name: str, *extra: str) -> str:
    res = pbstk("launch", model, "--profile", "local-gpu", "--preset", "single", "--name", name, "--port", "auto",
                "--wait", "--timeout", "60", "--json", *extra)
    assert res.exit_code == 0, res.output
    return str(json.loads(res.stdout)["job_id"])


def bench(job: str, *extra: str) -> tuple[int, dict]:
    res = pbstk("bench", job, "--client", "builtin", "-c", "2", "--num-prompts", "4", "--input-len", "8",
                "--output-len", "5", "--json", *extra)
    return res.exit_code, (json.loads(res.stdout) if res.exit_code == 0 else {"output": res.output})


def test_png_noise_is_a_png_of_the_size_asked() -> None:
    png = png_noise(7, 3, seed=1)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    assert (width, height, depth, colour) == (7, 3, 8, 2)
    length = struct.unpack(">I", png[33:37])[0]
    assert png[37:41] == b"IDAT"
    raw = zlib.decompress(png[41:41 + length])
    assert len(raw) == 3 * (1 + 7 * 3) and png.endswith(b"IEND\xaeB`\x82")
    assert png_noise(7, 3, seed=2) != png  # every request its own pixels: no encoder-cache hit between requests


def test_image_load_parses_and_refuses() -> None:
    assert image_load(0, "512x512") is None
    assert image_load(2, "640x480") == ImageLoad(count=2, height=480, width=640)
    for bad in ("512", "0x10", "10x5000", "axb"):
        with pytest.raises(Exception, match="--image-size"):
            image_load(1, bad)


def test_vllm_bench_gets_its_multimodal_dataset_through_the_chat_endpoint() -> None:
    argv = vllm_bench_argv("http://n1:8000/v1", "m", "tok", 4, 16, 128, 256, "/r", "f.json",
                           images=ImageLoad(count=2, height=480, width=640))
    joined = " ".join(argv)
    assert "--backend openai-chat --endpoint /v1/chat/completions --dataset-name random-mm" in joined
    assert argv[argv.index("--random-mm-base-items-per-request") + 1] == "2"
    assert argv[argv.index("--random-mm-limit-mm-per-prompt") + 1] == '{"image": 2, "video": 0}'
    assert argv[argv.index("--random-mm-bucket-config") + 1] == "{(480, 640, 1): 1.0}"
    assert argv.count("--dataset-name") == 1 and "random" not in argv
    plain = vllm_bench_argv("http://n1:8000/v1", "m", "tok", 4, 16, 128, 256, "/r", "f.json")
    assert plain[plain.index("--dataset-name") + 1] == "random" and "--backend" not in plain


def test_bench_sends_images_and_a_text_only_server_refuses_them(standins: Path, vl_model: str) -> None:
    job = launch(vl_model, "vl")
    try:
        rc, text = bench(job)
        assert rc == 0, text
        rc, shown = bench(job, "--images", "2", "--image-size", "64x48")
        assert rc == 0, shown
        level = shown["results"][0]
        assert level["completed"] == 4 and level["failed"] == 0 and level["total_output_tokens"] == 20
        # the chat stream's opening role chunk is not a token: 5 tokens, 5 chunks counted
        per_request = level["total_input_tokens"] / 4
        assert per_request - text["results"][0]["total_input_tokens"] / 4 >= 2 * IMAGE_TOKENS
    finally:
        pbstk("cancel", job)
    job = launch(vl_model, "vl-text", "--text-only")
    try:
        assert bench(job)[0] == 0
        rc, shown = bench(job, "--images", "1")
        assert rc != 0 and "At most 0 image(s)" in shown["output"]
    finally:
        pbstk("cancel", job)


def test_bench_refuses_bad_image_options_in_one_line(standins: Path) -> None:
    for args, what in ((("--images", "65"), "--images 65 is out of range"),
                       (("--images", "1", "--image-size", "big"), "--image-size must be WIDTHxHEIGHT")):
        res = pbstk("bench", "nosuchjob", *args)
        assert res.exit_code == 2, res.output
        assert res.output.strip().splitlines()[-1].startswith("pbstk: error: ") and what in res.output


def test_a_tune_report_says_its_load_carried_images_and_keeps_other_loads_apart() -> None:
    from pbs_toolkit.errors import UsageError
    from pbs_toolkit.perf.tune import TuneReport, merge, render_table

    with_images = TuneReport(model="m", concurrencies=[1], input_len=128, output_len=256,
                             other={"images": {"count": 1, "height": 512, "width": 512}})
    assert "128 in + 1 image of 512x512 a request / 256 out tokens" in render_table(with_images)
    text_only = TuneReport(model="m", concurrencies=[1], input_len=128, output_len=256)
    assert "128 in / 256 out" in render_table(text_only)
    with pytest.raises(UsageError, match="images differ"):
        merge(text_only, with_images)
    loaded = TuneReport.from_dict(json.loads(json.dumps(with_images.to_dict())))
    assert loaded.other["images"] == {"count": 1, "height": 512, "width": 512}
