"""Observability for running vLLM servers: metrics, logs, diagnosis and benchmarks.

Modules (import the one you need; nothing heavy is imported here):

- ``prom``: parse Prometheus ``/metrics`` of vLLM V1 into snapshots, rates and latency quantiles.
- ``engine_log``: parse the periodic ``Engine 000: Avg prompt throughput ...`` stats lines.
- ``startup``: startup phases, timings and fatal errors from a vLLM log.
- ``doctor``: turn flags, logs and metrics into findings with evidence and a fix.
- ``bench``: a small streaming load generator and helpers for ``vllm bench serve``.
"""
