"""A multi-model service running (issue 31; docs/multi-model.md "Serving"): each planned job is one slot of the
service, launched from a request naming every model of that job (its first model as the job's own, the others
in ``models``); the router runs in its multi-model mode (``--enable-igw``) and the keeper registers each model's
vLLM with its served name, so that a request's ``model`` field picks the worker.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any, Protocol

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.status_types import JobStatus
from pbs_toolkit.services.health import ready, worker_url
from pbs_toolkit.services.record import ServiceRecord
from pbs_toolkit.services.router_script import SEEDED_POLICIES
from pbs_toolkit.settings.launch_settings import RenderRequest

#: the router's multi-model mode: workers registered with a model id, requests routed by their ``model``
ROUTER_ARGS = ("--enable-igw",)
#: a swapping model's fields (``serve --max-awake``; docs/multi-model.md "Swapping"), passed on to its job
SWAP_KEYS = ("swap", "max_awake", "sleep_after_s")
#: the plan's fields a service record keeps for each model
_KEPT = ("served_model_name", "model", "preset", "job", "node", "gpus", "gpu_memory_utilization", "port", "swap")


class Admin(Protocol):
    def add_worker(self, url: str, model_id: str | None = None) -> None: ...
    def remove_worker(self, url: str) -> None: ...


def plan_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The service record's ``models``, from a ``model_plan`` object (services/model_plan.py ``to_dict``);
    refuses what this slice does not run yet: a job over several nodes."""
    rows = [{k: m[k] for k in _KEPT} for m in plan["models"]]
    if any(m["node"] for m in rows):
        raise UsageError("models planned on a second node of a job are planned, not running yet: serve them with "
                         "--nodes 1 (one node per job)")
    return rows


def job_request(base: RenderRequest, rows: list[dict[str, Any]], job: int) -> RenderRequest:
    """The request of planned job ``job`` (from 1): its first model as the job's own, every model of it in
    ``models`` with its preset, served name, GPUs and memory share."""
    mine = [m for m in rows if m["job"] == job]
    if not mine:
        raise UsageError(f"job {job} of the plan has no model")
    first = mine[0]
    models = [{"model": m["model"], "preset": m["preset"], "served_model_name": m["served_model_name"],
               "gpus": list(m["gpus"]), "share": m["gpu_memory_utilization"],
               **{k: m[k] for k in SWAP_KEYS if m.get("swap") and k in m}} for m in mine]
    return replace(base, model=first["model"], preset=first["preset"], served_model_name=first["served_model_name"],
                   models=models if len(models) > 1 else [],
                   vllm_args=[*base.vllm_args, *_share(first)] if len(models) == 1 else list(base.vllm_args))


def check_options(opts: Any, req: RenderRequest) -> Any:
    """``serve``'s options (a ``manage.ServeOptions``), as they are for one model; for a multi-model service one
    slot per planned job (with ``--keep-alive``, each job's successor is the same planned job: ``job_request``)
    and the router's policy (round_robin unless given); what this slice does not run yet is refused in one line."""
    if not opts.models:
        return opts
    if opts.scale is not None:
        raise UsageError("autoscaling of a multi-model service is planned, not running yet (docs/multi-model.md); "
                         "each planned job runs once (--keep-alive carries it across walltimes)")
    if isinstance(req.port, int) or (isinstance(req.port, str) and req.port.isdigit()):
        raise UsageError(f"--port {req.port}: the models of one job need a port each; leave the port to pbstk (the "
                         "profile's, or --port auto)")
    if opts.policy in SEEDED_POLICIES:
        raise UsageError(f"--policy {opts.policy}: a multi-model service routes by model (round_robin, random, "
                         "consistent_hash, ...); this policy seeds the router with a start-up worker")
    jobs = max(m["job"] for m in opts.models)
    return replace(opts, replicas=jobs, policy=opts.policy or "round_robin")


def model_requests(req: RenderRequest, rows: tuple[dict[str, Any], ...]) -> list[RenderRequest]:
    """One request per model (for the weights preflight of each); none for a one-model service."""
    return [replace(req, model=m["model"], preset=m["preset"], served_model_name=m["served_model_name"])
            for m in rows]


def _share(row: dict[str, Any]) -> list[str]:
    share = row.get("gpu_memory_utilization")
    return [] if share is None else ["--gpu-memory-utilization", f"{float(share):g}"]


