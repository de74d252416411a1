"""Each model of a multi-model service on its own (issue 31 item 4; docs/multi-model.md "Per model"): which job
and which log file hold a model, each model's own server, one ``/metrics`` look at every model of a job (the
service's idle check), and the ``--model M`` pick that ``logs`` and ``metrics`` share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.status import JobStatus
from pbs_toolkit.perf.scrape import scrape_at
from pbs_toolkit.services.health import worker_url
from pbs_toolkit.vllm.prom import MetricsSnapshot, combine

if TYPE_CHECKING:
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.transports import Runner


class ModelServer(NamedTuple):
    """One model's own server in a serving replica (``metrics NAME``'s per-model line)."""

    replica: int
    status: JobStatus
    served: str
    host: str
    port: int


def served_names(rec: ServiceRecord) -> list[str]:
    """The service's served names, in plan order."""
    return [m["served_model_name"] for m in rec.models]


def pick(rec: ServiceRecord, served: str) -> dict[str, Any]:
    """The plan row of model ``served`` (``--model M``); anything else is one line naming the models, exit 2."""
    if not rec.models:
        raise UsageError(f"--model {served}: service {rec.name} serves one model; leave --model out")
    for m in rec.models:
        if m["served_model_name"] == served:
            return m
    raise UsageError(f"--model {served}: service {rec.name} serves no such model (its models: "
                     f"{', '.join(served_names(rec))})")


def position(rec: ServiceRecord, served: str) -> tuple[int, int]:
    """(slot index, the model's place among its job's models) of model ``served``: place 0 is the job's own
    model (``vllm.log``), place K its K-th other model (``vllm.model<K+1>.log``, server/start/models.sh)."""
    row = pick(rec, served)
    mine = [m["served_model_name"] for m in rec.models if m["job"] == row["job"]]
    return row["job"] - 1, mine.index(served)


def servers(st: JobStatus) -> list[tuple[str, str, int]]:
    """(served name, host, port) of each model's server of a READY job: its own first, then its other models'
    (server.json's ``models``)."""
    if worker_url(st) is None or st.address is None or st.port is None:
        return []
    return [(st.record.served_model_name, st.address, int(st.port)),
            *((served, st.address, port) for served, port in st.models.items())]


def job_snapshot(runner: Runner, st: JobStatus, timeout: float = 3.0) -> MetricsSnapshot:
    """One ``/metrics`` look at every model of a job, summed (``vllm/prom.py`` ``combine``): running and waiting
    requests of all of them, their success counters added (a request to any model moves the sum). Raises
    ``PbstkError`` when any model's server did not answer: a job not fully seen is not idle."""
    found = servers(st)
    if not found:
        raise UsageError(f"job {st.record.job_id} has no server address yet")
    return combine([scrape_at(runner, host, port, api_key=st.record.api_key, timeout=timeout)
                    for _, host, port in found])


def model_servers(rec: ServiceRecord, targets: list[tuple[int, JobStatus]],
                  model: str | None = None) -> list[ModelServer]:
    """Each model's server in ``targets`` (the serving jobs: replica index, status), in plan order; ``model``:
    that one only (``metrics NAME --model M``)."""
    by_slot = dict(targets)
    out: list[ModelServer] = []
    for m in rec.models:
        served = m["served_model_name"]
        st = by_slot.get(m["job"] - 1)
        if st is None or (model is not None and served != model):
            continue
        out.extend(ModelServer(m["job"] - 1, st, s, host, port) for s, host, port in servers(st) if s == served)
    return out
