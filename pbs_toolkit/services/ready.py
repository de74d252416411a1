"""READY means routable: what ``status NAME`` counts and what ``serve --wait`` waits for.

A replica counts as ready only when it is routable (services/health.py, the one place that decides: its server is
in the router's worker list, where the keeper puts only READY ones, and its job has not ended), and then only
while a request with the service's key through the service URL succeeds (``GET /v1/models`` through the router:
it proves the router routes and the key is accepted, and costs no generation). So ``serve --wait``
returns, and ``status`` says READY n/N, only when a client's first request will be served, never while the router
still has no worker (its ``503 No available workers``). A router that lists no worker is not asked at all: a
completion gets 503 there whatever ``/v1/models`` says (a multi-model router's front answered it 200 with no
model), so ``status NAME`` says ``0 worker(s), a request with the key: 503 (the router has no worker to serve
it)``, never ``200``. A dead router: DOWN 0/N.

Costs: ``check_route`` is two HTTP requests to the router (over the SSH connection for a login-node router), no
scheduler query; ``wait`` asks the scheduler on the usual ramp (2, 4, 8, 30 s) and the router every
``ROUTE_POLL_S`` in between, so it returns within about that long of the keeper adding the last replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pbs_toolkit.services.health import routable_count, still_starting, worker_url
from pbs_toolkit.services.record import ServiceRecord

if TYPE_CHECKING:
    from pbs_toolkit.services.session import ServiceSession

#: decided in services/health.py; importable from here as before
__all__ = ["RouteCheck", "check_route", "looks_routable", "routable_count", "still_starting", "worker_url"]


#: what vllm-router answers any request while it has no worker (0.1.17, both modes; measured): ``check_route``
#: asks nothing then
NO_WORKER_STATUS = 503
NO_WORKER = "(the router has no worker to serve it)"


@dataclass
class RouteCheck:
    """What the router said: its workers (``None``: ``/list_workers`` did not answer) and the status of one
    request with the service's key through the service URL (``None``: no answer)."""

    workers: list[str] | None
    status: int | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.workers) and self.status == 200

    @property
    def routed(self) -> list[str]:
        """The workers requests reach: the router's list, unless the request with the key was refused outright
        (401, 404, a 5xx). One with no answer in time is a busy path, not a refusal: the router passes ``/v1/models``
        to a replica, whose vLLM answers it on the event loop that streams its tokens (on an H100 under a c=512
        burst, one status look in a minute saw 0 of 1 replica routable this way)."""
        if self.workers is None or self.status not in (200, None):
            return []
        return self.workers

    @property
    def text(self) -> str:
        """``2 workers, a request with the key: 200`` (``status NAME``)."""
        if self.workers is None:
            return "the router did not list its workers"
        answer = ("no answer in time (busy?)" if self.status is None
                  else f"{self.status}{' ' + self.detail if self.detail else ''}")
        return f"{len(self.workers)} worker(s), a request with the key: {answer}"


def check_route(session: ServiceSession, rec: ServiceRecord) -> RouteCheck:
    """The router's workers and one authenticated ``GET /v1/models`` through it (two requests, no scheduler)."""
    from pbs_toolkit.services.router.process import RouterInfo, http_request, list_workers

    info = RouterInfo.from_dict(rec.router)
    runner = session.runner(info.transport)
    workers = list_workers(runner, info.host, info.port)
    if workers is None:
        return RouteCheck(None, None)
    if not workers:  # what any request gets (not asked: a multi-model router's front listed no model with 200)
        return RouteCheck(workers, NO_WORKER_STATUS, NO_WORKER)
    headers = {"Authorization": f"Bearer {rec.api_key}"} if rec.api_key else {}
    status, body = http_request(runner, info.host, info.port, "/v1/models", headers=headers, body_limit=200)
    detail = "" if status == 200 else body.decode(errors="replace").strip()[:120]
    return RouteCheck(workers, status, detail)


def looks_routable(session: ServiceSession, rec: ServiceRecord) -> bool:
    """Cheap: the router lists at least N workers (a multi-model service: one per model) and answers the key
    (then a full look confirms)."""
    from pbs_toolkit.errors import PbstkError

    try:
        route = check_route(session, rec)
    except PbstkError:
        return False
    return route.ok and len(route.workers or []) >= (len(rec.models) or rec.replicas)
