"""``router: job``: a service's vllm-router inside a small CPU job of the profile's scheduler.

For sites where nothing long-running may stay on a login node. The router job goes through the normal backend
(``submit``/``query``/``cancel``) and is rendered from the very same job template as a server, with another entry
script: ``start_router.sh``, the start procedure of every router (``script.py``), with the profile's settings.
It asks for one node, two CPUs and no GPU (a select statement without ``ngpus``), in ``router_job_queue``
(default: the profile's queue) for ``router_job_walltime`` (default: the profile's walltime). On the node it
picks free ports, binds ``bind_host``, and once the router answers ``/list_workers`` writes ``router.json``
(host as the node's ``address`` rule names it, ports, pid; 0644: no secret, the key never reaches the router).
With ``router_isolation: netns`` (the default) the script starts the router behind pbstk's front
(``router_front.py``, copied into the run directory with its admin token ``router.token``, both 0600), as on a
login node: only service traffic reaches the router, its admin API wants the token (docs/services.md).
``serve`` waits for that file (``PBSTK_ROUTER_JOB_WAIT_S``, default 300 s), then the service uses the router like
any other: its admin API directly, or over the SSH connection for an ``ssh_host`` profile.

The router's pid lives on the compute node, so it is never signalled from here: ``cancel`` cancels the job (the
script passes SIGTERM on to the router), and "router running" means the job runs and the router answers.
``--keep-alive`` is refused: the router job ends at its walltime and its successor would have another URL.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.schedulers import JobRef, SchedState, backend_class, get_scheduler
from pbs_toolkit.services.router.process import (
    FRONT_SOURCES,
    INFO_FILE,
    LOG_FILE,
    RouterError,
    RouterInfo,
    http_status,
)
from pbs_toolkit.services.router.script import (
    ENTRY_SCRIPT,
    PORT_SLOT,
    PROM_PORT_SLOT,
    TOKEN_FILE,
    ScriptSettings,
)
from pbs_toolkit.services.router.script import render_start_script as render_router_script

if TYPE_CHECKING:
    from pbs_toolkit.schedulers import SchedulerJob
    from pbs_toolkit.services.record import ServiceRecord
    from pbs_toolkit.services.session import ServiceSession
    from pbs_toolkit.settings.profiles import Profile
    from pbs_toolkit.transports import Runner

#: the start script's slots for the ports it picks on its node (``script.py``), for callers of this module
__all__ = ["PORT_SLOT", "PROM_PORT_SLOT"]
#: CPUs the router job asks for: the router is one small process
ROUTER_JOB_CPUS = 2

KEEP_ALIVE_REFUSED = ("--keep-alive with router: job: a router inside a job ends at its walltime and its "
                      "successor would have another URL; use router: login for --keep-alive")


def wait_seconds() -> float:
    """``PBSTK_ROUTER_JOB_WAIT_S``: how long ``serve`` waits for the router job to run and answer (default 300)."""
    return env_float("PBSTK_ROUTER_JOB_WAIT_S", 300.0, lambda v: 1 <= v <= 86400)


def job_profile(profile: Profile) -> Profile:
    """The profile as the router job uses it: one node, no GPU, two CPUs, its own queue and walltime."""
    changes: dict[str, Any] = {
        "nodes": 1, "gpus_per_node": 0, "cpus_per_node": min(ROUTER_JOB_CPUS, profile.cpus_per_node),
        "queue": profile.router_job_queue or profile.queue,
        "walltime": str(profile.router_job_walltime or profile.walltime),
        "backend": profile.backend.without_whole_nodes(),  # a whole node for a router would waste it
    }
    return replace(profile, **changes)


def render_job_script(profile: Profile, job_name: str, run_dir: str) -> str:
    """The backend's job template, rendered for the router job (its entry script: ``start_router.sh``)."""
    from pbs_toolkit.jobs.plan import normalised_walltime
    from pbs_toolkit.jobs.render import template_environment
    from pbs_toolkit.version import __version__

    backend = backend_class(profile.scheduler)
    # ngpus=0 in a select statement is at best noise (and refused by some servers): a CPU job asks for none
    select = re.sub(r":ngpus=0(?=:|$)", "", profile.select_statement())
    context = {"version": __version__, "model": "vllm-router", "preset": _NoPreset(), "profile": profile,
               "job_name": job_name, "run_dir": run_dir, "select": select,
               "walltime": normalised_walltime(profile), "entry_script": ENTRY_SCRIPT}
    return str(template_environment(backend.template_dir).get_template(backend.template_name).render(**context))


