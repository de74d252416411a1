"""Reading vLLM: its startup and engine logs and its Prometheus /metrics (parsing only, nothing runs here)."""
