"""The load generator against a small OpenAI-compatible streaming server run in a thread."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from pbs_toolkit.errors import ServerFailed, UsageError
from pbs_toolkit.perf.bench import (
    load_vllm_bench_json,
    make_prompt,
    run_benchmark_sync,
    vllm_bench_argv,
)
from pbs_toolkit.perf.benchjob import benchmark_ready_job, warmups_for
from pbs_toolkit.perf.images import ImageLoad
from pbs_toolkit.perf.load_procs import auto_processes, run_benchmark_procs, shares


class FakeVLLM(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` chunks; ``server.mode`` picks ok / 500 / flaky (every other request 500)."""

    server: FakeServer  # type: ignore[assignment]

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        with self.server.lock:
            self.server.active += 1
            self.server.peak = max(self.server.peak, self.server.active)
        try:
            self.answer()
        finally:
            with self.server.lock:
                self.server.active -= 1

    def answer(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
            number = len(self.server.requests)
        if self.server.api_key and self.headers.get("Authorization") != f"Bearer {self.server.api_key}":
            return self.reply(401, {"error": {"message": "Unauthorized", "code": 401}})
        if self.server.mode == "500" or (self.server.mode == "flaky" and number % 2 == 0):
            return self.reply(500, {"error": {"message": "boom", "code": 500}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for index in range(body["max_tokens"]):
            time.sleep(0.002)
            chunk = {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [{"index": 0, "text": f" w{index}"}],
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        if self.server.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"], "total_tokens": 0}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str = "ok", api_key: str | None = None, send_usage: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), FakeVLLM)
        self.mode, self.api_key, self.send_usage = mode, api_key, send_usage
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.active = self.peak = 0  # requests being answered now, and the most at once

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def serve() -> Iterator:
    servers: list[FakeServer] = []

    def start(**kwargs: object) -> FakeServer:
        server = FakeServer(**kwargs)  # type: ignore[arg-type]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bench(server: FakeServer, **kwargs: object):
    options = dict(api_key=None, concurrency=4, num_prompts=12, input_len=16, output_len=8, timeout=30)
    options.update(kwargs)
    return run_benchmark_sync(server.url, "fake", **options)  # type: ignore[arg-type]


def test_completed_requests_and_finite_numbers(serve):
    server = serve()
    result = bench(server)
    assert (result.completed, result.failed, result.errors) == (12, 0, [])
    assert result.total_output_tokens == 12 * 8 and result.total_input_tokens == 12 * 7  # from usage
    assert result.max_concurrency == 4
    numbers = {k: v for k, v in result.to_dict().items() if isinstance(v, float)}
    assert len(numbers) == 13 and all(math.isfinite(v) and v > 0 for v in numbers.values())
    # milliseconds, not seconds: the server sleeps 2 ms a chunk, so 7 gaps span >= 14 ms; a loaded machine may read
    # a request's first chunk late (shrinking its gaps), never by 10 ms on average over 12 requests
    assert result.mean_tpot_ms >= 0.5 and result.mean_itl_ms >= 0.5
    assert result.mean_e2el_ms > result.mean_ttft_ms
    sent = server.requests[0]
    assert sent["stream"] is True and sent["ignore_eos"] is True
    assert sent["max_tokens"] == sent["min_tokens"] == 8
    assert sent["stream_options"] == {"include_usage": True}
    assert len(sent["prompt"].split()) == 16
    assert len({r["prompt"] for r in server.requests}) == 12  # distinct prompts: no accidental prefix hits


def test_the_clock_leaves_out_making_the_requests(serve, monkeypatch: pytest.MonkeyPatch):
    # a 512x512 image costs the client ~17 ms: 512 of them made inside the level added 9 s to its duration (and so
    # cut its throughput) though the server had nothing to do yet. Here making 8 requests takes 2.4 s, serving them
    # at 2 at a time ~0.1 s.
    made = ImageLoad.chat_content

    def slow_chat_content(self: ImageLoad, text: str, seed: int) -> list:
        time.sleep(0.3)
        return made(self, text, seed)

    monkeypatch.setattr(ImageLoad, "chat_content", slow_chat_content)
    res = bench(serve(), concurrency=2, num_prompts=8, images=ImageLoad(count=1, height=4, width=4))
    assert res.completed == 8
    assert res.duration < 1.2, res.duration


def test_the_clock_leaves_out_encoding_the_requests(serve, monkeypatch: pytest.MonkeyPatch):
    # encoding a request that carries a 1 MB image cost the client ~5 ms of CPU in the level's time; here 0.3 s
    encode = json.dumps

    def slow_dumps(obj: object, *args: object, **kwargs: object) -> str:
        text = encode(obj, *args, **kwargs)  # type: ignore[arg-type]
        if isinstance(obj, dict) and "messages" in obj:  # a request, not the server's chunks
            time.sleep(0.3)
        return text

    monkeypatch.setattr(json, "dumps", slow_dumps)
    res = bench(serve(), concurrency=2, num_prompts=8, images=ImageLoad(count=1, height=4, width=4))
    assert res.completed == 8
    assert res.duration < 1.2, res.duration


def test_the_builtin_client_never_sends_a_prompt_twice_across_levels_and_warmups(serve):
    # a prompt (or image) sent again is served from vLLM's prefix (image) cache: a VL dp4's levels hit 60% (51%)
    server = serve()
    record = SimpleNamespace(transport="", served_model_name="fake", api_key=None, job_id="1.fake")
    # no address for /metrics: the level goes on without vLLM's own time (perf/server_time.py)
    st = SimpleNamespace(url=server.url + "/v1", record=record, address=None, port=None,
                         state=SimpleNamespace(value="READY"))
    results = benchmark_ready_job(st, [1, 4], input_len=16, output_len=8, num_prompts=None, rounds=2,
                                  client="builtin", runner=SimpleNamespace())
    assert [(r.concurrency, r.completed) for r in results] == [(1, 8), (4, 8)]
    prompts = [body["prompt"] for body in server.requests]
    assert len(prompts) == 1 + 8 + 4 + 8 and len(set(prompts)) == len(prompts)


def test_a_level_split_between_client_processes_sends_what_one_process_would(serve):
    # one client process tops out near 200 requests a second on a 2-core EPYC: a wide level is spread
    server = serve()
    res = run_benchmark_procs(server.url, "fake", processes=2, concurrency=3, num_prompts=10, input_len=16,
                              output_len=8, seed=7, timeout=30)
    assert (res.completed, res.failed, res.total_output_tokens, res.max_concurrency) == (10, 0, 80, 3)
    assert sorted(body["prompt"] for body in server.requests) == sorted(make_prompt(16, 7 * 1_000_003 + i)
                                                                        for i in range(10))
    assert server.peak <= 3 and res.duration > 0


def test_a_split_level_reports_failures_as_one_does(serve):
    with pytest.raises(ServerFailed, match="all 6 benchmark requests failed: HTTP 500"):
        run_benchmark_procs(serve(mode="500").url, "fake", processes=2, concurrency=2, num_prompts=6, input_len=4,
                            output_len=2, timeout=30)


def test_how_many_client_processes_a_level_gets():
    assert [auto_processes(c, cpus=64) for c in (1, 63, 64, 256)] == [1, 1, 4, 4]
    assert [auto_processes(256, cpus=n) for n in (1, 2, 7, 8, 16)] == [1, 1, 1, 2, 4]
    assert shares(256, 4) == [64] * 4 and shares(6, 4) == [2, 2, 1, 1]


def test_tokens_counted_from_chunks_without_usage(serve):
    result = bench(serve(send_usage=False), num_prompts=3, output_len=5)
    assert result.total_output_tokens == 15
    assert result.total_input_tokens == 3 * 16  # estimated from input_len


def test_partial_failures_are_counted_not_averaged(serve):
    result = bench(serve(mode="flaky"), concurrency=1, num_prompts=6)
    assert (result.completed, result.failed) == (3, 3)
    assert "HTTP 500" in result.errors[0] and len(result.errors) == 1
    assert result.mean_ttft_ms is not None and result.mean_ttft_ms > 0


def test_all_500_raises(serve):
    with pytest.raises(ServerFailed, match="500"):
        bench(serve(mode="500"))


def test_unauthorized_mentions_401_and_key_works(serve):
    server = serve(api_key="secret")
    with pytest.raises(ServerFailed, match="401"):
        bench(server, num_prompts=2)
    assert bench(server, api_key="secret", num_prompts=2).completed == 2


def test_connection_refused_is_a_failure():
    with pytest.raises(ServerFailed, match="ConnectError"):
        run_benchmark_sync(
            "http://127.0.0.1:9", "m", concurrency=1, num_prompts=1, input_len=1, output_len=1, timeout=5
        )


def test_bad_arguments():
    with pytest.raises(UsageError):
        run_benchmark_sync("http://h:1", "m", concurrency=0, num_prompts=1, input_len=1, output_len=1)
    with pytest.raises(UsageError):
        run_benchmark_sync("h:1", "m", concurrency=1, num_prompts=1, input_len=1, output_len=1)


def test_prompts_are_seeded():
    assert make_prompt(32, 1) == make_prompt(32, 1) != make_prompt(32, 2)


def test_vllm_bench_argv():
    argv = vllm_bench_argv(
        "http://n1:8000/v1/", "qwen3", "/models/qwen3", 64, 640, 128, 256, "/runs/r1", "c64.json"
    )
    assert argv[:3] == ["vllm", "bench", "serve"]
    assert argv[argv.index("--base-url") + 1] == "http://n1:8000"
    assert argv[argv.index("--tokenizer") + 1] == "/models/qwen3"
    assert argv[argv.index("--dataset-name") + 1] == "random"
    assert argv[argv.index("--max-concurrency") + 1] == "64"
    assert argv[argv.index("--random-output-len") + 1] == "256"
    assert "--ignore-eos" in argv and "--save-result" in argv
    assert argv[-4:] == ["--result-dir", "/runs/r1", "--result-filename", "c64.json"]
    assert "--tokenizer" not in vllm_bench_argv("http://n1:8000", "q", None, 1, 1, 1, 1, "d", "f")
    assert "--num-warmups" not in argv
    warm = vllm_bench_argv("http://n1:8000", "q", None, 64, 640, 1, 1, "d", "f", warmups=64)
    assert warm[warm.index("--num-warmups") + 1] == "64"


def test_warmups_fill_the_slots_up_to_a_bound_where_the_jobs_vllm_has_the_flag():
    assert [warmups_for(c, "0.22.1") for c in (1, 64, 256)] == [1, 64, 64]
    assert warmups_for(256, "") == 64 and warmups_for(8, "not-a-version") == 8  # unknown: the flag is tried
    assert warmups_for(8, "0.11.0") == 0 and warmups_for(8, "0.11.1") == 8  # vllm#26943 came in 0.11.1


def test_load_vllm_bench_json(tmp_path: Path):
    saved = {
        "date": "20251120-140000",
        "backend": "vllm",
        "model_id": "qwen3",
        "num_prompts": 640,
        "duration": 8.9,
        "completed": 639,
        "failed": 1,
        "total_input_tokens": 81792,
        "total_output_tokens": 163584,
        "request_throughput": 71.8,
        "output_throughput": 18380.2,
        "total_token_throughput": 27570.3,
        "mean_ttft_ms": 120.5,
        "median_ttft_ms": 100.1,
        "p99_ttft_ms": 410.0,
        "mean_tpot_ms": 3.1,
        "median_tpot_ms": 3.0,
        "p99_tpot_ms": 4.2,
        "mean_itl_ms": 3.1,
        "mean_e2el_ms": 911.0,
        "max_concurrency": 64,
        "errors": ["", "Bad Request"] + [""] * 638,
        "ttfts": [0.1] * 640,
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(saved))
    result = load_vllm_bench_json(path)
    assert (result.completed, result.failed, result.max_concurrency) == (639, 1, 64)
    assert result.output_throughput == 18380.2 and result.p99_tpot_ms == 4.2
    assert result.errors == ["Bad Request"]
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(UsageError):
        load_vllm_bench_json(tmp_path / "bad.json")