class _NoPreset:
    """What the job template reads of a preset (its name, in a comment): a router job has none."""

    name = "router"


def render_start_script(profile: Profile, run_dir: str, service: str, command: list[str], policy: str) -> str:
    """``start_router.sh`` for the router job: the one start procedure of every router (``script.py``),
    with the profile's bind address, address rule and venv; the node picks the ports."""
    return render_router_script(ScriptSettings(
        run_dir=run_dir, command=command, policy=policy, bind=profile.router_bind or profile.bind_host,
        isolate=profile.router_isolation != "none", address_mode=profile.address,
        address_suffix=profile.address_suffix or "", venv=profile.venv or "",
        about=f"the router of service {service} (profile {profile.name})"))


def submit(session: ServiceSession, rec: ServiceRecord, profile: Profile, command: list[str]) -> dict[str, str]:
    """Write the router job's run directory and submit it through launch's crash-safe sequence
    (jobs/launch.py ``submit_recorded``): the service records the job's run directory before anything is
    submitted, an intent covers the submission, and the job id lands in the service's row in the transaction that
    retires the intent; a pbstk killed in between leaves the id in ``RUN_DIR/job_id`` for ``settle``. Returns
    ``{job_id, run_dir, scheduler, name}`` (also in ``rec.router_job``)."""
    from pbs_toolkit.jobs.launch import submit_recorded
    from pbs_toolkit.jobs.plan import RUN_DIR_RE, default_run_dir
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services import intents
    from pbs_toolkit.services import record as records
    from pbs_toolkit.settings.profiles import walltime_seconds

    runner = session.runner(rec.transport)
    prof = job_profile(profile)
    job_name = f"{rec.name}-router"
    run_dir = default_run_dir(prof, job_name, runner.expanduser)
    if not RUN_DIR_RE.fullmatch(run_dir):
        raise UsageError(f"run directory {run_dir!r} must be an absolute path of letters, digits and _ . / @ + ~ -")
    if prof.venv:
        prof = replace(prof, venv=runner.expanduser(prof.venv))
    scheduler = get_scheduler(prof.scheduler)
    scheduler.id_source = functools.partial(session.store.next_id, scheduler.name)
    rec.router_job = {"job_id": "", "run_dir": run_dir, "scheduler": prof.scheduler, "name": job_name}
    if not records.save(session.store, rec):  # a cancel came first: submit nothing
        rec.router_job = {}
        raise intents.ServiceEnded(f"service {rec.name} was ended; its router job is not submitted")
    record = JobRecord(job_id="", scheduler=prof.scheduler, profile=prof.name, model="vllm-router",
                       served_model_name="", preset="router", name=job_name, run_dir=run_dir,
                       transport=rec.transport)

    def write() -> None:
        runner.makedirs(run_dir, 0o755)
        runner.write_bytes(f"{run_dir}/{scheduler.script_name}", render_job_script(prof, job_name, run_dir).encode(),
                           0o755)
        runner.write_bytes(f"{run_dir}/{ENTRY_SCRIPT}",
                           render_start_script(prof, run_dir, rec.name, command, rec.policy).encode(), 0o755)
        if prof.router_isolation != "none":  # the front (router_front.py) and its admin token, the owner's only
            for source in FRONT_SOURCES:
                runner.write_bytes(f"{run_dir}/{source.name}", source.read_bytes(), 0o600)
            runner.write_bytes(f"{run_dir}/{TOKEN_FILE}", secrets.token_hex(16).encode(), 0o600)

    def recorded(job: JobRecord) -> None:
        rec.router_job = {**rec.router_job, "job_id": job.job_id}
        if session.store.record_service_job(intent, job, rec.name, rec.created, rec.data()):
            records.write_file(session.store, rec)

    intent = session.store.add_intent(record)
    submit_recorded(session.store, runner, scheduler, record, intent, write=write, recorded=recorded,
                    walltime_s=walltime_seconds(prof.walltime))
    return dict(rec.router_job)


