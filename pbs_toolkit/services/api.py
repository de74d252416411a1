"""``Client``'s service methods (``Client`` inherits them): start, look at, wait for, stop and register a
service, and a service where a job would do (metrics, logs, doctor, bench). Each builds the ``ServiceSession``
the service modules take and delegates to one of them.

The class is a piece of the facade, kept beside the capability it fronts; what it uses of the rest of ``Client``
is declared below (``Client`` provides it), so this module never imports the client."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pbs_toolkit.results import Cancellation, Endpoint

if TYPE_CHECKING:
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.launch import LaunchResult
    from pbs_toolkit.jobs.render import RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.perf.observe import BenchResult, Diagnosis
    from pbs_toolkit.services.observe import ServiceDiagnosis, ServiceMetrics
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.services.session import ServiceSession
    from pbs_toolkit.services.status import ServiceStatus
    from pbs_toolkit.transports import Runner
    from pbs_toolkit.transports.tunnel import Tunnel


def held_replicas(store: JobStore) -> dict[str, str]:
    """Job id -> service name, for every job a service not ended still names in its slots: its keeper reads each
    on every tick, so ``pbstk clean`` leaves their records alone (handed to ``jobs.clean.clean`` by ``Client``)."""
    from pbs_toolkit.services.record import all_services

    return {job: svc.name for svc in all_services(store) for slot in svc.slots for job in slot.jobs()}


class ServiceMethods:
    """Services: several replicas behind one router (services/, docs/services.md); ``Client`` provides the
    members declared here."""

    store: JobStore
    on_removal: Callable[[Removal], Any]
    runner: Callable[[str], Runner]
    request: Callable[..., RenderRequest]
    launch_request: Callable[..., LaunchResult]
    _status_of: Callable[[list[JobRecord]], list[JobStatus]]
    cancel: Callable[..., bool]
    tunnel: Callable[..., tuple[JobStatus, Tunnel]]
    logs: Callable[..., Iterator[str]]
    log_text: Callable[..., Iterator[str]]
    doctor: Callable[..., Diagnosis]
    bench: Callable[..., BenchResult]

    def service_session(self) -> ServiceSession:
        """What the service modules use of this client: its store and runners, launch, status and cancel."""
        from pbs_toolkit.services.session import ServiceSession

        return ServiceSession(store=self.store, runner=self.runner, launch=self.launch_request,
                              status=self._status_of, cancel=self.cancel, on_removal=self.on_removal)

    def serve(self, model: str | RenderRequest, preset: str | None = None, profile: str | None = None, *,
              replicas: int = 1, name: str | None = None, keep_alive: bool = False, handover_s: float = 600.0,
              policy: str | None = None, nodes_per_replica: int | None = None, api_key: str | None = None,
              stage: bool = False, scale: Any = None, max_restarts: int | None = None,
              restart_window: str | None = None, restart_backoff: str | None = None,
              models: Any = (), **options: Any) -> ServiceRecord:
        """Start a service: ``replicas`` jobs of ``model`` behind one vllm-router, one URL and one key, kept by
        a detached keeper; returns at once (``wait_service`` waits). ``scale``: a services/autoscale.py
        ``ScaleSpec`` (autoscaling instead of a fixed count). ``max_restarts``, ``restart_window`` (``30m``),
        ``restart_backoff`` (``10s``): the restart policy of a failed replica (``None``: the profile's).
        ``models``: a multi-model service's plan (services/multi.py ``plan_rows``; docs/multi-model.md).
        ``options``: as for ``launch``."""
        from pbs_toolkit.services.manage import ServeOptions, start

        req = self.request(model, preset, profile, **options)
        return start(self.service_session(), req, ServeOptions(
            replicas=replicas, name=name, keep_alive=keep_alive, handover_s=handover_s, policy=policy, scale=scale,
            nodes_per_replica=nodes_per_replica, api_key=api_key, stage=stage, max_restarts=max_restarts,
            restart_window=restart_window, restart_backoff=restart_backoff, models=tuple(models)))

    def services(self, all: bool = False) -> list[ServiceRecord]:  # noqa: A002
        """Services pbstk started, newest first (default: those not ended). No scheduler query."""
        from pbs_toolkit.services.record import all_services

        return all_services(self.store, include_ended=all)

    def service(self, ref: str | None) -> ServiceRecord | None:
        """The service ``ref`` names, unless a job answers to it (services/record.py ``unless_a_job``: its exact
        id; its name while the job is active or the service ended too: active beats ended)."""
        from pbs_toolkit.services.record import load, unless_a_job

        found = load(self.store, ref) if ref else None
        if found is not None and found.active:
            self.settle_named(found.name)
        return unless_a_job(self.store, ref)

    def settle_named(self, name: str) -> None:
        """Ask once after the jobs named ``name`` whose end is not recorded yet (``status`` records an end), so
        that one that has ended does not stand for an active service of that name; no query when there are none
        (the usual case), and an unanswered one stays active."""
        from pbs_toolkit.errors import PbstkError

        unsettled = [r for r in self.store.all() if r.name == name and not r.final_state]
        if unsettled:
            try:
                self._status_of(unsettled)
            except PbstkError:
                pass

    def shared_name_note(self, name: str, made: str) -> str | None:
        """``serve NAME`` / ``launch --name NAME`` over a job or service of that name: which one later commands
        act on (services/record.py ``shared_name_note``), after the jobs of that name were settled."""
        from pbs_toolkit.services.record import shared_name_note

        if made == "service":
            self.settle_named(name)
        return shared_name_note(self.store, name, made)

    def service_status(self, name: str | ServiceRecord) -> ServiceStatus:
        """The service's state (``READY 3/4 replicas``), each replica's status, whether keeper and router run."""
        from pbs_toolkit.services.record import find
        from pbs_toolkit.services.status import look

        return look(self.service_session(), find(self.store, name) if isinstance(name, str) else name)

    def service_statuses(self, services: Sequence[ServiceRecord], jobs: Sequence[JobRecord] = ()
                         ) -> tuple[list[ServiceStatus], list[JobStatus]]:
        """``service_status`` of each service and ``status`` of ``jobs`` from one scheduler query per transport
        (services/status.py ``look_all``)."""
        from pbs_toolkit.services.status import look_all

        return look_all(self.service_session(), services, jobs)

    def wait_service(self, name: str | ServiceRecord, timeout: float = 3600.0,
                     on_progress: Callable[[ServiceStatus, float], None] | None = None) -> ServiceStatus:
        """Block until every replica is READY and routable: in the router, which serves a request with the key
        (``WaitTimeout``; ``ServerFailed`` when the service ended or every replica failed). services/ready.py."""
        from pbs_toolkit.services.record import find
        from pbs_toolkit.services.status import wait

        return wait(self.service_session(), find(self.store, name) if isinstance(name, str) else name, timeout,
                    on_progress)

    def cancel_service(self, name: str | ServiceRecord, *, keep_endpoint: bool = False) -> list[Cancellation]:
        """Stop the keeper, every replica job (queued successors too) and the router; take the service's
        registry entries back unless ``keep_endpoint``. An ended service: nothing to stop (empty list)."""
        from pbs_toolkit.services.record import find
        from pbs_toolkit.services.stop import teardown

        rec = find(self.store, name) if isinstance(name, str) else name
        if not rec.active:  # a STOPPING one (an interrupted cancel) is finished now
            return []
        return [Cancellation(job_id, job_name, stopped) for job_id, job_name, stopped in
                teardown(self.service_session(), rec, "CANCELLED", keep_endpoint=keep_endpoint)]

    def resume_service(self, name: str) -> int:
        """Start the service's keeper again (after a reboot, a kill); its pid. A running keeper is kept."""
        from pbs_toolkit.services.keeper_process import resume

        return resume(self.store, name)

    def keep_service(self, name: str) -> int:
        """Be the keeper of service ``name`` until it ends (``pbstk _keeper NAME``, detached); its exit status."""
        from pbs_toolkit.services.keeper import run

        return run(name, self.service_session())

    def service_endpoint(self, name: str | ServiceRecord, local_url: str | None = None) -> Endpoint:
        """The router's base URL (``local_url``: a tunnel's instead) and the service's key (``pbstk env NAME``). A
        multi-model service has no one model: its variables name them all (``PBSTK_MODELS``, as ``pbstk run``'s
        COMMAND gets them), and ``PBSTK_MODEL`` is left out."""
        from pbs_toolkit.endpoints import endpoint_url, env_values
        from pbs_toolkit.services.entry import routed_status
        from pbs_toolkit.services.record import find

        rec = find(self.store, name) if isinstance(name, str) else name
        st = routed_status(self.store, rec)
        env = env_values(st, local_url)
        if rec.models:
            del env["PBSTK_MODEL"]
            env["PBSTK_MODELS"] = " ".join(m["served_model_name"] for m in rec.models)
        return Endpoint(base_url=endpoint_url(st, local_url), api_key=st.record.api_key,
                        model=st.record.served_model_name, job_id=st.record.job_id, env=env)

    def update_service_endpoint(self, name: str | ServiceRecord, registry: str | None = None, *,
                                fmt: str = "auto", alias: str | None = None, follow_symlink: bool = False,
                                force_format: bool = False, keep_after_end: bool = False, via_tunnel: bool = False,
                                local_port: int = 0) -> EndpointUpdate:
        """Register the router's URL under the service's name (the registry never changes across handovers);
        recorded as ``service:NAME`` and taken back by ``cancel_service``. ``via_tunnel``: as for a job."""
        from pbs_toolkit.endpoints.register import register
        from pbs_toolkit.services.entry import registration

        record, ready = registration(self.store, name)
        return register(self.store, record, ready, registry, fmt=fmt, alias=alias, follow_symlink=follow_symlink,
                        force_format=force_format, keep_after_end=keep_after_end, notice=self.on_removal,
                        tunnel=(lambda st: self.tunnel(st, local_port)[1]) if via_tunnel else None)

    def update_model_endpoints(self, name: str | ServiceRecord, registry: str | None = None, **options: Any
                               ) -> list[EndpointUpdate]:
        """A multi-model service: one entry per model, its alias and ``model`` the served name, all at the
        router's URL with the service's key (``options``: as for ``update_service_endpoint``, but ``alias``)."""
        from pbs_toolkit.endpoints.register import register
        from pbs_toolkit.services.entry import registration
        from pbs_toolkit.services.record import find

        rec = find(self.store, name) if isinstance(name, str) else name
        local_port = options.pop("local_port", 0)
        tunnel = (lambda st: self.tunnel(st, local_port)[1]) if options.pop("via_tunnel", False) else None
        out = []
        for m in rec.models:
            record, ready = registration(self.store, rec, m["served_model_name"])
            out.append(register(self.store, record, ready, registry, alias=m["served_model_name"],
                                notice=self.on_removal, tunnel=tunnel, **options))
        return out

    # -- a service where a job would do: metrics, logs, doctor, bench (services/observe.py) --------------------

    def service_metrics(self, name: str | ServiceRecord | ServiceStatus, interval: float = 1.0,
                        model: str | None = None) -> ServiceMetrics:
        """``metrics`` of every serving replica, their sum, and the router's own figures (``pbstk metrics NAME``);
        a multi-model service's each model too (``model``: that one only)."""
        from pbs_toolkit.services.observe import metrics, serving_status

        session = self.service_session()
        return metrics(session, serving_status(session, name), interval, model)

    def watch_service_metrics(self, name: str | ServiceRecord | ServiceStatus, every: float = 5.0,
                              count: int = 0, model: str | None = None) -> Iterator[ServiceMetrics]:
        """``watch_metrics`` for a service: a look every ``every`` s, over the interval since the one before."""
        from pbs_toolkit.services.observe import serving_status, watch_metrics

        session = self.service_session()
        return watch_metrics(session, serving_status(session, name), every, count, model)

    def service_doctor(self, name: str | ServiceRecord, replica: int | None = None) -> ServiceDiagnosis:
        """Router and keeper findings, then ``doctor`` of each replica's job (``replica``: that one only)."""
        from pbs_toolkit.services.observe import doctor

        return doctor(self.service_session(), self.service_status(name), self.doctor, replica)

    def service_bench(self, name: str | ServiceRecord | ServiceStatus, concurrencies: Sequence[int] = (1, 8, 64),
                      **options: Any) -> BenchResult:
        """``bench`` through the router's URL with the service's key (``options``: as for ``bench``); vLLM's own
        time of each level is that of its serving replicas together (the router's ``/metrics`` is not a vLLM's;
        a multi-model service's servers are per model, and it has none)."""
        from pbs_toolkit.services.observe import bench_status, serving, serving_status

        st = serving_status(self.service_session(), name)
        replicas = [] if st.record.models else [js for _, js in serving(st)]
        return self.bench(bench_status(st), concurrencies, **{**options, "server_time": replicas or False})

    def service_log(self, name: str | ServiceRecord, lines: int = 50, follow: bool = False, *,
                    replica: int | None = None, pieces: bool = False, final_every: float = 5.0,
                    notice: Callable[[str], None] | None = None, stream: str = "vllm",
                    node: int | None = None, model: str | None = None) -> Iterator[str]:
        """The router's log, or replica K's job log (``stream``, ``node``), as ``logs``/``log_text`` give it;
        ``model``: that model's vLLM log, of the job holding it (a multi-model service)."""
        from pbs_toolkit.services.observe import replica_job, router_log_lines
        from pbs_toolkit.services.record import find

        rec = find(self.store, name) if isinstance(name, str) else name
        if model is not None:
            return self._model_log(rec, model, lines, follow, replica=replica, pieces=pieces,
                                   final_every=final_every, notice=notice, stream=stream, node=node)
        if replica is not None:
            job = replica_job(rec, replica)
            if pieces:
                return self.log_text(job, lines, stream=stream, node=node)
            return self.logs(job, lines, follow, stream=stream, node=node, final_every=final_every, notice=notice)
        return router_log_lines(self.service_session(), rec, lines, follow, pieces=pieces, final_every=final_every,
                                notice=notice or _info, stream=stream, node=node)


    def _model_log(self, rec: ServiceRecord, model: str, lines: int, follow: bool, *, replica: int | None,
                   pieces: bool, final_every: float, notice: Callable[[str], None] | None, stream: str,
                   node: int | None) -> Iterator[str]:
        """``service_log`` of one model (services/per_model.py ``position``): its job's log of its place."""
        from pbs_toolkit.errors import UsageError
        from pbs_toolkit.services.observe import replica_job
        from pbs_toolkit.services.per_model import position

        index, place = position(rec, model)
        if replica is not None and replica != index:
            raise UsageError(f"--model {model} runs in replica {index} of service {rec.name}, not {replica}: "
                             "leave --replica out")
        job = replica_job(rec, index)
        if pieces:
            return self.log_text(job, lines, stream=stream, node=node, model=place)
        return self.logs(job, lines, follow, stream=stream, node=node, model=place, final_every=final_every,
                         notice=notice)


def _info(message: str) -> None:
    """The default ``notice``: a log line (the CLI passes its own)."""
    logging.getLogger("pbs_toolkit").info("%s", message)
