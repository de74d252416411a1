"""Write a Qwen3-shaped model directory of a given size (its public config.json dimensions and a word-level
tokenizer of Qwen3's vocabulary size; no weights: serve it with --load-format dummy) on a GPU machine that reaches
no model hub. Sizes: 0.6b, 1.7b (the text backbone of Qwen3-VL-2B), 4b, 8b, 14b.

    python3 benchmarks/gpu/mkmodel_qwen3.py 4b /root/qwen3-4b

Needs `tokenizers` and `transformers` (vLLM's environment has both). Issue 31's multi-model runs use it
(benchmarks/gpu/run_models.sh).
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 151936
#: hidden, intermediate, layers, attention heads, KV heads, tied embeddings (Qwen3's published config.json files)
SHAPES = {
    "0.6b": (1024, 3072, 28, 16, 8, True),
    "1.7b": (2048, 6144, 28, 16, 8, True),
    "4b": (2560, 9728, 36, 32, 8, True),
    "8b": (4096, 12288, 36, 32, 8, False),
    "14b": (5120, 17408, 40, 40, 8, False),
}


def tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}<|im_start|>"
    fast.save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in SHAPES:
        print(f"usage: mkmodel_qwen3.py {{{','.join(SHAPES)}}} OUT_DIR", file=sys.stderr)
        return 2
    size, out = argv
    hidden, inter, layers, heads, kv, tied = SHAPES[size]
    os.makedirs(out, exist_ok=True)
    tokenizer(out)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 40960,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
              "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1, "eos_token_id": 3, "use_cache": True}
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    print(f"model dir ready: {out} (Qwen3-{size.upper()}-shaped, no weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
