"""``pbstk run [launch or serve options] MODEL -- COMMAND [ARGS...]``: a server for exactly as long as a command
needs it (docs/campaigns.md "pbstk run").

1. Launch a job (``--replicas N``: a service), or take the job or service ``--reuse NAME`` names; wait until
   READY. A launch or wait that fails cancels what was launched and raises pbstk's own error (its exit code);
   COMMAND never runs then.
2. Work out how COMMAND reaches the server from here: directly, or through a tunnel over the job's SSH
   connection when the node does not answer from this machine (``tunnel=True`` forces one).
3. With ``registry``: write the entry (removed again at the end, whatever happens).
4. Run COMMAND in its own process group with ``pbstk env``'s variables added to this environment (the key only
   there, never in an argument). SIGINT, SIGTERM and SIGHUP received meanwhile go to COMMAND's group; what is
   still running ``grace_s`` later is killed, and so is whatever COMMAND left behind in its group.
5. Remove the entry, close the tunnel, and unless ``keep`` (or the server was reused) drain the server (until
   no request runs or waits, at most ``drain_s``) and cancel it, its counters recorded first (``pbstk usage``).

The result is COMMAND's exit status (``128 + N`` when signal N ended it). Several models (``serve["models"]``,
a multi-model service) or ``each`` (COMMAND once per model, campaigns/each.py): docs/campaigns.md "Several
models"; the result is then the worst of the runs' statuses.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.campaigns import counters, each, lease
from pbs_toolkit.campaigns.children import SIGNALS, run_command
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, ServerFailed, UsageError
from pbs_toolkit.perf.scrape import wait_drained
from pbs_toolkit.services.keeper.process import service_dir
from pbs_toolkit.signal_scope import handled_by

if TYPE_CHECKING:
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.render import RenderRequest
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.services.session import ServiceSession

#: the most the end looks for the scheduler to confirm the cancelled jobs ended (to record it)
SETTLE_S = 30.0


def grace_seconds() -> float:
    """``PBSTK_RUN_GRACE_S``: how long COMMAND has to end after a forwarded signal before it is killed (10)."""
    return env_float("PBSTK_RUN_GRACE_S", 10.0, lambda v: 0 <= v < float("inf"))


def drain_seconds() -> float:
    """``PBSTK_RUN_DRAIN_S``: the most the end waits for requests still running on the server (30)."""
    return env_float("PBSTK_RUN_DRAIN_S", 30.0, lambda v: 0 <= v < float("inf"))


@dataclass
class RunPlan:
    """What ``run`` does; ``request`` is ``None`` with ``reuse``."""

    command: list[str]
    request: RenderRequest | None = None
    reuse: str | None = None
    replicas: int = 1
    #: ``Client.serve`` keywords besides the request and ``replicas`` (a service: ``replicas`` > 1 or any set)
    serve: dict[str, Any] = field(default_factory=dict)
    #: secret: never in ``repr``
    api_key: str | None = field(default=None, repr=False)
    use_api_key: bool = field(default=True, repr=False)
    registry: str | None = None
    alias: str | None = None
    fmt: str = "auto"
    keep: bool = False
    tunnel: bool = False
    timeout: float = 3600.0
    #: stage a Hub model an offline profile's nodes lack before launching (``launch --stage``)
    stage: bool = False
    #: ``--each``: COMMAND once per model, ``{model}``/``{alias}`` replaced (campaigns/each.py); ``parallel`` at once
    each: bool = False
    parallel: int = 1
    #: the served names in the order the user gave them: ``--each`` runs and ``PBSTK_MODELS`` follow it (the
    #: service lists its models in the plan's order, largest first)
    order: list[str] = field(default_factory=list)

    @property
    def several(self) -> bool:
        """A multi-model service is launched (``serve`` holds the plan's ``models``)."""
        return bool(self.serve.get("models"))


@dataclass
class RunHooks:
    """How ``run`` talks: ``notice`` gets pbstk's own lines (stderr in the CLI); ``wait_job``/``wait_service``
    wait with the caller's progress display (default: the client's plain waits)."""

    notice: Callable[[str], None] = lambda _m: None
    wait_job: Callable[[Client, JobRecord, float], Any] | None = None
    wait_service: Callable[[Client, ServiceRecord, float], Any] | None = None
    #: ``--each``: the runs once they all ended (the CLI prints their table)
    each_done: Callable[[list[each.ModelRun]], None] = lambda _runs: None


class _Stopped(BaseException):
    """A SIGTERM or SIGHUP before COMMAND ran: what was launched is cancelled, then pbstk exits 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class _Target:
    record: JobRecord | None = None
    service: ServiceRecord | None = None
    launched: bool = False
    entries: list[Any] = field(default_factory=list)  # the registry entries written (EndpointUpdate each)
    prior: Any = None  # the registry before it (endpoints/register.py ``Prior``): what the end puts back

    @property
    def name(self) -> str:
        return self.service.name if self.service else self.record.job_id if self.record else "?"

    def models(self, order: Sequence[str] = ()) -> list[tuple[str, str]]:
        """``(served name, alias)`` of each model the server serves: a multi-model service's (those named in
        ``order`` first, in that order), else its one; the alias is the registry entry's for that model when the
        run wrote one, else the served name."""
        if self.service is not None:
            served = [m["served_model_name"] for m in self.service.models] or [self.service.served_model_name]
        else:
            served = [self.record.served_model_name if self.record else "?"]
        aliases = {e.model: e.alias for e in self.entries}
        served.sort(key=lambda s: list(order).index(s) if s in order else len(order))
        return [(s, aliases.get(s, s)) for s in served]


def check_command(command: Sequence[str]) -> None:
    """Refuse, before anything is launched, a COMMAND that cannot be started here."""
    if not command:
        raise UsageError("run needs a COMMAND after `--` (e.g. `pbstk run MODEL -- python eval.py`)")
    program = command[0]
    found = shutil.which(program) if os.sep not in program else (program if os.path.isfile(program) else None)
    if found is None:
        raise UsageError(f"COMMAND {program!r} was not found (not on PATH, or no such file)")
    if not os.access(found, os.X_OK):
        raise UsageError(f"COMMAND {program!r} is not executable")


def check_plan(plan: RunPlan) -> None:
    """Refuse, before anything is launched or waited for, what would only fail later: COMMAND, and the registry
    (the file, its format, the alias) where one is given; ``--alias``/``--format`` without ``--registry``."""
    from pbs_toolkit.endpoints import check_registry_for

    check_command(plan.command)
    if plan.each:
        each.check_placeholders(plan.command)
    elif plan.parallel != 1:
        raise UsageError("--parallel N runs COMMAND for several models at once: give --each too")
    if plan.several and plan.alias is not None:
        raise UsageError("--alias names one entry; with several models each entry's alias is its served name")
    if plan.registry is None:
        if plan.alias is not None or plan.fmt != "auto":
            raise UsageError("--alias and --format describe the entry --registry writes; give --registry too")
        return
    check_registry_for(plan.registry, plan.fmt, plan.alias)


def run(client: Client, plan: RunPlan, hooks: RunHooks | None = None) -> int:
    """The whole of ``pbstk run``; returns COMMAND's exit status (``PbstkError`` when no COMMAND ran)."""
    hooks = hooks or RunHooks()
    check_plan(plan)
    target = _Target()
    code: int | None = None
    renewal = lease.Renewal(hooks.notice)  # the job's lease (campaigns/lease.py), renewed until the end is done
    with _terminating():
        try:
            _start(client, plan, hooks, target, lambda: renewal.start(
                _leased(client, plan, target), plan.request.lease_s if plan.request else 0))
            env = _environment(client, plan, target, hooks)
            code = _run_commands(plan, target, env, hooks, client.service_session())
        except _Stopped as stop:
            hooks.notice(f"{signal.Signals(stop.signum).name} received before COMMAND ran")
            code = 128 + stop.signum
        except KeyboardInterrupt:  # Ctrl-C while launching or waiting: what was launched is cancelled below
            hooks.notice("SIGINT received before COMMAND ran")
            code = 128 + signal.SIGINT
        except _Launched as launched:  # interrupted while submitting: the job is cancelled below
            target.record, target.launched = launched.record, True
            hooks.notice(f"interrupted while {launched.record.job_id} was submitted")
            code = launched.code
        finally:
            with _held() as later:
                _finish(client, plan, target, hooks, later)
            renewal.stop()
    return code if code is not None else 1


