"""``doctor`` rules: each finding carries its evidence and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pbs_toolkit.perf.doctor import DoctorContext, diagnose
from pbs_toolkit.settings.vllm_flags import REMOVED_FLAGS, removed_since, version_tuple
from pbs_toolkit.vllm.engine_log import iter_engine_stats, parse_engine_line
from pbs_toolkit.vllm.prom import parse_metrics

DATA = Path(__file__).parent / "data" / "observe"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def codes(ctx: DoctorContext) -> dict[str, object]:
    return {finding.code: finding for finding in diagnose(ctx)}


def stats_line(running: int, waiting: int, kv: float, prompt: float = 10.0, preemptions: str = "") -> str:
    return (
        f"INFO 11-22 02:38:28 [loggers.py:123] Engine 000: Avg prompt throughput: {prompt} tokens/s, "
        f"Avg generation throughput: 900.0 tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
        f"{preemptions}GPU KV cache usage: {kv}%, Prefix cache hit rate: 0.0%"
    )


def test_healthy_server_has_no_findings():
    ctx = DoctorContext(
        vllm_args=["--model", "/m", "--max-num-seqs", "256"],
        model_params_b=8.0,
        log_lines=lines("startup-graphs.log"),
        engine_stats=[parse_engine_line(stats_line(100, 0, 55.0))],
        vllm_version="0.22.1",
        vllm_cache_root_shared=True,
    )
    assert diagnose(ctx) == []


def test_eager_from_flag_and_from_log():
    found = codes(DoctorContext(vllm_args=["--enforce-eager"], vllm_version="0.22.1"))
    assert found["eager-mode"].severity == "high"
    assert "--enforce-eager" in found["eager-mode"].evidence
    assert "5.6x" in found["eager-mode"].fix
    from_log = codes(DoctorContext(log_lines=lines("startup-eager.log"), vllm_version="0.11.0"))
    assert "Cudagraph is disabled under eager mode" in from_log["eager-mode"].evidence


def test_tp_on_small_model_recommends_dp():
    found = codes(DoctorContext(tensor_parallel=2, gpus=2, model_params_b=1.7, vllm_version="0.22.1"))
    finding = found["tp-small-model"]
    assert "1.7B" in finding.evidence
    assert "--data-parallel-size 2" in finding.fix
    old = codes(DoctorContext(tensor_parallel=4, gpus=4, model_params_b=1.7, vllm_version="0.11.0"))
    assert "separate servers" in old["tp-small-model"].fix
    assert "tp-small-model" not in codes(DoctorContext(tensor_parallel=2, gpus=2, model_params_b=70))


def test_custom_allreduce_disabled_on_pcie():
    found = codes(DoctorContext(tensor_parallel=4, gpus=4, log_lines=lines("startup-eager.log")))
    assert "PCIe-only" in found["tp-over-pcie"].evidence


def test_low_kv_usage_with_max_num_seqs_saturated():
    stats = [s for s in iter_engine_stats(lines("engine-lines.log")) if s.running >= 250]
    found = codes(DoctorContext(vllm_args=["--max-num-seqs=256"], engine_stats=stats, vllm_version="0.22.1"))
    finding = found["kv-underused-seq-limit"]
    assert "7.9%" in finding.evidence and "256" in finding.evidence
    assert "--max-num-seqs" in finding.fix


def test_low_kv_usage_from_metrics_with_waiting_requests():
    snapshot = parse_metrics((DATA / "vllm-0.22-metrics-t1.txt").read_text(), 0)  # 64 running, 36 waiting
    found = codes(DoctorContext(snapshot=snapshot, vllm_version="0.22.1"))
    assert "kv-underused-seq-limit" in found and "/metrics" in found["kv-underused-seq-limit"].evidence


def test_low_kv_usage_with_few_requests_asks_for_client_concurrency():
    found = codes(
        DoctorContext(
            vllm_args=["--max-num-seqs", "256"], engine_stats=[parse_engine_line(stats_line(4, 0, 1.0))]
        )
    )
    assert "kv-underused-load" in found and "concurrency" in found["kv-underused-load"].fix
    assert "kv-underused-seq-limit" not in found


def test_small_batched_tokens_with_long_prompts():
    stats = [parse_engine_line(stats_line(8, 0, 50.0, prompt=20000.0))]
    found = codes(DoctorContext(vllm_args=["--max-num-batched-tokens", "2048"], engine_stats=stats))
    assert found["small-batched-tokens"].severity == "medium"
    assert "2048" in found["small-batched-tokens"].evidence
    assert "small-batched-tokens" not in codes(DoctorContext(vllm_args=["--max-num-batched-tokens", "8192"]))


def test_prefix_caching_off():
    assert "prefix-caching-off" in codes(DoctorContext(vllm_args=["--no-enable-prefix-caching"]))


def test_long_compile_without_shared_cache():
    found = codes(DoctorContext(log_lines=lines("startup-graphs.log"), vllm_cache_root_shared=False))
    assert "35.39" in found["compile-cache"].evidence and "VLLM_CACHE_ROOT" in found["compile-cache"].fix
    assert "compile-cache" not in codes(
        DoctorContext(log_lines=lines("startup-graphs.log"), vllm_cache_root_shared=True)
    )


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.16.0", set()),
        ("0.17.0", {"--disable-log-requests"}),
        ("0.22.1", {"--disable-log-requests", "--swap-space"}),
    ],
)
def test_removed_flags_by_version(version, expected):
    args = ["--disable-log-requests", "--swap-space", "4"]
    found = [
        f for f in diagnose(DoctorContext(vllm_args=args, vllm_version=version)) if f.code == "removed-flag"
    ]
    assert {f.title.split()[0] for f in found} == expected
    assert all(f.severity == "high" and "unrecognized arguments" in f.fix for f in found)


def test_removed_env():
    found = codes(DoctorContext(env={"VLLM_USE_V1": "1"}, vllm_version="0.12.0"))
    assert "VLLM_USE_V1" in found["removed-environment"].evidence


def test_preemptions_and_fatal():
    snapshot = parse_metrics((DATA / "vllm-0.32-metrics-2engines.txt").read_text(), 0)
    found = codes(DoctorContext(snapshot=snapshot, log_lines=lines("startup-oom.log")))
    assert "vllm:num_preemptions_total = 3" in found["preemptions"].evidence
    assert "CUDA out of memory" in found["server-failed"].evidence
    assert (
        diagnose(DoctorContext(snapshot=snapshot, log_lines=lines("startup-oom.log")))[0].severity == "high"
    )


def test_flags_table():
    assert REMOVED_FLAGS["--swap-space"] == (0, 18)
    assert version_tuple("v0.11.0rc2.dev5+g1a2b") == (0, 11, 0)
    assert version_tuple("0.9") < version_tuple("0.17") <= version_tuple("0.17.0")
    assert removed_since("--swap-space=4", "0.18.1") == "0.18"
    assert removed_since("--swap-space", "0.17.9") is None
    assert removed_since("VLLM_USE_V1", "0.12") == "0.12"
    assert removed_since("--max-num-seqs", "0.33") is None
    with pytest.raises(ValueError):
        version_tuple("latest")
