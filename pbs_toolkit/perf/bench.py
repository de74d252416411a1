"""Load generation against an OpenAI-compatible server, and helpers for ``vllm bench serve``.

:func:`run_benchmark` streams ``/v1/completions`` with a fixed number of requests in flight and reports the
numbers ``vllm bench serve --save-result`` writes, under the same names, so results from either compare.
Failed requests are counted, never averaged in as zero latencies.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import ServerFailed, UsageError
from pbs_toolkit.perf.images import ImageLoad

#: how many distinct error messages a result keeps
MAX_ERRORS = 10

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass
class BenchResult:
    """Benchmark numbers, named like the JSON of ``vllm bench serve --save-result``.

    Latencies in milliseconds; ``None`` where nothing was measured (e.g. TPOT when every request produced
    a single token).
    """

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    mean_e2el_ms: float | None
    max_concurrency: int | None
    errors: list[str] = field(default_factory=list)
    #: the builtin client's, and ``vllm bench serve``'s where its ``--percentile-metrics`` named ``e2el``
    p99_e2el_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return without_unmeasured(asdict(self))


#: statistics added after results were first saved: written only where measured, so older files round-trip unchanged
LATER_STATS = ("p99_e2el_ms",)


def without_unmeasured(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` less each of :data:`LATER_STATS` that is ``None``."""
    return {k: v for k, v in stats.items() if not (k in LATER_STATS and v is None)}


@dataclass
class Outcome:
    """One request's fate (picklable: a run split between processes sends them back)."""

    ok: bool
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def make_prompt(input_len: int, seed: int) -> str:
    """About ``input_len`` tokens of random common words (one token each in most tokenizers)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(input_len, 1)))


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in 0..100."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms_stats(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    return (
        1000.0 * sum(values) / len(values),
        1000.0 * _percentile(values, 50),
        1000.0 * _percentile(values, 99),
    )


def _root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    if url.endswith("/v1"):  # accept the OpenAI-style base URL too
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"base URL must start with http:// or https://: {base_url!r}")
    return url


def _carries_tokens(message: dict[str, Any]) -> bool:
    """A stream chunk with generated tokens (a chat stream's first chunk names the role and carries none)."""
    choices = message.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return "role" not in (choices[0].get("delta") or {})


async def _one_request(client: Any, url: str, body: bytes, headers: dict[str, str]) -> Outcome:
    """One streamed request of ``body`` (JSON, encoded already: encoding a request with a 1 MB image took the
    client ~5 ms of CPU, inside the clock when done here)."""
    import httpx

    start = time.perf_counter()
    outcome = Outcome(ok=False)
    chunks = 0
    usage_tokens: int | None = None
    last = start
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                answer = (await response.aread()).decode("utf-8", "replace").strip()
                outcome.error = f"HTTP {response.status_code} from {url}: {answer[:300]}"
                return outcome
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if not isinstance(message, dict):
                    continue
                if message.get("error"):
                    outcome.error = f"error in stream from {url}: {message['error']}"
                    return outcome
                now = time.perf_counter()
                if _carries_tokens(message):
                    if chunks == 0:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = message.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    outcome.prompt_tokens = usage.get("prompt_tokens", 0) or 0
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        outcome.error = f"{type(exc).__name__} from {url}: {exc}"
        return outcome
    if chunks == 0:
        outcome.error = f"no tokens streamed from {url}"
        return outcome
    outcome.e2e = time.perf_counter() - start
    outcome.output_tokens = usage_tokens if usage_tokens is not None else chunks
    outcome.ok = True
    return outcome


def request_bodies(model: str, indices: Sequence[int], *, input_len: int, output_len: int, seed: int = 0,
                   images: ImageLoad | None = None) -> list[bytes]:
    """The encoded JSON bodies of requests ``indices`` of a run seeded ``seed`` (a request's text and images follow
    from its index alone, so a run split between processes sends what one process would)."""
    bodies = []
    for index in indices:
        prompt = make_prompt(input_len, seed * 1_000_003 + index)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": output_len,
            "min_tokens": output_len,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if images:
            body["messages"] = [{"role": "user", "content": images.chat_content(prompt, seed * 1_000_003 + index)}]
        else:
            body["prompt"] = prompt
        bodies.append(json.dumps(body).encode())
    return bodies


def request_url(base_url: str, images: ImageLoad | None) -> str:
    return _root_url(base_url) + ("/v1/chat/completions" if images else "/v1/completions")


async def drive(url: str, bodies: Sequence[bytes], *, api_key: str | None, concurrency: int, timeout: float,
                transport: Any = None) -> tuple[list[Outcome], float]:
    """Send ``bodies``, at most ``concurrency`` at a time; their outcomes and the seconds it took."""
    import httpx

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def limited(client: httpx.AsyncClient, body: bytes) -> Outcome:
        async with semaphore:
            return await _one_request(client, url, body, headers)

    started = time.perf_counter()
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout), limits=limits, transport=transport,
        trust_env=False,  # the endpoint is a node or a tunnel: a site's http_proxy cannot reach it
    ) as client:
        outcomes = await asyncio.gather(*(limited(client, body) for body in bodies))
    return list(outcomes), time.perf_counter() - started


