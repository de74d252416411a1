"""Regenerate the ``vllm-*-metrics*.txt`` samples in this folder: ``python3 make_metrics_samples.py``.

vLLM exports its metrics with ``prometheus_client``, so the samples are produced by the same library with
vLLM's metric names, labels and bucket bounds. ``_created`` timestamps are pinned so that the files
are stable.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

HERE = Path(__file__).parent
MODEL = "Qwen/Qwen3-1.7B"
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


class Server:
    """The metrics of one vLLM server; ``old`` uses the names of 0.11-era servers."""

    def __init__(self, old: bool, engines: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self.engines = engines
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        )
        kv_name = "vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc"
        self.kv = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        prefix = "vllm:gpu_prefix_cache" if old else "vllm:prefix_cache"
        self.queries = Counter(
            prefix + "_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.hits = Counter(
            prefix + "_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        )
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        itl_name = "vllm:time_per_output_token_seconds" if old else "vllm:inter_token_latency_seconds"
        self.itl = Histogram(
            itl_name, "Histogram of inter-token latency in seconds.", labels, buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tpot = (
            None
            if old
            else Histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                labels,
                buckets=ITL_BUCKETS,
                registry=r,
            )
        )
        for engine in engines:  # vLLM creates every child at start, so zero series exist before traffic
            for metric in (
                self.running,
                self.waiting,
                self.kv,
                self.queries,
                self.hits,
                self.preemptions,
                self.prompt,
                self.generation,
                self.ttft,
                self.itl,
                self.e2e,
                self.tpot,
            ):
                if metric is not None:
                    metric.labels(MODEL, engine)
            for reason in ("stop", "length", "abort"):
                self.success.labels(MODEL, engine, reason)

    def serve(
        self,
        engine: str,
        requests: int,
        prompt_len: int,
        output_len: int,
        ttft: float,
        itl: float,
        rng: random.Random,
    ) -> None:
        """Record ``requests`` finished requests with latencies jittered by up to 10%."""
        labels = (MODEL, engine)
        for _ in range(requests):
            first = ttft * rng.uniform(0.9, 1.1)
            gap = itl * rng.uniform(0.9, 1.1)
            self.ttft.labels(*labels).observe(first)
            for _ in range(output_len - 1):
                self.itl.labels(*labels).observe(gap)
            if self.tpot is not None:
                self.tpot.labels(*labels).observe(gap)
            self.e2e.labels(*labels).observe(first + gap * (output_len - 1))
        self.prompt.labels(*labels).inc(requests * prompt_len)
        self.generation.labels(*labels).inc(requests * output_len)
        self.success.labels(*labels, "length").inc(requests)
        self.queries.labels(*labels).inc(requests * prompt_len)
        self.hits.labels(*labels).inc(requests * prompt_len // 2)

    def write(self, name: str) -> None:
        text = generate_latest(self.registry).decode()
        text = re.sub(r"(_created\{[^}]*\}) \S+", r"\1 1.7637e+09", text)
        (HERE / name).write_text(text)


def main() -> None:
    rng = random.Random(7)

    old = Server(old=True, engines=("0",))
    old.serve("0", 40, 128, 64, ttft=0.09, itl=0.012, rng=rng)
    old.running.labels(MODEL, "0").set(3)
    old.kv.labels(MODEL, "0").set(0.042)
    old.write("vllm-0.11-metrics.txt")

    mid = Server(old=False, engines=("0",))
    mid.serve("0", 50, 128, 256, ttft=0.3, itl=0.03, rng=rng)
    mid.running.labels(MODEL, "0").set(64)
    mid.kv.labels(MODEL, "0").set(0.05)
    mid.write("vllm-0.22-metrics-t0.txt")
    # 10 s later: 100 more requests, TTFT ~50 ms, ITL ~8 ms; 64 running and 36 waiting
    mid.serve("0", 100, 128, 256, ttft=0.05, itl=0.008, rng=rng)
    mid.waiting.labels(MODEL, "0").set(36)
    mid.kv.labels(MODEL, "0").set(0.06)
    mid.write("vllm-0.22-metrics-t1.txt")

    new = Server(old=False, engines=("0", "1"))
    new.serve("0", 30, 1000, 100, ttft=0.2, itl=0.01, rng=rng)
    new.serve("1", 10, 1000, 100, ttft=0.2, itl=0.01, rng=rng)
    new.running.labels(MODEL, "0").set(5)
    new.running.labels(MODEL, "1").set(7)
    new.waiting.labels(MODEL, "1").set(2)
    new.kv.labels(MODEL, "0").set(0.10)
    new.kv.labels(MODEL, "1").set(0.30)
    new.preemptions.labels(MODEL, "1").inc(3)
    new.write("vllm-0.32-metrics-2engines.txt")


if __name__ == "__main__":
    main()
