"""Start a service: N replica jobs behind one vllm-router, one URL and one key (looking at one: status.py;
stopping one: stop.py; its keeper process: keeper/process.py).

Replica ``k`` is an ordinary pbstk job named ``NAME-r<k>`` (its keep-alive successors ``NAME-r<k>-g<gen>``),
launched through the normal launch path with the service's key, so the one key works through the router (the
router passes the client's ``Authorization`` header on to the worker). Replica jobs never get registry entries
of their own: the service's entry is the router's URL. The keeper (services/keeper/loop.py) then adds READY
replicas to the router, removes the ones that end, and with keep-alive launches successors.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.jobs.launch import new_api_key
from pbs_toolkit.jobs.plan import plan_layout
from pbs_toolkit.jobs.render import job_gpus
from pbs_toolkit.schedulers import backend_class, runs_on_submit_host
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper import restarts
from pbs_toolkit.services.keeper.process import service_dir, spawn_keeper
from pbs_toolkit.services.models import multi
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.settings.layout_flags import refuse_layout_flags
from pbs_toolkit.settings.machine_gpus import this_machine

if TYPE_CHECKING:
    from pbs_toolkit.services.session import ServiceSession
    from pbs_toolkit.settings.launch_settings import LaunchSettings, RenderRequest
    from pbs_toolkit.settings.profiles import Profile

#: the most replicas one service may have: each is a job of its own, and a typo should not queue thousands
MAX_REPLICAS = 1000
#: ``--handover`` default: the successor becomes eligible this long before its predecessor's walltime ends
DEFAULT_HANDOVER_S = 600.0


def replica_name(service: str, slot: Slot) -> str:
    return f"{service}-r{slot.index}" if slot.gen == 0 else f"{service}-r{slot.index}-g{slot.gen}"


def router_place(profile: Profile) -> str:
    """Where the router runs: ``auto`` is this machine without an SSH host, the login node with one; ``job`` a
    small CPU job of the profile's scheduler (services/router/job.py)."""
    place = profile.router
    if place == "auto":
        place = "login" if profile.ssh_host else "local"
    if place == "local" and profile.ssh_host:
        raise UsageError("router: local with an ssh_host profile is not supported: the router must reach the "
                         "compute nodes; use router: login")
    return place


def check_keep_alive(profile: Profile, replicas: int, handover_s: float, walltime_s: int) -> None:
    """Refuse keep-alive that cannot overlap: a queue limit below replicas x 2, or a handover >= walltime."""
    limit = profile.max_running_jobs
    if limit and limit < replicas * 2:
        raise UsageError(f"--keep-alive needs {replicas * 2} jobs running at once ({replicas} replicas and their "
                         f"successors) but profile {profile.name} allows {limit} running job(s) per user "
                         f"(max_running_jobs); a handover could not overlap")
    if handover_s >= walltime_s:
        raise UsageError(f"--handover {handover_s:g} s is not shorter than the walltime ({walltime_s} s): the "
                         f"successor would start before its predecessor")


def check_local_gpus(session: ServiceSession, profile: Profile, req: RenderRequest, opts: ServeOptions) -> None:
    """On a scheduler whose jobs run on this machine (``local``), every job of the service books its GPUs of this
    machine as a scheduler would, and waits QUEUED while they are held (schedulers/local/gpus.py). A service whose
    jobs can never all hold theirs at once (its replicas, or its planned jobs; with ``--keep-alive`` twice, each
    job and its overlapping successor: a predecessor's models hold their memory until it ends) would wait for
    ever: refused in one line, naming what it needs and what the machine has (over ssh: the login host's, as the
    scheduler books them there)."""
    if not runs_on_submit_host(profile.scheduler):
        return
    if opts.models:
        per_job = [job_gpus(list(m for m in opts.models if m["job"] == job)) for job in {m["job"] for m in opts.models}]
    else:
        preset, nodes, _ = plan_layout(req)
        per_job = [preset.gpus if preset.device == "gpu" else 0] * opts.replicas
    need = sum(per_job) * (2 if opts.keep_alive else 1)
    if profile.ssh_host:
        have = len(backend_class(profile.scheduler)().machine_gpus(session.runner(profile.ssh_host)) or [])
    else:
        have = len(this_machine(profile.scheduler))
    if need == 0 or not have or need <= have:
        return
    what = f"{len(per_job)} job(s) of {'/'.join(str(g) for g in sorted(set(per_job)))} GPU(s)"
    twice = ", twice: each job and its keep-alive successor overlap" if opts.keep_alive else ""
    raise UsageError(f"the service needs {need} GPU(s) of this machine at once ({what}{twice}), but it has {have} "
                     f"(CUDA_VISIBLE_DEVICES, else nvidia-smi): the rest would wait for ever; serve fewer "
                     f"replicas or models{', or leave out --keep-alive' if opts.keep_alive else ''}")