def _leased(client: Client, plan: RunPlan, target: _Target) -> list[tuple[Any, str]]:
    """The directory (and its runner) whose lease the run renews, unless kept: the run directory of the job it
    launched; for a service, the service's directory on this machine, which its keeper watches."""
    if not target.launched or plan.keep:
        return []
    if target.service is not None:
        return [(client.runner(""), str(service_dir(target.service.name)))]
    if target.record is None:
        return []
    return [(client.runner(target.record.transport), target.record.run_dir)]


def _start(client: Client, plan: RunPlan, hooks: RunHooks, target: _Target,
           launched: Callable[[], None] = lambda: None) -> None:
    """Launch (or find) the server and wait until it is READY; ``launched`` runs once the launch is recorded,
    before the wait (the lease is renewed from then on: the job's watcher starts at its own READY)."""
    if plan.reuse:
        svc = client.service(plan.reuse)
        if svc is not None:
            target.service = svc
        else:
            target.record = client.record(plan.reuse)
    elif plan.request is not None:
        # the weights preflight (weights/preflight.py) runs inside launch and serve, before anything is queued:
        # an offline profile's unstaged model is refused (exit 11), or staged first with plan.stage
        if plan.replicas > 1 or plan.serve:
            target.service = client.serve(plan.request, replicas=plan.replicas, api_key=plan.api_key,
                                          stage=plan.stage, **plan.serve)
        else:
            target.record = _launch(client, plan)
        target.launched = True
        launched()
        size = f" ({len(target.service.models)} models in {target.service.replicas} job(s))" if target.service \
            and target.service.models else f" ({plan.replicas} replicas)" if target.service else ""
        hooks.notice(f"launched {target.name}{size}"
                     + ("; it is cancelled when COMMAND ends" if not plan.keep else "; --keep: it stays up"))
    else:
        raise UsageError("run needs MODEL to launch, or --reuse NAME")
    if target.service is not None:
        if target.service.ended is not None:
            raise ServerFailed(f"service {target.service.name} has ended ({target.service.state})")
        started = time.monotonic()
        (hooks.wait_service or (lambda c, s, t: c.wait_service(s, t)))(client, target.service, plan.timeout)
        if target.service.models:  # READY counts jobs: wait until the router has every model's server too
            each.wait_models(client.service_session(), target.service,
                             plan.timeout - (time.monotonic() - started))
    else:
        assert target.record is not None
        (hooks.wait_job or (lambda c, r, t: c.wait(r, t)))(client, target.record, plan.timeout)


