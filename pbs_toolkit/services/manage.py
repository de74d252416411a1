"""Start, look at and stop a service: N replica jobs behind one vllm-router, one URL and one key.

Replica ``k`` is an ordinary pbstk job named ``NAME-r<k>`` (its keep-alive successors ``NAME-r<k>-g<gen>``),
launched through the normal launch path with the service's key, so the one key works through the router (the
router passes the client's ``Authorization`` header on to the worker). Replica jobs never get registry entries
of their own: the service's entry is the router's URL. The keeper (services/keeper.py) then adds READY
replicas to the router, removes the ones that end, and with keep-alive launches successors.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit import paths
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.services import record as records
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.scaler import configure, status_fields
from pbs_toolkit.services.state import service_state, serving_job

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.render import RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.services.ready import RouteCheck
    from pbs_toolkit.settings.profiles import Profile

#: the most replicas one service may have: each is a job of its own, and a typo should not queue thousands
MAX_REPLICAS = 1000
#: ``--handover`` default: the successor becomes eligible this long before its predecessor's walltime ends
DEFAULT_HANDOVER_S = 600.0
#: a running keeper whose last successful tick is older than 3 polls plus this is reported as making no progress
STUCK_GRACE_S = 120.0


def service_dir(name: str) -> Path:
    """``$XDG_STATE_HOME/pbstk/services/NAME``: the keeper's lock, pid file and log, a local router's files."""
    return paths.user_state_dir() / "services" / name


def replica_name(service: str, slot: Slot) -> str:
    return f"{service}-r{slot.index}" if slot.gen == 0 else f"{service}-r{slot.index}-g{slot.gen}"


def router_place(profile: Profile) -> str:
    """Where the router runs: ``auto`` is this machine without an SSH host, the login node with one; ``job`` a
    small CPU job of the profile's scheduler (services/router_job.py)."""
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


def check_fixed_port(profile: Profile, req: RenderRequest, opts: ServeOptions) -> None:
    """A fixed ``--port N`` on the local scheduler: every replica (and a keep-alive successor, which overlaps its
    predecessor) runs on this one machine, so a second server would find N taken. Refused rather than silently
    made automatic: the user asked for that exact port. Other schedulers place replicas on their own nodes."""
    fixed = isinstance(req.port, int) or (isinstance(req.port, str) and req.port.isdigit())
    if not fixed or profile.scheduler != "local" or (opts.replicas < 2 and not opts.keep_alive):
        return
    why = f"--replicas {opts.replicas}" if opts.replicas > 1 else "--keep-alive (a successor overlaps its predecessor)"
    raise UsageError(f"--port {req.port} with {why} on the local scheduler: every replica runs on this machine and "
                     f"would bind the same port; leave --port out (each replica then picks a free port)")


def check_router_command(client: Client, profile: Profile, command: list[str]) -> None:
    """The router program must exist where it will run (one clear line now, not a failed start later)."""
    program = command[0]
    if not profile.ssh_host:
        if not (shutil.which(program) or (os.sep in program and os.access(program, os.X_OK))):
            raise UsageError(f"router command {program!r} not found (profile key router_command; "
                             f"pip install vllm-router)")
        return
    result = client.runner(profile.ssh_host).run(["sh", "-c", 'command -v "$1"', "sh", program], timeout=30)
    if result.rc != 0:
        raise UsageError(f"router command {program!r} not found on {profile.ssh_host} (profile key "
                         f"router_command; pip install vllm-router there)")


def _served_name(req: RenderRequest, name: str) -> str:
    from pbs_toolkit.jobs.render import _HF_ID

    return req.served_model_name or (req.model if _HF_ID.match(req.model) and "/" in req.model else name)


@dataclass
class ServeOptions:
    replicas: int = 1
    name: str | None = None
    keep_alive: bool = False
    handover_s: float = DEFAULT_HANDOVER_S
    policy: str | None = None
    nodes_per_replica: int | None = None
    api_key: str | None = field(default=None, repr=False)
    scale: Any = None  # services/autoscale.py ScaleSpec: autoscaling between its min and max replicas