def check_fixed_port(profile: Profile, req: RenderRequest, opts: ServeOptions) -> None:
    """A fixed ``--port N`` on the local scheduler: every replica (and a keep-alive successor, which overlaps its
    predecessor) runs on this one machine, so a second server would find N taken. Refused rather than silently
    made automatic: the user asked for that exact port. Other schedulers place replicas on their own nodes."""
    fixed = isinstance(req.port, int) or (isinstance(req.port, str) and req.port.isdigit())
    if not fixed or not runs_on_submit_host(profile.scheduler) or (opts.replicas < 2 and not opts.keep_alive):
        return
    why = f"--replicas {opts.replicas}" if opts.replicas > 1 else "--keep-alive (a successor overlaps its predecessor)"
    raise UsageError(f"--port {req.port} with {why} on the local scheduler: every replica runs on this machine and "
                     f"would bind the same port; leave --port out (each replica then picks a free port)")


def check_router_command(session: ServiceSession, profile: Profile, command: list[str]) -> None:
    """The router program must exist where it will run (one clear line now, not a failed start later)."""
    program = command[0]
    if not profile.ssh_host:
        if not (shutil.which(program) or (os.sep in program and os.access(program, os.X_OK))):
            raise UsageError(f"router command {program!r} not found (profile key router_command; "
                             f"pip install vllm-router)")
        return
    result = session.runner(profile.ssh_host).run(["sh", "-c", 'command -v "$1"', "sh", program], timeout=30)
    if result.rc != 0:
        raise UsageError(f"router command {program!r} not found on {profile.ssh_host} (profile key "
                         f"router_command; pip install vllm-router there)")


@dataclass
class ServeOptions:
    replicas: int = 1
    name: str | None = None
    keep_alive: bool = False
    handover_s: float = DEFAULT_HANDOVER_S
    policy: str | None = None
    nodes_per_replica: int | None = None
    api_key: str | None = field(default=None, repr=False)
    scale: Any = None  # services/keeper/autoscale.py ScaleSpec: autoscaling between its min and max replicas
    #: stage a Hub model an offline profile's nodes lack before anything starts (weights/preflight.py)
    stage: bool = False
    #: the restart policy (services/keeper/restarts.py): ``None`` takes the profile's ``max_restarts``,
    #: ``restart_window``, ``restart_backoff``
    max_restarts: int | None = None
    restart_window: str | None = None
    restart_backoff: str | None = None
    #: a multi-model service: the plan's rows (services/models/multi.py ``plan_rows``), one slot per planned job
    models: tuple[dict[str, Any], ...] = ()


def _check_weights(session: ServiceSession, req: RenderRequest, profile: Profile, stage: bool) -> None:
    """The weights preflight once for the service, before the router or any replica starts."""
    from pbs_toolkit.jobs.launch import stderr_note
    from pbs_toolkit.weights.preflight import preflight_weights

    preflight_weights(session.runner(profile.ssh_host or ""), req.model, profile, stage=stage,
                      vllm_args=req.vllm_args, note=stderr_note)


