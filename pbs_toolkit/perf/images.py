"""Image load for benchmarks of vision-language models: requests that carry images as well as text.

``pbstk bench --images N`` / ``pbstk tune --images N`` send N images of ``--image-size`` with every request. With
``vllm bench serve`` that is its ``random-mm`` dataset through the chat endpoint; the built-in client sends the
same shape of request: a chat message with the text and N base64 PNG images (random pixels, so no two requests
share an encoder cache entry). Pure: no I/O.
"""

from __future__ import annotations

import base64
import random
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.errors import UsageError

#: vLLM's own default for Qwen-VL image processors tops out far above this; 512x512 is a typical eval image
DEFAULT_SIZE = "512x512"
_MAX_SIDE = 4096


@dataclass(frozen=True)
class ImageLoad:
    """``count`` images of ``height`` x ``width`` pixels in every request."""

    count: int
    height: int
    width: int

    def describe(self) -> str:
        return f"{self.count} image{'s' if self.count != 1 else ''} of {self.width}x{self.height}"

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "height": self.height, "width": self.width}

    def vllm_bench_args(self) -> list[str]:
        """``vllm bench serve`` arguments for this load (its ``random-mm`` dataset, the chat backend)."""
        return [
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random-mm",
            "--random-mm-base-items-per-request", str(self.count),
            "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", f'{{"image": {self.count}, "video": 0}}',
            "--random-mm-bucket-config", f"{{({self.height}, {self.width}, 1): 1.0}}",
        ]

    def chat_content(self, text: str, seed: int) -> list[dict[str, Any]]:
        """One user message's content: the text, then the images as data URLs."""
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for index in range(self.count):
            png = png_noise(self.width, self.height, seed * 131 + index)
            url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        return parts


def image_load(count: int, size: str) -> ImageLoad | None:
    """The load for ``--images COUNT --image-size WxH``; None for text-only (COUNT 0). Bad values: UsageError."""
    if count < 0:
        raise UsageError(f"--images must be 0 or more, got {count}")
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", size)
    if not match:
        raise UsageError(f"--image-size must be WIDTHxHEIGHT in pixels (e.g. {DEFAULT_SIZE}), got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not (1 <= width <= _MAX_SIDE and 1 <= height <= _MAX_SIDE):
        raise UsageError(f"--image-size sides must be 1 to {_MAX_SIDE} pixels, got {size!r}")
    return ImageLoad(count, height, width) if count else None


def png_noise(width: int, height: int, seed: int) -> bytes:
    """A valid RGB PNG of random pixels (no imaging library needed)."""
    rng = random.Random(seed)
    row = width * 3
    raw = b"".join(b"\x00" + rng.randbytes(row) for _ in range(height))  # filter type 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")