def start(client: Client, req: RenderRequest, opts: ServeOptions) -> ServiceRecord:
    """Check everything, record the service, start the router, launch the replicas, start the keeper."""
    from pbs_toolkit.jobs.render import checked_profile, slug
    from pbs_toolkit.settings.profiles import ROUTER_POLICIES, walltime_seconds

    req, opts, extra = configure(req, opts)  # --min/--max-replicas, --idle-cancel: services/scaler.py
    if opts.replicas < 1:
        raise UsageError(f"--replicas {opts.replicas}: a service needs at least 1 replica")
    if opts.replicas > MAX_REPLICAS:
        raise UsageError(f"--replicas {opts.replicas}: at most {MAX_REPLICAS} replicas per service (each is a job)")
    name = opts.name or slug(req.model.rsplit("/", 1)[-1])
    records.check_name(name)
    if opts.nodes_per_replica:
        req = replace(req, nodes=opts.nodes_per_replica)
    req = replace(req, name=None, served_model_name=_served_name(req, name))
    profile = checked_profile(req)
    check_fixed_port(profile, req, opts)
    place = router_place(profile)
    policy = opts.policy or profile.router_policy
    if policy not in ROUTER_POLICIES:
        raise UsageError(f"--policy {policy!r}: must be one of {', '.join(ROUTER_POLICIES)}")
    walltime_s = walltime_seconds(profile.walltime)
    if opts.keep_alive:
        if place == "job":  # the router's own job would end at its walltime, and the URL with it
            from pbs_toolkit.services.router_job import KEEP_ALIVE_REFUSED

            raise UsageError(KEEP_ALIVE_REFUSED)
        check_keep_alive(profile, opts.replicas, opts.handover_s, walltime_s)
    command = shlex.split(profile.router_command)
    if place != "job":  # a router job looks for it on its node (and fails with its own line)
        check_router_command(client, profile, command)
    rec = ServiceRecord(name=name, model=req.model, served_model_name=req.served_model_name or name,
                        profile=profile.name, replicas=opts.replicas, request=asdict(req),
                        transport=profile.ssh_host or "", scheduler=profile.scheduler, keep_alive=opts.keep_alive,
                        handover_s=opts.handover_s, walltime_s=walltime_s, policy=policy,
                        slots=[Slot(k) for k in range(opts.replicas)],
                        api_key=opts.api_key or secrets.token_urlsafe(32), **extra)
    records.create(client.store, rec)  # refuses a second active service of that name
    try:
        _start_router(client, rec, profile, command, place)
        for slot in rec.slots:
            launch_replica(client, rec, slot)
        spawn_keeper(name)
    except BaseException:
        from pbs_toolkit.jobs.launch import defer_interrupts

        with defer_interrupts():  # a second Ctrl-C must not cut the teardown short (cancel would finish it)
            try:
                from pbs_toolkit.services.stop import teardown

                teardown(client, rec, "ENDED")
            except PbstkError as exc:
                import sys

                sys.stderr.write(f"pbstk: warning: {exc.message}\n")
        raise
    return rec