def check_load(concurrency: int, num_prompts: int, input_len: int, output_len: int) -> None:
    if concurrency < 1 or num_prompts < 1 or input_len < 1 or output_len < 1:
        raise UsageError("concurrency, num_prompts, input_len and output_len must be at least 1")


async def run_benchmark(
    base_url: str,
    model: str,
    *,
    api_key: str | None = None,
    concurrency: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    timeout: float = 600,
    transport: Any = None,
    seed: int = 0,
    images: ImageLoad | None = None,
) -> BenchResult:
    """Send ``num_prompts`` streaming completions, at most ``concurrency`` at a time, and measure them.

    ``base_url`` is the server root (``http://host:port``; a trailing ``/v1`` is accepted). ``transport`` is
    passed to ``httpx.AsyncClient`` (tests use it). With ``images`` every request is a chat message with the
    text and those images. Raises ``ServerFailed`` when every request failed.
    """
    check_load(concurrency, num_prompts, input_len, output_len)
    url = request_url(base_url, images)
    # every request is made, and encoded, before the clock starts: a 512x512 image takes the client ~17 ms, 512 of
    # them 9 s, which the level's duration (and the first requests' wait) must not count
    bodies = request_bodies(model, range(num_prompts), input_len=input_len, output_len=output_len, seed=seed,
                            images=images)
    outcomes, duration = await drive(url, bodies, api_key=api_key, concurrency=concurrency, timeout=timeout,
                                     transport=transport)
    return summarize(outcomes, duration, concurrency, input_len)


def summarize(
    outcomes: Sequence[Outcome], duration: float, concurrency: int, input_len: int
) -> BenchResult:
    good = [o for o in outcomes if o.ok]
    errors: list[str] = []
    for outcome in outcomes:
        if not outcome.ok and outcome.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(outcome.error)
    if not good:
        raise ServerFailed(
            f"all {len(outcomes)} benchmark requests failed: {errors[0] if errors else 'unknown error'}",
            details=errors[1:],
        )
    input_tokens = sum(o.prompt_tokens or input_len for o in good)
    output_tokens = sum(o.output_tokens for o in good)
    ttft = _ms_stats([o.ttft for o in good])
    tpot = _ms_stats([(o.e2e - o.ttft) / (o.output_tokens - 1) for o in good if o.output_tokens > 1])
    itl = [gap for o in good for gap in o.itl]
    e2e = [o.e2e for o in good]
    return BenchResult(
        duration=duration,
        completed=len(good),
        failed=len(outcomes) - len(good),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(good) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        mean_ttft_ms=ttft[0],
        median_ttft_ms=ttft[1],
        p99_ttft_ms=ttft[2],
        mean_tpot_ms=tpot[0],
        median_tpot_ms=tpot[1],
        p99_tpot_ms=tpot[2],
        mean_itl_ms=1000.0 * sum(itl) / len(itl) if itl else None,
        mean_e2el_ms=1000.0 * sum(e2e) / len(e2e),
        max_concurrency=concurrency,
        errors=errors,
        p99_e2el_ms=_ms_stats(e2e)[2],
    )