def _launch(client: Client, plan: RunPlan) -> JobRecord:
    """``launch_request``; when a signal arrives while the job is submitted, launch records it and then exits
    (jobs/launch.py ``defer_interrupts``): the job is found by its name (unique among active jobs) so that the
    end of ``run`` cancels it."""
    from pbs_toolkit.jobs.plan import slug

    assert plan.request is not None
    started, name = time.time(), plan.request.name or slug(plan.request.model)
    try:
        return client.launch_request(plan.request, api_key=plan.api_key, use_api_key=plan.use_api_key,
                                     stage=plan.stage).record
    except (SystemExit, KeyboardInterrupt) as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 130
        for record in client.store.all():
            if record.name == name and not record.final_state and record.created >= started - 1:
                raise _Launched(record, code) from None
        raise


class _Launched(BaseException):
    """A launch interrupted once its job was recorded: ``record`` is to be cancelled."""

    def __init__(self, record: JobRecord, code: int) -> None:
        super().__init__(record.job_id)
        self.record, self.code = record, code


def _environment(client: Client, plan: RunPlan, target: _Target, hooks: RunHooks) -> dict[str, str]:
    """This environment plus the endpoint's variables; the registry entry and the tunnel on the way."""
    if target.service is not None:
        from pbs_toolkit.services.entry import service_job_status

        st = service_job_status(target.service)
    else:
        st = client.ready_status(target.record)
    from urllib.parse import urlsplit

    from pbs_toolkit.endpoints import endpoint_url

    transport = st.record.transport if target.service is None else target.service.transport
    tunnel = plan.tunnel or (bool(transport) and not reachable(urlsplit(endpoint_url(st)).hostname, st.port))
    local_url = None
    if plan.registry is not None:
        from pbs_toolkit.endpoints.register import note_prior

        target.prior = note_prior(client.store, plan.registry, plan.fmt)
        if target.service is not None and target.service.models:  # an entry per model, its served name
            if plan.alias is not None:  # a --reuse'd multi-model service (a launched one is refused earlier)
                raise UsageError(f"--alias names one entry; service {target.service.name} has several models, "
                                 "each entry's alias is its served name")
            target.entries = client.update_model_endpoints(target.service, plan.registry, fmt=plan.fmt,
                                                           via_tunnel=tunnel)
        elif target.service is not None:
            target.entries = [client.update_service_endpoint(target.service, plan.registry, fmt=plan.fmt,
                                                             alias=plan.alias, via_tunnel=tunnel)]
        else:
            target.entries = [client.update_endpoint(st.record, plan.registry, fmt=plan.fmt, alias=plan.alias,
                                                     timeout=plan.timeout, via_tunnel=tunnel)]
        for entry in target.entries:
            back = "put back" if entry.alias in target.prior.aliases() else "removed"
            hooks.notice(f"{entry.registry}: {entry.alias} -> {entry.url} ({back} at the end)")
        local_url = client.tunnels[-1].url if tunnel else None
    elif tunnel:
        local_url = client.tunnel(st)[1].url
    if local_url:
        hooks.notice(f"{st.address}:{st.port} is reached through a tunnel on {local_url}")
    ep = client.service_endpoint(target.service, local_url) if target.service is not None \
        else client.endpoint(st.record, local_url)
    env = {**os.environ, **ep.env}
    if target.service is not None and target.service.models:  # no one model: COMMAND names them itself
        env.pop("PBSTK_MODEL", None)  # (a shell's own, too)
        env["PBSTK_MODELS"] = " ".join(served for served, _alias in target.models(plan.order))
    return env