def settle(session: ServiceSession, rec: ServiceRecord, wait_s: float = 0.0) -> bool:
    """A router job whose submission was interrupted (no id in the service's record): its id from the run
    directory's ``job_id`` marker, or, when its launch's intent is gone with no marker, nothing was submitted (the
    record's ``router_job`` emptied). Waits at most ``wait_s`` for a submission under way; ``False``: unresolved."""
    from pbs_toolkit.jobs.launch import marker_job_id, resolve_remote_intents

    job = rec.router_job
    if not job or job.get("job_id"):
        return True
    runner = session.runner(rec.transport)
    deadline = time.monotonic() + wait_s
    while True:
        found = marker_job_id(runner, job["run_dir"])
        if found:
            rec.router_job = {**job, "job_id": found}
            return True
        pending = [i for i in session.store.intents() if i.run_dir == job["run_dir"]]
        if pending and rec.transport:
            resolve_remote_intents(session.store, runner, pending)
            pending = [i for i in session.store.intents() if i.run_dir == job["run_dir"]]
        if not pending:
            if (found := marker_job_id(runner, job["run_dir"])) is not None:
                rec.router_job = {**job, "job_id": found}
            else:
                rec.router_job = {}
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def query(session: ServiceSession, rec: ServiceRecord) -> SchedulerJob | None:
    """What the scheduler says of the router job (one query), or None when it no longer knows it."""
    job = rec.router_job
    found = get_scheduler(job["scheduler"]).query(session.runner(rec.transport),
                                                  [JobRef(job["job_id"], job["run_dir"])])
    return found.get(job["job_id"])


def wait_router(session: ServiceSession, rec: ServiceRecord, timeout: float | None = None) -> RouterInfo:
    """Wait (bounded) until the router job wrote ``router.json``; its router. ``RouterError`` when the job ended
    first, ``WaitTimeout`` when it did not get there in time (the caller cancels it)."""
    from pbs_toolkit.errors import WaitTimeout

    runner = session.runner(rec.transport)
    job = rec.router_job
    path = f"{job['run_dir']}/{INFO_FILE}"
    limit = wait_seconds() if timeout is None else timeout
    deadline = time.monotonic() + limit
    next_query = 0.0
    state = "not yet queried"
    while True:
        info = _read_info(runner, path, rec.transport)
        if info is not None:
            return info
        if time.monotonic() >= next_query:
            seen = query(session, rec)
            if seen is None or seen.state == SchedState.FINISHED:
                raise RouterError(f"the router job {job['job_id']} ended before its router answered "
                                  f"(log: {job['run_dir']}/{LOG_FILE})",
                                  details=_tail(runner, job["run_dir"], job["scheduler"]))
            state = seen.state.value + (f": {seen.comment}" if seen.comment else "")
            next_query = time.monotonic() + 2.0
        if time.monotonic() > deadline:
            raise WaitTimeout(f"the router job {job['job_id']} did not start its router within {limit:g} s "
                              f"({state}); PBSTK_ROUTER_JOB_WAIT_S sets the wait")
        time.sleep(0.2)


def _read_info(runner: Runner, path: str, transport: str) -> RouterInfo | None:
    try:
        data = json.loads(runner.read_bytes(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # being written (the script renames a complete file in; a partial read is retried)
    # no token: the router's pid is on the compute node and pbstk never signals it (it cancels the job)
    info = RouterInfo.from_dict({**data, "transport": transport, "token": ""})
    with contextlib.suppress(FileNotFoundError):  # the front's admin token (no file: router_isolation none)
        info.admin_token = runner.read_bytes(f"{info.run_dir}/{TOKEN_FILE}").decode().strip()
    return info


def _tail(runner: Runner, run_dir: str, scheduler: str, lines: int = 8) -> list[str]:
    """The last lines of the router's log and of the job's own output (the backend names those files)."""
    out: list[str] = []
    for name in (LOG_FILE, *backend_class(scheduler).streams.values()):
        try:
            text = runner.read_bytes(f"{run_dir}/{name}").decode(errors="replace")
        except (OSError, PbstkError):
            continue
        out += [f"{name}: {line}" for line in text.splitlines()[-lines:] if line.strip()]
    return out[-lines:]


def router_answers(session: ServiceSession, info: RouterInfo) -> bool:
    """Whether the router answers ``GET /list_workers`` (as the scheduler's host reaches the node)."""
    try:
        return http_status(session.runner(info.transport), info.host, info.port, "/list_workers") == 200
    except PbstkError:
        return False


def cancel(session: ServiceSession, rec: ServiceRecord) -> bool:
    """Cancel the router job (its script passes SIGTERM on to the router); False when it had ended."""
    job = rec.router_job
    return get_scheduler(job["scheduler"]).cancel(session.runner(rec.transport), JobRef(job["job_id"], job["run_dir"]))