def start(session: ServiceSession, req: RenderRequest, opts: ServeOptions) -> ServiceRecord:
    """Check everything, record the service, start the router, launch the replicas, start the keeper."""
    from pbs_toolkit.jobs.plan import served_model_name, slug
    from pbs_toolkit.settings.launch_settings import resolve_launch_settings
    from pbs_toolkit.settings.profiles import ROUTER_POLICIES, walltime_seconds

    if opts.replicas < 1:
        raise UsageError(f"--replicas {opts.replicas}: a service needs at least 1 replica")
    if opts.replicas > MAX_REPLICAS:
        raise UsageError(f"--replicas {opts.replicas}: at most {MAX_REPLICAS} replicas per service (each is a job)")
    name = opts.name or slug(req.model.rsplit("/", 1)[-1])
    records.check_name(name)
    if opts.nodes_per_replica:
        req = replace(req, nodes=opts.nodes_per_replica)
    opts = multi.check_options(opts, req)
    req = replace(req, name=None, served_model_name=served_model_name(req.model, req.served_model_name, name))
    settings = resolve_launch_settings(req)  # once for the checks, the router and every replica
    refuse_layout_flags(req.vllm_args, settings.preset_name)  # a replica's render would, after the router started
    profile = settings.launchable()
    settings, req, opts, extra = configure_scaling(settings, req, opts)  # --min/--max-replicas, --idle-cancel
    check_fixed_port(profile, req, opts)
    place = router_place(profile)
    policy = opts.policy or profile.router_policy
    if policy not in ROUTER_POLICIES:
        raise UsageError(f"--policy {policy!r}: must be one of {', '.join(ROUTER_POLICIES)}")
    walltime_s = walltime_seconds(profile.walltime)
    if opts.keep_alive:
        if place == "job":  # the router's own job would end at its walltime, and the URL with it
            from pbs_toolkit.services.router.job import KEEP_ALIVE_REFUSED

            raise UsageError(KEEP_ALIVE_REFUSED)
        check_keep_alive(profile, opts.replicas, opts.handover_s, walltime_s)
    check_local_gpus(session, profile, req, opts)
    command = shlex.split(profile.router_command)
    if place != "job":  # a router job looks for it on its node (and fails with its own line)
        check_router_command(session, profile, command)
    for each in multi.model_requests(req, opts.models) or [req]:  # each model of a multi-model service
        _check_weights(session, each, profile, opts.stage)
    rec = ServiceRecord(name=name, model=req.model, served_model_name=req.served_model_name or name,
                        profile=profile.name, replicas=opts.replicas, request=asdict(req),
                        transport=profile.ssh_host or "", scheduler=profile.scheduler, keep_alive=opts.keep_alive,
                        handover_s=opts.handover_s, walltime_s=walltime_s, policy=policy,
                        slots=[Slot(k) for k in range(opts.replicas)],
                        api_key=opts.api_key or new_api_key(), models=list(opts.models), **extra)
    records.create(session.store, rec)  # refuses a second active service of that name
    _bring_up(session, rec, profile, command, place, settings)
    return rec


def _bring_up(session: ServiceSession, rec: ServiceRecord, profile: Profile, command: list[str], place: str,
              settings: LaunchSettings) -> None:
    """Start the recorded service's router, launch its replicas, start its keeper; on any failure (a Ctrl-C too),
    tear down what started, then raise."""
    try:
        _start_router(session, rec, profile, command, place)
        for slot in rec.slots:  # a multi-model service's jobs: each its own request (resolved in launch_replica)
            launch_replica(session, rec, slot, settings=None if rec.models else settings)
        spawn_keeper(rec.name)
    except BaseException:
        from pbs_toolkit.jobs.launch import defer_interrupts

        with defer_interrupts():  # a second Ctrl-C must not cut the teardown short (cancel would finish it)
            try:
                from pbs_toolkit.services.stop import teardown

                teardown(session, rec, "ENDED")
            except PbstkError as exc:
                import sys

                sys.stderr.write(f"pbstk: warning: {exc.message}\n")
        raise


def _restarts(profile: Profile, opts: ServeOptions) -> dict[str, Any]:
    """The record's restart policy: ``serve``'s options, else the profile's keys (services/keeper/restarts.py)."""
    return restarts.policy(profile.max_restarts if opts.max_restarts is None else opts.max_restarts,
                           opts.restart_window or profile.restart_window,
                           opts.restart_backoff or profile.restart_backoff).to_dict()


