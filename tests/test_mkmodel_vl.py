"""``benchmarks/gpu/mkmodel_vl.py``: the Qwen3-VL-2B-shaped checkpoint the GPU machines serve with
``--load-format dummy`` loads in transformers as that model: its config, its tokenizer with the vision special
tokens at the config's ids, its image processor and a chat template that renders image parts.

It runs in a Python with ``transformers``: this test venv's if it has one, else ``PBSTK_TEST_VLLM_VENV`` (the CPU
vLLM venv that ``scripts/test.sh`` makes and CI sets); skipped where neither has it. The full ``AutoProcessor`` also
needs ``torchvision`` (Qwen3-VL's video processor): the GPU image has it, the CPU vLLM venv does not (FACTS.md), so
there the tokenizer, image processor and template are checked one by one and the prompt's image tokens expanded
as the processor does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "mkmodel_vl.py"
#: read at import: the autouse fixture of conftest.py clears PBSTK_* for each test
VLLM_VENV = os.environ.get("PBSTK_TEST_VLLM_VENV", "")

CHECK = r"""
import json, sys
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

d = sys.argv[1]
cfg = AutoConfig.from_pretrained(d)
tok = AutoTokenizer.from_pretrained(d)
ids = {name: tok.convert_tokens_to_ids(name) for name in
       ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in this image ?"}]}]
image = Image.new("RGB", (300, 200), (200, 10, 10))
try:
    import torchvision  # noqa: F401  (Qwen3-VL's video processor needs it, so AutoProcessor does)
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(d)
except ImportError:
    proc = None
render = proc.apply_chat_template if proc is not None else tok.apply_chat_template
text = render(messages, add_generation_prompt=True, tokenize=False)
if proc is not None:
    inputs = proc(text=[text], images=[image], return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    grid = inputs["image_grid_thw"][0].tolist()
    merge = proc.image_processor.merge_size
else:
    improc = AutoImageProcessor.from_pretrained(d)
    grid = improc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    merge = improc.merge_size
    n = grid[0] * grid[1] * grid[2] // merge ** 2
    prompt = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"]
print(json.dumps({
    "config": type(cfg).__name__, "architectures": cfg.architectures, "model_type": cfg.model_type,
    "text": {k: getattr(cfg.text_config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "vocab_size")},
    "vision": {k: getattr(cfg.vision_config, k) for k in ("depth", "hidden_size", "out_hidden_size", "patch_size")},
    "config_ids": {"image": cfg.image_token_id, "video": cfg.video_token_id,
                   "vision_start": cfg.vision_start_token_id, "vision_end": cfg.vision_end_token_id},
    "ids": ids, "rendered": text, "prompt": prompt, "grid": grid, "merge": merge, "full_processor": proc is not None,
}))
"""


def _python_with_transformers() -> str | None:
    candidates = [sys.executable]
    if VLLM_VENV:
        candidates.append(str(Path(VLLM_VENV, "bin", "python")))
    for python in candidates:
        if Path(python).exists() and subprocess.run(  # noqa: S603
                [python, "-c", "import transformers, tokenizers, PIL"], capture_output=True).returncode == 0:
            return python
    return None


def test_mkmodel_vl_writes_a_qwen3_vl_2b_that_transformers_loads_with_images(tmp_path: Path) -> None:
    python = _python_with_transformers()
    if python is None:
        pytest.skip("no Python with transformers: neither this venv nor PBSTK_TEST_VLLM_VENV (scripts/test.sh sets it)")
    out = tmp_path / "qwen3-vl-2b"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    made = subprocess.run([python, str(SCRIPT), str(out)], capture_output=True, text=True, env=env,  # noqa: S603
                          timeout=600)
    assert made.returncode == 0, made.stderr
    for name in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.json"):
        assert (out / name).is_file(), name
    checked = subprocess.run([python, "-c", CHECK, str(out)], capture_output=True, text=True, env=env,  # noqa: S603
                             timeout=600)
    assert checked.returncode == 0, checked.stderr
    got = json.loads(checked.stdout.strip().splitlines()[-1])

    assert got["config"] == "Qwen3VLConfig" and got["architectures"] == ["Qwen3VLForConditionalGeneration"]
    # Qwen3-VL-2B-Instruct as published: the Qwen3-1.7B-shaped backbone and a 24-layer vision encoder
    assert got["text"] == {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                           "num_key_value_heads": 8, "vocab_size": 151936}
    assert got["vision"] == {"depth": 24, "hidden_size": 1024, "out_hidden_size": 2048, "patch_size": 16}
    ids, cfg_ids = got["ids"], got["config_ids"]
    assert (ids["<|image_pad|>"], ids["<|video_pad|>"]) == (cfg_ids["image"], cfg_ids["video"]) == (151655, 151656)
    assert (ids["<|vision_start|>"], ids["<|vision_end|>"]) == (cfg_ids["vision_start"], cfg_ids["vision_end"])
    assert (ids["<|im_start|>"], ids["<|im_end|>"]) == (151644, 151645)
    # the template renders the image part where the processor expands it, and ends on the assistant's turn
    assert got["rendered"].startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what")
    assert got["rendered"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    t, h, w = got["grid"]
    image_tokens = t * h * w // got["merge"] ** 2
    prompt = got["prompt"]
    assert image_tokens > 0 and prompt.count(cfg_ids["image"]) == image_tokens
    start = prompt.index(cfg_ids["vision_start"])
    assert prompt[start + 1 + image_tokens] == cfg_ids["vision_end"]
    assert prompt[0] == ids["<|im_start|>"]