def _start_router(client: Client, rec: ServiceRecord, profile: Profile, command: list[str], place: str) -> None:
    from pbs_toolkit.services.router import start_router

    if place == "job":
        from pbs_toolkit.services import router_job

        router_job.submit(client, rec, profile, command)  # recorded with the service before the wait
        rec.router = router_job.wait_router(client, rec).to_dict()
        records.save(client.store, rec)
        return
    runner = client.runner(rec.transport)
    if place == "local":
        run_dir = str(service_dir(rec.name) / "router")
        Path(run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        bind = profile.router_bind or "127.0.0.1"
    else:
        run_dir = f"{runner.home()}/.pbstk/services/{rec.name}-{int(rec.created)}/router"
        bind = profile.router_bind or profile.bind_host
    # a loopback bind is reached as itself; otherwise the router module names the host (hostname -f there)
    advertise = bind if bind.startswith("127.") else None
    info = start_router(runner, run_dir, command=command, bind=bind, advertise=advertise, policy=rec.policy,
                        isolate=profile.router_isolation != "none")
    rec.router = info.to_dict()
    records.save(client.store, rec)


def launch_replica(client: Client, rec: ServiceRecord, slot: Slot, role: str = "current",
                   begin_at: float | None = None) -> str:
    """Launch the slot's next job (the same request, its own name, the service's key) as its ``role``
    (``current`` or ``successor``); its job id. The intent is saved first (services/intents.py): a service
    ended meanwhile launches nothing (``ServiceEnded``), and an interrupted launch is settled by whoever comes next."""
    from pbs_toolkit.jobs.render import RenderRequest
    from pbs_toolkit.services import intents

    fields: dict[str, Any] = dict(rec.request)
    fields["name"] = replica_name(rec.name, slot)
    gpus = gpu_env(rec, slot)
    fields["env"] = {**(fields.get("env") or {}), **gpus}
    slot.gen += 1
    intents.begin(slot, fields["name"], role)
    if not records.save(client.store, rec):
        intents.clear(slot)
        raise intents.ServiceEnded(f"service {rec.name} was ended; {fields['name']} is not launched")
    result = client.launch_request(RenderRequest(**fields), api_key=rec.api_key, begin_at=begin_at)
    job = result.record.job_id
    intents.done(slot, job)
    slot.gpus = {j: v for j, v in slot.gpus.items() if j in slot.jobs()}
    if gpus:
        slot.gpus[job] = gpus["CUDA_VISIBLE_DEVICES"]
    records.save(client.store, rec)
    return job


def gpu_env(rec: ServiceRecord, slot: Slot) -> dict[str, str]:
    """On the local scheduler each job gets its own GPUs when this machine has them: the first ``g`` that none
    of the service's jobs holds (a keep-alive successor overlaps its predecessor: it must not share its GPUs),
    else replica ``k``'s ``k*g .. k*g+g-1`` as before (shared, when the machine has no free ones)."""
    if rec.scheduler != "local" or rec.transport:
        return {}
    from pbs_toolkit.jobs.render import RenderRequest, resolve_profile

    g = resolve_profile(RenderRequest(**rec.request))[0].gpus_per_node
    have = _local_gpu_count()
    if g <= 0 or have < g:
        return {}

    def usual(k: int) -> list[int]:  # replica k's own GPUs, when the machine has them
        return list(range(k * g, k * g + g)) if have >= k * g + g else []

    def held(s: Slot, job: str) -> list[int]:  # a job recorded without GPUs (older records): its replica's usual
        text = s.gpus.get(job)
        return [int(i) for i in text.split(",") if i.isdigit()] if text else usual(s.index)

    busy = {gpu for s in rec.slots for job in s.jobs() for gpu in held(s, job)}
    free = [i for i in range(have) if i not in busy]
    chosen = free[:g] if len(free) >= g else usual(slot.index)
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in chosen)} if chosen else {}


def _local_gpu_count() -> int:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)  # noqa: S607
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# -- the keeper process --------------------------------------------------------------------------------------


