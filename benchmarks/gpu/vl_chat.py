"""Chat with a vision-language model through an endpoint registry, as an evaluation would: the `openai` client,
the entry that `pbstk update-endpoint` wrote (model, URL, the NAME of the key's variable), a base64 image.

    python3 benchmarks/gpu/vl_chat.py configs/endpoints.py ALIAS [--images N]

Prints one line per request (what was sent, HTTP outcome, prompt and completion tokens, the answer's start):
a text-only chat, then a chat with N images. The image request's prompt tokens minus the text request's are the
image's tokens as the server counted them (the vision encoder ran). Exit 0 when every request answered; a
server that refuses images (`--text-only`) exits 3 with vLLM's message.
"""

from __future__ import annotations

import argparse
import ast
import base64
import os
import sys
import time

import openai

from pbs_toolkit.perf.images import png_noise  # one PNG writer: the benchmarks' (PYTHONPATH: the checkout)


def registry_entry(path: str, alias: str) -> dict[str, str]:
    """The alias's entry of a verifiers-style ``ENDPOINTS = {...}`` file, read without running it."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ENDPOINTS" for t in node.targets):
            found = ast.literal_eval(node.value)
    return found[alias]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("registry")
    parser.add_argument("alias")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    entry = registry_entry(args.registry, args.alias)
    print(f"registry {args.registry}: {args.alias} -> model {entry['model']!r}, url {entry['url']}, "
          f"key from ${entry['key']}")
    client = openai.OpenAI(base_url=entry["url"], api_key=os.environ[entry["key"]], max_retries=0)
    images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
               + base64.b64encode(png_noise(args.size, args.size, seed)).decode()}} for seed in range(args.images)]
    text = "Describe this image in one sentence."
    asks = [("text only", text), (f"{args.images} image(s) of {args.size}x{args.size}",
                                  [{"type": "text", "text": text}, *images])]
    prompt_tokens = []
    for label, content in asks:
        started = time.perf_counter()
        try:
            answer = client.chat.completions.create(model=entry["model"], max_tokens=32,
                                                    messages=[{"role": "user", "content": content}])
        except openai.APIStatusError as exc:
            print(f"{label}: HTTP {exc.status_code} in {time.perf_counter() - started:.2f} s: {exc.message}")
            return 3
        usage = answer.usage
        prompt_tokens.append(usage.prompt_tokens if usage else 0)
        said = (answer.choices[0].message.content or "")[:60].replace("\n", " ")
        print(f"{label}: HTTP 200 in {time.perf_counter() - started:.2f} s, prompt {prompt_tokens[-1]} tokens, "
              f"completion {usage.completion_tokens if usage else '?'} tokens, answer starts {said!r}")
    print(f"image tokens the server counted: {prompt_tokens[1] - prompt_tokens[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
