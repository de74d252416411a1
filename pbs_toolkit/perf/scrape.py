"""Observing one job through its transport: ``/metrics`` snapshots, ``Engine NNN:`` history, doctor inputs.

:func:`scrape_at` is the package's one scraper of a vLLM server's ``/metrics`` (``transports/http.py``
``metrics_text`` fetches, for the router's figures too; ``vllm/prom.py`` parses with ``prometheus_client``): a READY
job's (:func:`scrape`), the counters ``pbstk usage`` keeps (``campaigns/counters.py``), the keeper's and the
autoscaler's looks all come through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.jobs.status import JobStatus
from pbs_toolkit.perf.doctor import DoctorContext
from pbs_toolkit.transports import Runner
from pbs_toolkit.transports import http as probe
from pbs_toolkit.vllm.engine_log import EngineStats, iter_engine_stats
from pbs_toolkit.vllm.prom import MetricsSnapshot, parse_metrics, settle


def scrape(runner: Runner, st: JobStatus, timeout: float = 5.0) -> MetricsSnapshot:
    """One ``/metrics`` snapshot of a READY job (``/metrics`` needs no key, but sending it does no harm)."""
    if not st.address or not st.port:
        raise ServerFailed(f"job {st.record.job_id} is {st.state.value}: no server address to scrape yet")
    return scrape_at(runner, st.address, st.port, api_key=st.record.api_key, timeout=timeout)


def scrape_at(runner: Runner, host: str, port: int, *, api_key: str | None = None,
              timeout: float = 5.0) -> MetricsSnapshot:
    """One vLLM ``/metrics`` snapshot of the server at ``host:port`` (``transports/http.py`` ``metrics_text``;
    ``ServerFailed`` when nothing answered, the answer was not 200 or not Prometheus text)."""
    text = probe.metrics_text(runner, host, port, api_key=api_key, timeout=timeout)
    snap = parse_metrics(text, time.time())
    _PROGRESS[(host, port)] = settle(snap, _PROGRESS.get((host, port)))
    return snap


#: each server's last progress seen by this process (``prom.settle``): a server of several API-server processes
#: whose engine made none since an earlier look runs nothing, whatever its gauges say; the keeper, the lease's
#: and a drain's loops, ``metrics``' two scrapes look more than once
_PROGRESS: dict[tuple[str, int], tuple[tuple[float | None, ...], float]] = {}


def engine_history(runner: Runner, st: JobStatus, lines: int = 5000) -> list[EngineStats]:
    """The periodic ``Engine NNN:`` stats lines from the job's vLLM log (newest last)."""
    from pbs_toolkit.jobs.logs import tail_lines

    return list(iter_engine_stats(tail_lines(runner, f"{st.record.run_dir}/vllm.log", lines)))


def doctor_context(runner: Runner, st: JobStatus, snapshot: MetricsSnapshot | None) -> DoctorContext:
    """Everything ``diagnose`` needs for one job: its flags, layout, log and metrics."""
    from pbs_toolkit.jobs.logs import tail_lines
    from pbs_toolkit.settings.presets import params_from_name

    record = st.record
    spec = record.spec
    log = tail_lines(runner, f"{record.run_dir}/vllm.log", 5000)
    args = list(spec.vllm_args)
    if spec.eager or st.eager_fallback:
        args.append("--enforce-eager")
    return DoctorContext(
        vllm_args=args,
        tensor_parallel=spec.tensor_parallel or 1,
        data_parallel=spec.data_parallel or 1,
        pipeline_parallel=spec.pipeline_parallel or 1,
        gpus=spec.gpus,
        model_params_b=spec.params_b or params_from_name(record.model),
        log_lines=log,
        snapshot=snapshot,
        engine_stats=list(iter_engine_stats(log)),
        vllm_version=spec.vllm_version,
        vllm_cache_root_shared=bool(spec.vllm_cache_root),
        device="cpu" if spec.layout == "cpu" else "gpu",
        eager_fallback=st.eager_fallback and not spec.eager,
        state=st.state,
        startup=st.startup,
    )


def wait_drained(busy: Callable[[], float], bound_s: float, announce: Callable[[float], None], *,
                 stop: Callable[[], bool] = lambda: False, step_s: float = 0.5) -> float | None:
    """Look at ``busy()`` (requests running or waiting, e.g. summed over ``/metrics`` scrapes) every ``step_s``
    until it is 0 or ``bound_s`` has passed; ``announce`` gets the first count that is not 0, once. ``stop()``
    true ends the wait before the next look. The last count (0: drained), ``None`` when stopped before one."""
    deadline = time.monotonic() + bound_s
    announced = False
    while not stop():
        count = busy()
        if not count or time.monotonic() >= deadline:
            return count
        if not announced:
            announce(count)
            announced = True
        time.sleep(step_s)
    return None