def configure_scaling(settings: LaunchSettings, req: RenderRequest, opts: ServeOptions
              ) -> tuple[LaunchSettings, RenderRequest, ServeOptions, dict[str, Any]]:
    """``serve``'s scaling and idle options, on the settings ``start`` resolved once: with ``opts.scale`` the
    service starts at ``--min-replicas``; its ``--idle-cancel`` (or the profile's ``idle_cancel``) belongs to the
    whole service, so its replicas get none of their own (one ending idle would only be replaced): the settings
    and the request the replicas are launched from (the keeper's too) say ``off``; so does the lease of ``pbstk
    run`` (the request's ``lease_s``: the keeper watches it for the whole service, the replicas get 0). Returns
    them, the options, and the record's ``idle_cancel_s``, ``lease_s``, ``scale``, ``restart`` (the restart
    policy of its replicas) and ``health_rule`` (the profile's ``replica_unhealthy_*``)."""
    from dataclasses import replace
    from types import MappingProxyType

    from pbs_toolkit.durations import parse
    from pbs_toolkit.jobs.idle import watch_seconds

    profile = settings.launchable()
    patience = parse(profile.replica_unhealthy_after, "replica_unhealthy_after")
    extra: dict[str, Any] = {"idle_cancel_s": float(watch_seconds(profile.idle_cancel)),
                             "lease_s": float(req.lease_s),  # pbstk run's lease (services/lease.py)
                             "restart": _restarts(profile, opts),  # checked before anything starts
                             "health_rule": {"looks": profile.replica_unhealthy_looks, "seconds": patience}}
    req = replace(req, idle_cancel="off", lease_s=0)  # the service's lease: its keeper watches it, not each replica
    settings = replace(settings, request=replace(settings.request, idle_cancel="off", lease_s=0),
                       written=replace(settings.written, idle_cancel="off"),
                       profile=replace(settings.profile, idle_cancel="off"),
                       sources=MappingProxyType({**settings.sources, "idle_cancel": "serve (the service's own)"}))
    spec = opts.scale
    if spec is not None:
        spec.check(MAX_REPLICAS)
        if spec.max_replicas > 1:  # every replica it may add must pass the fixed-port rule of a fixed count
            check_fixed_port(profile, req, replace(opts, replicas=spec.max_replicas))
        per_replica = 2 if opts.keep_alive else 1  # a keep-alive replica needs room for its successor
        extra["scale"] = {"spec": spec.to_dict(), "memory": {}, "next_index": spec.min_replicas,
                          "job_cap": profile.max_running_jobs // per_replica}
        opts = replace(opts, replicas=spec.min_replicas)
    return settings, req, opts, extra


def _start_router(session: ServiceSession, rec: ServiceRecord, profile: Profile, command: list[str],
                  place: str) -> None:
    from pbs_toolkit.services.router.process import RouterInfo, start_router

    if place == "job":
        from pbs_toolkit.services.router import job as router_job

        router_job.submit(session, rec, profile, command)  # recorded with the service before the wait
        rec.router = router_job.wait_router(session, rec).to_dict()
        records.save(session.store, rec)
        return
    runner = session.runner(rec.transport)
    if place == "local":
        run_dir = str(service_dir(rec.name) / "router")
        Path(run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        bind = profile.router_bind or "127.0.0.1"
    else:
        run_dir = f"{runner.home()}/.pbstk/services/{rec.name}-{int(rec.created)}/router"
        bind = profile.router_bind or profile.bind_host
    # a loopback bind is reached as itself; otherwise the router module names the host (hostname -f there)
    advertise = bind if bind.startswith("127.") else None

    def record(info: RouterInfo) -> None:  # before the wait: an interrupted serve's teardown stops what it names
        rec.router = info.to_dict()
        records.save(session.store, rec)

    start_router(runner, run_dir, record=record, command=command, bind=bind, advertise=advertise,
                 policy=rec.policy, isolate=profile.router_isolation != "none",
                 extra_args=multi.ROUTER_ARGS if rec.models else ())


def launch_replica(session: ServiceSession, rec: ServiceRecord, slot: Slot, role: str = "current",
                   begin_at: float | None = None, settings: LaunchSettings | None = None) -> str:
    """Launch the slot's next job (the same request, its own name, the service's key) as its ``role``
    (``current`` or ``successor``); its job id. The intent is saved first (services/intents.py): a service
    ended meanwhile launches nothing (``ServiceEnded``), and an interrupted launch is settled by whoever comes next.
    The request is resolved once for the GPUs, the runner and the job (``settings``: ``start`` resolved it)."""
    from pbs_toolkit.services import intents
    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    base = RenderRequest(**rec.request)
    settings = settings or resolve_launch_settings(
        multi.job_request(base, rec.models, slot.index + 1) if rec.models else base)
    name = replica_name(rec.name, slot)
    slot.gen += 1
    intents.begin(slot, name, role)
    if not records.save(session.store, rec):
        intents.clear(slot)
        raise intents.ServiceEnded(f"service {rec.name} was ended; {name} is not launched")
    settings = settings.with_request(name=name)
    result = session.launch(settings, api_key=rec.api_key, begin_at=begin_at)
    job = result.record.job_id
    intents.done(slot, job)
    slot.gpus = {}  # the local scheduler books each job's GPUs itself (schedulers/local/gpus.py)
    records.save(session.store, rec)
    return job


__all__ = ["ServeOptions", "start"]
