"""Write a Qwen3-VL-2B-Instruct-shaped model directory without weights: serve it with ``--load-format dummy``.

    python3 benchmarks/gpu/mkmodel_vl.py DIR

For the lent GPU machines, which reach no model hub (python3.12, transformers, tokenizers; no network). DIR gets:

- ``config.json``: the public config of Qwen/Qwen3-VL-2B-Instruct (architecture Qwen3VLForConditionalGeneration,
  its ``text_config`` and ``vision_config`` as published), so vLLM builds the real vision encoder and text backbone
  and initialises random weights of the same size (same compute as the real model);
- ``preprocessor_config.json`` / ``video_preprocessor_config.json``: the published image and video processors;
- a word-level tokenizer whose vocabulary holds Qwen's special tokens at their real ids (``<|im_start|>`` 151644,
  ``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655 = the config's ``image_token_id``, ``<|video_pad|>``
  151656 ...), and a chat template (tokenizer and processor) that renders image and video parts the way Qwen's does
  (``<|vision_start|><|image_pad|><|vision_end|>``), so OpenAI chat requests with base64 images are accepted.

Text is not Qwen's BPE: words outside the small word list become ``<unk>``. Benchmarks use ``--ignore-eos`` and fixed
lengths, so what the random weights answer does not matter; image prompts cost what they cost on the real model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Qwen2/Qwen3's special tokens and their ids (the published tokenizer's ``added_tokens``)
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649,
    "<|quad_start|>": 151650, "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657,
    "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662, "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665,
    "</tool_response>": 151666, "<think>": 151667, "</think>": 151668,
}
UNK = "<unk>"
#: ordinary words (ids 1..): enough for chat roles and a few prompts; the rest of the ids below 151643 are fillers
WORDS = ("system user assistant you are a helpful what is in this image picture describe it the of and to "
         "hello hi yes no one two three . , ? ! : ' \" ( ) -").split()

CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
}
GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
              "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}

#: Qwen's chat format, image and video parts included (a shortened form of the published template: no tools)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def vocabulary() -> dict[str, int]:
    """Every id below the first special token holds a word (the listed ones first), then the special tokens."""
    first_special = min(SPECIAL_TOKENS.values())
    words = [UNK, *WORDS]
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), first_special)})
    vocab.update(SPECIAL_TOKENS)
    return vocab


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab=vocabulary(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    specials = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__)
    tok.add_special_tokens(specials)  # matched inside text too: "<|vision_start|><|image_pad|>..." has no spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials,
                                   model_max_length=262144, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # readable by transformers 4.x too (5.x writes its own class name and a list of extra special tokens)
    config_path = out / "tokenizer_config.json"
    tc = json.loads(config_path.read_text(encoding="utf-8"))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(tc.get("extra_special_tokens"), list):
        tc["additional_special_tokens"] = tc.pop("extra_special_tokens")
    tc["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    for name, data in (("config.json", CONFIG), ("preprocessor_config.json", PREPROCESSOR),
                       ("video_preprocessor_config.json", VIDEO_PREPROCESSOR),
                       ("generation_config.json", GENERATION),
                       ("chat_template.json", {"chat_template": CHAT_TEMPLATE})):
        (out / name).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    print("model dir ready", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