def co_urls(st: JobStatus) -> dict[str, str]:
    """The worker URLs of a job's other models (server.json's ``models``): URL -> served name."""
    url = worker_url(st)
    if url is None or not st.models:
        return {}
    base = url.rsplit(":", 1)[0]
    return {f"{base}:{port}": served for served, port in st.models.items()}


def worker_urls(st: JobStatus) -> list[str]:
    """Every worker URL of a job: its own, then its other models'."""
    url = worker_url(st)
    return [] if url is None else [url, *co_urls(st)]


def served_names(rec: ServiceRecord, st: JobStatus) -> dict[str, str]:
    """A job's worker URLs -> the served name each answers to (its own first)."""
    url = worker_url(st)
    return {} if url is None else {url: st.record.served_model_name or rec.served_model_name, **co_urls(st)}


def add_workers(rec: ServiceRecord, st: JobStatus, url: str, admin: Admin, in_router: set[str]) -> list[str]:
    """Add a READY job's workers that are not in the router yet: one for a one-model service; each model's, with
    its served name as the model id, for a multi-model one. The URLs added."""
    if not rec.models:
        admin.add_worker(url)
        in_router.add(url)
        return [url]
    added = []
    for each, served in served_names(rec, st).items():
        if each not in in_router:
            admin.add_worker(each, model_id=served)
            in_router.add(each)
            added.append(each)
    return added


def label(urls: list[str], names: dict[str, str]) -> str:
    """Worker URLs for the keeper's log: each with the model it serves when ``names`` knows it (``b
    http://h:8012``), as they are otherwise."""
    return ", ".join(f"{names[u]} {u}" if u in names else u for u in urls)


def remove_workers(urls: list[str], admin: Admin, in_router: set[str]) -> list[str]:
    """Take a job's workers (``urls``: its own and its other models') out of the router; the URLs that were
    in it."""
    out = []
    for each in urls:
        if each in in_router:
            admin.remove_worker(each)
            in_router.discard(each)
            out.append(each)
    return out


def model_rows(rec: ServiceRecord, statuses: dict[str, JobStatus], swaps: dict[str, dict[str, Any]] | None = None,
               routed: Collection[str] | None = None, finals: Mapping[str, str] | None = None
               ) -> list[dict[str, Any]]:
    """``status NAME``'s rows of a multi-model service, one per model: served name, what vLLM loads, state,
    job, GPUs, memory share, the URL clients use (the service's, once this model is READY) and its own
    server's (``server``, the router's worker); a swapping model also ``swap`` (its swapper's view, ``swaps``
    by job id: awake, wakes, sleeps, the last wake's and sleep's seconds).

    READY means what the service's line counts (services/health.py): the model's server is among ``routed``, the
    router's workers that requests reach; a server that answers but is not there (yet: the keeper adds it on its
    next look; or the router refuses the key) is STARTING, never READY under a service that is not. An ended
    service's rows read each job's recorded final state (``finals``, by job id), else ENDED: no job is asked."""
    out = []
    for m in rec.models:
        slot = rec.slots[m["job"] - 1] if m["job"] - 1 < len(rec.slots) else None
        st = statuses.get(slot.current or "") if slot is not None else None
        url = None
        if ready(st):
            if st.record.served_model_name == m["served_model_name"]:
                url = worker_url(st)
            else:
                url = next((u for u, s in co_urls(st).items() if s == m["served_model_name"]), None)
        state = "PENDING" if st is None else st.state.value
        if state == "READY" and (url is None or (routed is not None and url not in routed)):
            state = "STARTING"
        job = None if st is None else st.record.job_id
        if rec.ended is not None:
            job = slot.current if slot is not None else None
            state = (finals or {}).get(job or "") or "ENDED"
        out.append({"served_model_name": m["served_model_name"], "model": m["model"], "state": state, "job": job,
                    "gpus": list(m["gpus"]), "gpu_memory_utilization": m["gpu_memory_utilization"],
                    "url": rec.url if state == "READY" else None, "server": url,
                    **({"swap": _swap_view(swaps or {}, st, m["served_model_name"])} if m.get("swap") else {})})
    return out


def _swap_view(swaps: dict[str, dict[str, Any]], st: JobStatus | None, served: str) -> dict[str, Any] | None:
    """One model's part of its job's ``swap.json``: ``None`` before the swapper wrote one."""
    seen = swaps.get(st.record.job_id, {}) if st is not None else {}
    one = seen.get("models", {}).get(served)
    if not isinstance(one, dict):
        return None
    return {k: one.get(k) for k in ("awake", "wakes", "sleeps", "last_wake_s", "last_sleep_s", "asleep_gib")}