def spawn_keeper(name: str, wait_s: float = 10.0) -> int:
    """``python -m pbs_toolkit _keeper NAME`` in its own session, logging to the service dir; its pid once it
    holds its lock (so ``status`` right after never says it is not running)."""
    import subprocess
    import sys

    directory = service_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(directory / "keeper.log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "_keeper", name],  # noqa: S603
                                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                                close_fds=True)
    finally:
        os.close(fd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if keeper_alive(name):
            return proc.pid
        if proc.poll() is not None:
            raise PbstkError(f"the keeper of service {name} exited at once; see {directory / 'keeper.log'}")
        time.sleep(0.05)
    raise PbstkError(f"the keeper of service {name} did not start; see {directory / 'keeper.log'}")


def keeper_alive(name: str) -> bool:
    """Whether a keeper holds the service's lock (a lock, not a pid: a reused pid can never look alive)."""
    import fcntl

    path = service_dir(name) / "keeper.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def stop_keeper(name: str, timeout: float) -> None:
    """Wait for the keeper to see the service ended; then SIGTERM it (only the process holding our token)."""
    import json
    import signal

    from pbs_toolkit.jobs.store import launcher_alive

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not keeper_alive(name):
            return
        time.sleep(0.1)
    try:
        info = json.loads((service_dir(name) / "keeper.json").read_text())
        if int(info["pid"]) != os.getpid() and launcher_alive(info["token"]):  # the keeper's own teardown: idle
            os.kill(int(info["pid"]), signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pass


# -- looking at a service ---------------------------------------------------------------------------------


@dataclass
class ServiceStatus:
    record: ServiceRecord
    state: str
    ready: int
    replicas: list[JobStatus]
    keeper_running: bool
    router_running: bool
    #: ``router: job``: the router job's scheduler state (``running``, ``queued``, ...; ``gone`` when unknown)
    router_job_state: str | None = None
    #: what the router said (its workers, a request with the key through it); ``None``: not asked (not running)
    route: RouteCheck | None = None
    #: the keeper's heartbeat (services/keeper.py ``last_tick``): ``ok_at``, ``error``, ``error_at``, ``failures``
    keeper_tick: dict[str, Any] = field(default_factory=dict)

    @property
    def keeper_stuck(self) -> str | None:
        """Why the keeper, though running, is not making progress (its last ticks failed), or ``None``."""
        tick = self.keeper_tick
        if not self.keeper_running or not tick:
            return None
        age = time.time() - tick["ok_at"] if tick.get("ok_at") else None
        since = f"last successful tick {age:.0f} s ago" if age is not None else "no successful tick yet"
        if tick.get("error"):
            return f"{since}, {tick.get('failures') or 1} failed since: {tick['error']}"
        if age is not None and age > 3 * poll_seconds() + STUCK_GRACE_S:  # a tick that hangs (a hung query, a tunnel)
            return f"{since}, none since"
        return None

    @property
    def url(self) -> str | None:
        return self.record.url

    @property
    def summary(self) -> str:
        """``READY 3/4 replicas``"""
        return f"{self.state} {self.ready}/{self.record.replicas} replicas"

    def to_dict(self) -> dict[str, Any]:
        """A ``service`` object (docs/json.md): no key in it."""
        from pbs_toolkit.schema import stamp

        rec = self.record
        return stamp("service", {
            "name": rec.name, "model": rec.model, "served_model_name": rec.served_model_name,
            "profile": rec.profile, "transport": rec.transport or "local", "state": self.state,
            "ready": self.ready, "replicas": rec.replicas, "url": rec.url, "keep_alive": rec.keep_alive,
            "handover_s": rec.handover_s, "policy": rec.policy, "created": rec.created, "ended": rec.ended,
            "keeper_running": self.keeper_running, "router_running": self.router_running,
            "keeper": {"last_tick": self.keeper_tick.get("ok_at"), "error": self.keeper_tick.get("error"),
                       "error_at": self.keeper_tick.get("error_at"), "failures": self.keeper_tick.get("failures", 0)},
            "router": {k: v for k, v in rec.router.items() if k not in ("token", "admin_token")},
            "router_job": {**rec.router_job, "state": self.router_job_state} if rec.router_job else None,
            "router_workers": self.route.workers if self.route is not None else None,
            "route_status": self.route.status if self.route is not None else None,
            "slots": [asdict(s) for s in rec.slots], **status_fields(rec), "jobs": [s.to_dict() for s in self.replicas],
        })


def look(client: Client, rec: ServiceRecord, known: Mapping[str, JobStatus] | None = None) -> ServiceStatus:
    """One status query over the service's jobs, the router and the keeper: what ``status NAME`` shows.
    ``known``: statuses already taken in a larger batch (``Client.service_statuses``): no query of its own."""
    from pbs_toolkit.services.ready import RouteCheck, check_route, routable_count, still_starting
    from pbs_toolkit.services.router import RouterInfo, router_alive

    jobs = [j for s in rec.slots for j in s.jobs()]
    if known is not None:
        statuses = [known[j] for j in jobs if j in known] if rec.ended is None else []
    else:
        statuses = client.status(*_recorded(client, jobs)) if jobs and rec.ended is None else []
    router, job_state = False, None
    if rec.router_job and rec.ended is None:
        router, job_state = _router_job_alive(client, rec)
    elif rec.router and rec.ended is None:
        try:
            router = router_alive(client.runner(rec.transport), RouterInfo.from_dict(rec.router))
        except PbstkError:
            router = False
    route = None
    if router:  # READY means routable: the router lists the replica and a request with the key gets through
        try:
            route = check_route(client, rec)
        except PbstkError:
            route = RouteCheck(None, None)
    workers = (route.workers or []) if route is not None and route.ok else []
    by_id = {st.record.job_id: st for st in statuses}
    ready = routable_count(rec.slots, by_id, workers) if rec.ended is None else 0
    if ready >= rec.replicas:
        rec.ever_ready = True
    state = service_state(rec, ready, still_starting(rec.slots, by_id, workers))
    if rec.ended is None and not router and rec.router:
        state = "DOWN"  # and 0/N: nothing is reachable through the URL
    from pbs_toolkit.services.keeper import last_tick

    running = keeper_alive(rec.name) if rec.ended is None else False
    return ServiceStatus(rec, state, ready, statuses, running, router, job_state, route,
                         keeper_tick=last_tick(rec.name) if running else {})


def _recorded(client: Client, jobs: list[str]) -> list[Any]:
    """The records of ``jobs`` the store knows (one cleaned away or lost is shown as missing, not an error)."""
    by_id = {r.job_id: r for r in client.store.all()}
    return [by_id[j] for j in jobs if j in by_id]


def _router_job_alive(client: Client, rec: ServiceRecord) -> tuple[bool, str | None]:
    """(router running, the router job's state): the job runs and its router answers."""
    from pbs_toolkit.schedulers import SchedState
    from pbs_toolkit.services import router_job
    from pbs_toolkit.services.router import RouterInfo

    if not rec.router_job.get("job_id"):
        return False, "submitting"  # its submission was interrupted: `pbstk cancel NAME` settles it
    try:
        seen = router_job.query(client, rec)
    except PbstkError:
        return False, None  # the scheduler did not answer: unknown, shown as not running
    if seen is None:
        return False, "gone"
    if seen.state != SchedState.RUNNING or not rec.router:
        return False, seen.state.value
    return router_job.router_answers(client, RouterInfo.from_dict(rec.router)), seen.state.value


# -- stopping ----------------------------------------------------------------------------------------------


def teardown(client: Client, rec: ServiceRecord, final: str, **kwargs: Any) -> list[tuple[str, str, bool]]:
    """``services.stop.teardown`` (it lives there; kept here for callers of this name)."""
    from pbs_toolkit.services.stop import teardown as stop

    return stop(client, rec, final, **kwargs)


def poll_seconds() -> float:
    """``PBSTK_SERVICE_POLL_S``: seconds between two looks of the keeper (default 15)."""
    return env_float("PBSTK_SERVICE_POLL_S", 15.0, lambda v: 0.1 <= v <= 3600)


# -- the service as a job, for the registry code (endpoints/ takes a JobStatus) ----------------------------


def service_job_record(rec: ServiceRecord) -> Any:
    """A ``JobRecord`` standing for the service: id ``service:NAME``, the router's key and the service's name."""
    from pbs_toolkit.jobs.launch import key_env_name
    from pbs_toolkit.jobs.store import JobRecord

    return JobRecord(job_id=rec.entry_id, scheduler=rec.scheduler, profile=rec.profile, model=rec.model,
                     served_model_name=rec.served_model_name, preset="service", name=rec.name,
                     run_dir=str(service_dir(rec.name)), transport=rec.transport, created=rec.created,
                     api_key=rec.api_key, api_key_env=key_env_name(rec.name) if rec.api_key else None)


def service_job_status(rec: ServiceRecord) -> JobStatus:
    """A READY ``JobStatus`` at the router's address: what ``update_endpoint`` and ``env_values`` read."""
    from pbs_toolkit.jobs.status import JobStatus, ServerState

    return JobStatus(record=service_job_record(rec), state=ServerState.READY, address=rec.router["host"],
                     port=int(rec.router["port"]))


__all__ = ["ServeOptions", "ServiceStatus", "look", "serving_job", "start"]