def run_benchmark_sync(
    base_url: str,
    model: str,
    *,
    api_key: str | None = None,
    concurrency: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    timeout: float = 600,
    transport: Any = None,
    seed: int = 0,
    images: ImageLoad | None = None,
) -> BenchResult:
    """:func:`run_benchmark` for callers without an event loop."""
    return asyncio.run(
        run_benchmark(
            base_url,
            model,
            api_key=api_key,
            concurrency=concurrency,
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len,
            timeout=timeout,
            transport=transport,
            seed=seed,
            images=images,
        )
    )


def load_vllm_bench_json(path: str | Path) -> BenchResult:
    """Read a ``vllm bench serve --save-result`` file. Raises ``UsageError`` when it is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read benchmark result {path}: {exc}") from exc
    return parse_vllm_bench_json(text, str(path))


def parse_vllm_bench_json(text: str, path: str) -> BenchResult:
    """The ``BenchResult`` in the text of a ``vllm bench serve`` result file (``path`` names it in errors)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"cannot read benchmark result {path}: {exc}") from exc
    if not isinstance(data, dict) or "completed" not in data or "duration" not in data:
        raise UsageError(f"{path} is not a vllm bench serve result (no 'completed'/'duration')")

    def number(key: str) -> float | None:
        value = data.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    errors: list[str] = []
    for error in data.get("errors") or []:
        if error and error not in errors and len(errors) < MAX_ERRORS:
            errors.append(str(error))
    completed = int(data["completed"])
    failed = data.get("failed")
    if not isinstance(failed, int):
        failed = sum(1 for error in data.get("errors") or [] if error)
    max_concurrency = data.get("max_concurrency")
    return BenchResult(
        duration=float(data["duration"]),
        completed=completed,
        failed=failed,
        total_input_tokens=int(data.get("total_input_tokens") or 0),
        total_output_tokens=int(data.get("total_output_tokens") or 0),
        request_throughput=number("request_throughput") or 0.0,
        output_throughput=number("output_throughput") or 0.0,
        total_token_throughput=number("total_token_throughput") or 0.0,
        mean_ttft_ms=number("mean_ttft_ms"),
        median_ttft_ms=number("median_ttft_ms"),
        p99_ttft_ms=number("p99_ttft_ms"),
        mean_tpot_ms=number("mean_tpot_ms"),
        median_tpot_ms=number("median_tpot_ms"),
        p99_tpot_ms=number("p99_tpot_ms"),
        mean_itl_ms=number("mean_itl_ms"),
        mean_e2el_ms=number("mean_e2el_ms"),
        max_concurrency=int(max_concurrency) if isinstance(max_concurrency, (int, float)) else None,
        errors=errors,
        p99_e2el_ms=number("p99_e2el_ms"),
    )


def vllm_bench_argv(
    base_url: str,
    model: str,
    tokenizer: str | None,
    concurrency: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    result_dir: str,
    result_filename: str,
    *,
    executable: Sequence[str] = ("vllm",),
    images: ImageLoad | None = None,
    warmups: int = 0,
    seed: int | None = None,
) -> list[str]:
    """The ``vllm bench serve`` command line for a random-dataset run saved as JSON (``random-mm`` through the
    chat endpoint with ``images``).

    The API key is not an argument: export ``OPENAI_API_KEY`` for the command. ``executable`` replaces
    ``vllm`` where the console script does not work (e.g. ``("python", "-m", "vllm.entrypoints.cli.main")``).
    ``warmups``: requests sent (at the same concurrency) before the measured ones, ``--num-warmups`` (vLLM >= 0.11.1).
    ``seed``: the dataset's ``--seed`` (vLLM's default, 0, gives every run the same prompts).
    """
    argv = [
        *executable,
        "bench",
        "serve",
        "--base-url",
        _root_url(base_url),
        "--model",
        model,
    ]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    argv += images.vllm_bench_args() if images else ["--dataset-name", "random"]
    argv += [
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_filename,
    ]
    if warmups > 0:
        argv += ["--num-warmups", str(warmups)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv
