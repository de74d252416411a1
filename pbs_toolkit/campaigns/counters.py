"""The server's own request and token counters, kept with the job so that ``pbstk usage`` can report them after
the job has gone (docs/campaigns.md).

vLLM's ``/metrics`` counts since the server started: ``vllm:request_success_total``, ``vllm:prompt_tokens_total``
and ``vllm:generation_tokens_total``. A cancel (``pbstk cancel``, ``pbstk run``'s end, a service's teardown or
handover) scrapes them first and records them in the job's store record (``extra["usage_counters"]``); a job
still serving is scraped live by ``usage`` instead. The server is found at the address the job's status
verified as its own (``extra["verified_endpoint"]``): a job never READY has none, and nothing is recorded. A job
of a multi-model service serves its other models on other ports of that host (``server.json``'s ``models``):
their counters are added to its own, so the job's requests and tokens are every model's.
"""

from __future__ import annotations

from typing import Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.judge import co_models
from pbs_toolkit.jobs.records import COUNTERS_KEY
from pbs_toolkit.jobs.rundir import VERIFIED_KEY, read_marker
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.perf.scrape import scrape_at
from pbs_toolkit.transports.base import Runner

#: the counters' names in ``usage`` (and its JSON), from the snapshot's fields
FIELDS = {"requests": "requests_success", "prompt_tokens": "prompt_tokens", "output_tokens": "generation_tokens"}
#: one scrape before a cancel may take this long (a server that does not answer must not hold the cancel up)
SCRAPE_TIMEOUT_S = 3.0


def server_address(record: JobRecord) -> tuple[str, int] | None:
    """The host and port the job's server was verified at, if it ever was."""
    where = record.extra.get(VERIFIED_KEY)
    if not isinstance(where, str) or ":" not in where:
        return None
    host, _, port = where.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def scrape(runner: Runner, record: JobRecord, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, Any] | None:
    """The counters from the job's ``/metrics`` now (``None``: nothing answered, or no counters there), with
    ``running``/``waiting`` (requests in flight) and when (``at``)."""
    where = server_address(record)
    if where is None or record.final_state:
        return None
    try:
        snap = scrape_at(runner, where[0], where[1], timeout=timeout)
    except PbstkError:  # refused, timed out, not 200, an SSH channel that did not open, not Prometheus text
        return None
    values: dict[str, Any] = {name: _whole(getattr(snap, attr)) for name, attr in FIELDS.items()}
    if all(v is None for v in values.values()):
        return None
    values.update(running=snap.running, waiting=snap.waiting, at=round(snap.timestamp, 3))
    for port in _other_models(runner, record).values():
        try:
            other = scrape_at(runner, where[0], port, timeout=timeout)
        except PbstkError:
            continue  # one model that does not answer: the others still count
        for name, attr in FIELDS.items():
            more = _whole(getattr(other, attr))
            if more is not None:
                values[name] = (values[name] or 0) + more
        values.update(running=values["running"] + other.running, waiting=values["waiting"] + other.waiting)
    return values


def _other_models(runner: Runner, record: JobRecord) -> dict[str, int]:
    """A multi-model job's other models (served name -> port, from ``server.json``); none for one model."""
    marker = read_marker(runner, record.run_dir)
    return co_models(marker.get("models")) if marker else {}


def _whole(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def record_counters(store: JobStore, runner: Runner, record: JobRecord) -> dict[str, Any] | None:
    """Scrape the job's counters and keep them in its store record (before a cancel). ``None``: nothing was
    scraped, and what an earlier scrape recorded stays."""
    values = scrape(runner, record)
    if values is None:
        return None
    kept = {k: values[k] for k in (*FIELDS, "at")}
    store.update_extra(record, **{COUNTERS_KEY: kept})
    return kept


def recorded(record: JobRecord) -> dict[str, Any] | None:
    """The counters recorded for the job, if any."""
    value = record.extra.get(COUNTERS_KEY)
    return value if isinstance(value, dict) else None


def in_flight(values: dict[str, Any] | None) -> float:
    """Requests running or waiting in a scrape (0 when it says nothing)."""
    if not values:
        return 0.0
    return float(values.get("running") or 0) + float(values.get("waiting") or 0)
