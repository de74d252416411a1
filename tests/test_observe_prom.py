"""Prometheus parsing, rates and quantiles against recorded-format samples (tests/data/observe)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pbs_toolkit.errors import ServerFailed, UsageError
from pbs_toolkit.vllm.prom import (
    Histogram,
    delta,
    histogram_quantile,
    parse_metrics,
    rates,
    summarize,
)

DATA = Path(__file__).parent / "data" / "observe"


def load(name: str, timestamp: float = 0.0):
    return parse_metrics((DATA / name).read_text(), timestamp)


def test_old_names_fall_back():
    snap = load("vllm-0.11-metrics.txt")
    assert snap.kv_cache_usage == pytest.approx(0.042)  # from vllm:gpu_cache_usage_perc
    assert snap.itl is not None and snap.itl.count == 40 * 63  # from vllm:time_per_output_token_seconds
    assert snap.prefix_cache_queries == 40 * 128 and snap.prefix_cache_hits == 40 * 64  # gpu_prefix_cache_*
    assert snap.tpot is None
    assert snap.running == 3 and snap.waiting == 0
    assert snap.requests_success == 40  # summed over finished_reason label sets


def test_two_engines_are_summed():
    snap = load("vllm-0.32-metrics-2engines.txt")
    assert snap.engines == ["0", "1"]
    assert snap.model_names == ["Qwen/Qwen3-1.7B"]
    assert snap.running == 12 and snap.waiting == 2
    assert snap.prompt_tokens == 40 * 1000 and snap.generation_tokens == 40 * 100
    assert snap.preemptions == 3
    assert snap.kv_cache_usage == pytest.approx(0.2)  # mean of 0.10 and 0.30
    assert snap.kv_cache_usage_max == pytest.approx(0.3)
    assert snap.ttft is not None and snap.ttft.count == 40
    assert snap.ttft.buckets[-1] == (math.inf, 40)
    counts = [count for _, count in snap.ttft.buckets]
    assert counts == sorted(counts)  # cumulative


def test_rates_match_counters():
    t0 = load("vllm-0.22-metrics-t0.txt", 1000.0)
    t1 = load("vllm-0.22-metrics-t1.txt", 1010.0)
    result = rates(t0, t1)
    assert result["interval_s"] == 10.0
    assert result["prompt_tokens_per_s"] == pytest.approx((t1.prompt_tokens - t0.prompt_tokens) / 10)
    assert result["prompt_tokens_per_s"] == pytest.approx(100 * 128 / 10)
    assert result["generation_tokens_per_s"] == pytest.approx(100 * 256 / 10)
    assert result["requests_per_s"] == pytest.approx(10.0)


def test_rates_guard_counter_reset_and_order():
    t0 = load("vllm-0.22-metrics-t1.txt", 0.0)
    t1 = load("vllm-0.22-metrics-t0.txt", 5.0)  # counters went down: the server restarted
    assert rates(t0, t1)["requests_per_s"] == pytest.approx(50 / 5)
    with pytest.raises(UsageError):
        rates(t1, t0)


def test_summary_over_interval_sees_only_new_requests():
    t0 = load("vllm-0.22-metrics-t0.txt", 1000.0)
    t1 = load("vllm-0.22-metrics-t1.txt", 1010.0)
    cumulative = summarize(None, t1)
    window = summarize(t0, t1)
    json.dumps(window)  # JSON-ready
    assert window["window"] == "interval" and cumulative["rates"] is None
    # the second batch had TTFT 45-55 ms, the first ~300 ms
    assert 40 <= window["ttft_p50_ms"] <= 60
    assert window["ttft_p99_ms"] <= 60
    assert cumulative["ttft_p99_ms"] > 250
    assert window["itl_p50_ms"] <= 10
    assert window["kv_cache_usage_pct"] == pytest.approx(6.0)
    assert window["prefix_cache_hit_rate_pct"] == pytest.approx(50.0)
    assert window["waiting"] == 36
    for name in ("ttft", "itl", "e2e", "tpot"):
        assert window[f"{name}_p50_ms"] <= window[f"{name}_p90_ms"] <= window[f"{name}_p99_ms"]


def test_histogram_quantile_like_prometheus():
    buckets = [(0.1, 10.0), (0.2, 20.0), (0.5, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.75) == pytest.approx(0.15)
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.05)
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    # observations beyond the last finite bound report that bound
    assert histogram_quantile([(1.0, 1.0), (math.inf, 10.0)], 0.99) == 1.0
    with pytest.raises(UsageError):
        histogram_quantile(buckets, 1.5)


def test_histogram_delta_and_reset():
    prev = Histogram([(1.0, 2.0), (math.inf, 3.0)], sum=2.0, count=3.0)
    cur = Histogram([(1.0, 5.0), (math.inf, 7.0)], sum=6.0, count=7.0)
    diff = delta(prev, cur)
    assert diff.buckets == [(1.0, 3.0), (math.inf, 4.0)] and diff.count == 4 and diff.sum == 4.0
    assert delta(cur, prev) is prev  # reset: the later scrape is all new


def test_non_vllm_metrics_and_garbage():
    text = (DATA / "vllm-0.32-metrics-2engines.txt").read_text()
    text = (
        "# HELP python_gc_objects_collected_total Objects collected during gc\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 1234.0\n' + text
    )
    assert parse_metrics(text, 0).running == 12
    empty = parse_metrics("", 0)
    assert empty.running is None and empty.ttft is None
    assert summarize(None, empty)["ttft_p50_ms"] is None
    with pytest.raises(ServerFailed):
        parse_metrics("<html>not metrics</html>\n{{{", 0)


def test_combine_sums_servers_and_merges_their_histograms():
    """A service's aggregate: counters and gauges added, latency percentiles over every server's requests."""
    from pbs_toolkit.vllm.prom import MetricsSnapshot, combine

    fast = MetricsSnapshot(1.0, running=2, waiting=1, kv_cache_usage=0.2, kv_cache_usage_max=0.2, prompt_tokens=100,
                           generation_tokens=50, requests_success=10, engines=["0"], model_names=["m"],
                           ttft=Histogram([(0.1, 90.0), (1.0, 90.0), (math.inf, 90.0)], 4.5, 90.0))
    slow = MetricsSnapshot(2.0, running=1, waiting=None, kv_cache_usage=0.5, kv_cache_usage_max=0.6,
                           prompt_tokens=30, generation_tokens=20, requests_success=3, engines=["0", "1"],
                           model_names=["m"], ttft=Histogram([(0.1, 0.0), (1.0, 10.0), (math.inf, 10.0)], 8.0, 10.0))
    both = combine([fast, slow])
    assert (both.timestamp, both.running, both.waiting) == (2.0, 3, 1)
    assert (both.prompt_tokens, both.generation_tokens, both.requests_success) == (130, 70, 13)
    assert both.kv_cache_usage == pytest.approx((0.2 + 2 * 0.5) / 3)  # averaged over the three engines
    assert both.kv_cache_usage_max == 0.6 and both.engines == ["0:0", "1:0", "1:1"] and both.model_names == ["m"]
    assert both.ttft is not None and (both.ttft.count, both.ttft.sum) == (100.0, 12.5)
    assert both.ttft.quantile(0.5) == pytest.approx(0.1 * 50 / 90)  # 90 of 100 requests were fast
    assert both.ttft.quantile(0.95) == pytest.approx(0.1 + 0.9 * 5 / 10)
    assert both.itl is None and both.preemptions is None  # exported by neither
    assert combine([]).running is None


def test_router_figures_and_the_workers_doctor_names():
    """vllm-router 0.1.17's /metrics (its own exposition: blank lines between families; lines as it prints them,
    one worker's circuit opened by a killed backend): the figures ``metrics NAME`` shows and doctor's findings."""
    from pbs_toolkit.services.observe import router_summary, worker_findings
    from pbs_toolkit.services.router.metrics import parse_router_metrics

    text = (DATA / "vllm-router-0.1.17-metrics.txt").read_text()
    first = parse_router_metrics(text, 10.0)
    later = parse_router_metrics(text.replace("/v1/completions\"} 2", "/v1/completions\"} 12"), 12.0)
    out = router_summary(first, later, window=False)
    assert (out["requests_total"], out["retries_total"], out["retries_exhausted_total"]) == (17, 8, 2)
    assert out["requests_per_s"] == 5.0 and out["active_workers"] == 2 and out["window"] == "cumulative"
    assert out["workers"] == [
        {"url": "http://127.0.0.1:18123", "processed": 13, "healthy": False, "circuit": "open"},
        {"url": "http://127.0.0.1:18126", "processed": 4, "healthy": True, "circuit": "closed"}]
    assert out["duration_p50_ms"] == pytest.approx(10 + 15 * 1.5 / 5)  # 3.5th of 7 requests: in (10, 25] ms
    assert router_summary(first, later, window=True)["duration_p50_ms"] is None  # no request in the interval
    found = worker_findings("qwen", first, {"http://127.0.0.1:18126", "http://127.0.0.1:18999"})
    assert [(f.code, f.severity) for f in found] == [("replica-not-routed", "medium"), ("worker-unhealthy", "high")]
    assert "http://127.0.0.1:18999" in found[0].evidence and "circuit open" in found[1].evidence
    with pytest.raises(ServerFailed, match="not in Prometheus text format"):
        parse_router_metrics("vllm_router_requests_total{route=} x\n", 0.0)
    assert first.refused == 2  # its exhausted retries; and its 503s for want of a worker (0.1.17's own lines):
    errors = ('vllm_router_request_errors_total{route="/v1/completions",error_type="no_available_workers"} 5\n'
              'vllm_router_request_errors_total{route="/v1/completions",error_type="bad_request"} 7\n')
    assert parse_router_metrics(text + "\n" + errors, 13.0).refused == 7