def _run_commands(plan: RunPlan, target: _Target, env: dict[str, str], hooks: RunHooks,
                  session: ServiceSession | None = None) -> int:
    """COMMAND once (its exit status), or with ``each`` once per model (the worst status; ``128 + N`` when
    signal N interrupted the runs); a service's runs wait while their model's job is replaced
    (``each.ModelGate``)."""
    watch = _watch_note(target)
    if not plan.each:
        hooks.notice(f"running {' '.join(plan.command)} against {env['OPENAI_BASE_URL']}")
        return run_command(plan.command, env, hooks.notice, grace_seconds(), watch)
    models = target.models(plan.order)
    hooks.notice(f"running {' '.join(plan.command)} for each of {len(models)} model(s) against "
                 f"{env['OPENAI_BASE_URL']}" + (f", {plan.parallel} at once" if plan.parallel > 1 else ""))
    gate = (each.ModelGate(session, target.service.name, hooks.notice)
            if target.service is not None and session is not None else None)
    runs, received = each.run_each(models, plan.command, env, hooks.notice, parallel=plan.parallel,
                                   logs=each.log_dir(target.name) if plan.parallel > 1 else None,
                                   grace_s=grace_seconds(), gate=gate, watch=watch)
    hooks.each_done(runs)
    return 128 + received[0] if received else each.worst(runs)


def _watch_note(target: _Target) -> tuple[str, str]:
    """Where the watch over COMMAND notes that it ended COMMAND because this run was gone, and what it says:
    ``status`` of the run's job (or service) shows it (jobs/lease.py ``command_note``)."""
    from pbs_toolkit.jobs.lease import fresh_command_note

    key = f"service-{target.service.name}" if target.service else target.record.job_id if target.record else ""
    return fresh_command_note(key), f"pbstk run (pid {os.getpid()}) was gone: the watch ended its COMMAND"


def reachable(host: str | None, port: int | None, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the server opens from this machine."""
    if not host or not port:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _finish(client: Client, plan: RunPlan, target: _Target, hooks: RunHooks, interrupts: list[int]) -> None:
    """Entry out, tunnel closed, then (unless kept or reused) drain and cancel. Errors become notices: the
    exit status is COMMAND's."""
    for update in target.entries:
        _remove_entry(client, target, update, hooks)
    for tunnel in list(client.tunnels):
        tunnel.close()
        client.tunnels.remove(tunnel)
    if not target.launched:
        return
    if plan.keep:
        hooks.notice(f"--keep: {target.name} stays up (`pbstk cancel {target.name}` stops it)")
        return
    try:
        _drain(client, target, hooks, interrupts)
        if target.service is not None:
            client.cancel_service(target.service)
        elif target.record is not None:
            client.cancel(target.record)
        hooks.notice(f"cancelled {target.name}")
    except PbstkError as exc:
        hooks.notice(f"warning: {target.name} was not cancelled: {exc.message}; `pbstk cancel {target.name}`")
        return
    _settle(client, _servers(client, target), interrupts)
    summary = usage_line(client, target.service.name if target.service else target.name)
    if summary:
        hooks.notice(summary)


def usage_line(client: Client, ref: str) -> str | None:
    """One line of what the server used (``pbstk usage REF`` has the table); ``None`` when it cannot be said."""
    from pbs_toolkit.campaigns.usage import collect

    try:
        totals = collect(client, [ref]).totals.to_dict()
    except PbstkError:
        return None

    def n(value: Any, unit: str) -> str:
        return f"{'-' if value is None else round(value, 3)} {unit}"

    return (f"usage: {n(totals['node_hours'], 'node-h')}, {n(totals['gpu_hours'], 'GPU-h')}, "
            f"{n(totals['requests'], 'requests')}, {n(totals['output_tokens'], 'output tokens')} "
            f"(`pbstk usage {ref}` for the table)")


def _remove_entry(client: Client, target: _Target, update: Any, hooks: RunHooks) -> None:
    """Take out the entry this run added, or put back the one it replaced: a run removes only what it added."""
    from pbs_toolkit.endpoints.register import give_back
    from pbs_toolkit.endpoints.retire import retire

    try:
        given = give_back(client.store, target.prior, update) if target.prior is not None else None
    except PbstkError as exc:
        hooks.notice(f"warning: the entry {update.alias} in {update.registry} was not put back: {exc.message}")
        return
    if given is not None:
        client.on_removal(given)
        return
    if target.service is not None:
        from pbs_toolkit.services.entry import service_job_record

        record = service_job_record(target.service)
    else:
        record = target.record
    mine = [e for e in client.store.registry_entries(record)
            if e.registry == update.registry and e.alias == update.alias]
    try:
        retire(client.store, record, include_kept=True, entries=mine, notice=client.on_removal)
    except PbstkError as exc:
        hooks.notice(f"warning: the entry {update.alias} in {update.registry} was not removed: {exc.message}")


def _servers(client: Client, target: _Target) -> list[JobRecord]:
    """The server's jobs as the store has them now: the wait recorded there where each one answered (the
    launch's own record in memory does not know it, and the drain would scrape nothing)."""
    from pbs_toolkit.errors import JobNotFound

    if target.service is not None:
        jobs: list[Any] = [j for s in target.service.slots for j in s.jobs()]
    else:
        jobs = [target.record] if target.record is not None else []
    found = []
    for job in jobs:
        with suppress(JobNotFound):
            found.append(client.record(job))
    return found


def _drain(client: Client, target: _Target, hooks: RunHooks, interrupts: list[int]) -> None:
    """Wait (at most ``drain_seconds``; a further signal ends the wait) until no request runs or waits."""
    records = _servers(client, target)
    wait_drained(lambda: sum(counters.in_flight(counters.scrape(client.runner(r.transport), r)) for r in records),
                 drain_seconds(),
                 lambda busy: hooks.notice(f"draining {target.name}: {busy:g} request(s) still in flight"),
                 stop=lambda: bool(interrupts))


def _settle(client: Client, records: list[JobRecord], interrupts: list[int]) -> None:
    """Look (at most ``SETTLE_S``; a further signal ends it) until the scheduler says the cancelled jobs ended:
    each look records an end in the store, so ``pbstk jobs`` shows it now, not after the next ``status``."""
    deadline = time.monotonic() + SETTLE_S
    pending = [r for r in records if not r.final_state]
    while pending and not interrupts:
        try:
            pending = [st.record for st in client.status(*pending) if not st.record.final_state]
        except PbstkError:
            return  # the next status records it
        if not pending or time.monotonic() >= deadline:
            return
        time.sleep(0.5)


@contextmanager
def _terminating() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``_Stopped`` (SIGINT stays ``KeyboardInterrupt``) until COMMAND runs."""
    def stop(signum: int, _frame: Any) -> None:
        raise _Stopped(signum)

    with handled_by(stop, (signal.SIGTERM, signal.SIGHUP)):
        yield


@contextmanager
def _held() -> Iterator[list[int]]:
    """Signals are only noted (in the list yielded) while the block runs: the end always completes."""
    received: list[int] = []
    with handled_by(lambda signum, _f: received.append(signum), SIGNALS):
        yield received
