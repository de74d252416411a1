"""One look at a job's run directory and server: ``server.json`` parsed field by field, the log tail, and
the probes (``/health``, then ``/v1/models`` with the job's key). I/O only; :mod:`pbs_toolkit.jobs.status` judges.

Looks run concurrently across jobs (a thread pool, each probe with ``PBSTK_PROBE_TIMEOUT_S``), so servers that
accept but never answer cost one probe timeout per ``status`` call, not one per job.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.jobs.lease import command_note
from pbs_toolkit.jobs.logs import tail_lines
from pbs_toolkit.jobs.nodes import NodesView, read_nodes
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.schedulers import SchedState, SchedulerJob
from pbs_toolkit.server.phases import LISTENING_PHASES, Phase
from pbs_toolkit.transports import Runner
from pbs_toolkit.transports import http as probe
from pbs_toolkit.transports.http import Identity
from pbs_toolkit.vllm.prom import parse_metrics

LOG_TAIL_LINES = 400
#: run directories and servers looked at in parallel by one ``status`` call
LOOK_THREADS = 16
#: record.extra key: the ``address:port`` whose ``/v1/models`` proved the server is the job's own
VERIFIED_KEY = "verified_endpoint"


@dataclass
class RunDirView:
    """One look at a job's run directory and server (I/O only; :func:`pbs_toolkit.jobs.judge.judge` decides)."""

    marker: dict[str, Any] | None = None
    #: ``server.json`` exists but is unusable, in words
    problem: str | None = None
    lines: list[str] = field(default_factory=list)
    health: int | None = None
    identity: Identity | None = None
    #: (log size, marker checksum): a change between scheduler polls is a sign of life
    fingerprint: list[int | None] = field(default_factory=lambda: [None, None])
    #: a job over several nodes: every node's marker (``nodes/K.json``); ``None`` for a single-node job
    nodes: NodesView | None = None
    #: the marker says the server is ready but its address cannot be reached from the runner's machine, in words
    unreachable: str | None = None
    #: ``startup.log``, the start script's start-up timeline (jobs/startup_phases.py); ``None`` before it exists
    startup_log: str | None = None
    #: the server proved it is ours at this address before, ``/health`` did not answer in time, and its
    #: ``/metrics`` shows requests running or waiting: busy, not down (``probe slow; 8 running, 30 waiting``)
    busy: str | None = None
    #: the note of the watch over the COMMAND of the ``pbstk run`` that launched it, once it ended that COMMAND
    #: because the run was gone (jobs/lease.py ``command_note``)
    command_note: str | None = None


def _port(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    return None


def parse_marker(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """``server.json`` -> (the usable fields, what was wrong). A bad marker spoils only its own job's row."""
    try:
        data = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        return None, "server.json is not valid JSON"
    if not isinstance(data, dict):
        return None, "server.json is not a JSON object"
    marker = dict(data)
    problems = []
    # 0: the start script has not picked its port yet (it writes a number from the first marker on)
    if "port" in marker and marker["port"] not in (None, "", 0) and _port(marker["port"]) is None:
        problems.append(f"port {marker['port']!r} is not a port number")
    marker["port"] = _port(marker.get("port"))
    for key in ("phase", "address", "host"):
        if marker.get(key) is not None and not isinstance(marker[key], str):
            problems.append(f"{key} {marker[key]!r} is not a string")
            marker[key] = None
    code = marker.get("exit_code")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        problems.append(f"exit_code {code!r} is not a number")
        marker["exit_code"] = None
    return marker, ("server.json: " + "; ".join(problems)) if problems else None


def read_marker(runner: Runner, run_dir: str) -> dict[str, Any] | None:
    """``server.json`` written by the start script, or ``None`` before it exists (or when it is unusable)."""
    try:
        raw = runner.read_bytes(f"{run_dir}/server.json")
    except OSError:
        return None
    return parse_marker(raw)[0]


def look(runner: Runner, record: JobRecord, sched: SchedulerJob | None) -> RunDirView:
    """Read the marker and the log tail, and probe the server (``/health``, then ``/v1/models`` with the job's
    key unless this address and port were verified before). Thread-safe: writes nothing."""
    view = RunDirView(command_note=command_note(record.job_id))
    if sched is not None and sched.state in (SchedState.QUEUED, SchedState.HELD):
        return view
    raw = None
    try:
        raw = runner.read_bytes(f"{record.run_dir}/server.json")
    except FileNotFoundError:
        pass
    except OSError as exc:
        view.problem = f"cannot read server.json: {exc.strerror or exc}"
    if raw is not None:
        view.marker, view.problem = parse_marker(raw)
    log = f"{record.run_dir}/vllm.log"
    try:
        view.lines = tail_lines(runner, log, LOG_TAIL_LINES)
        log_size = runner.size(log)
    except OSError:
        log_size = None
    view.fingerprint = [log_size, zlib.crc32(raw) if raw is not None else None]
    view.nodes = read_nodes(runner, record.run_dir, view.marker)
    view.startup_log = read_startup_log(runner, record)
    marker = view.marker or {}
    if marker.get("port") and marker.get("phase") in LISTENING_PHASES:
        host, port = marker.get("address") or "127.0.0.1", int(marker["port"])
        view.health, error = probe.reach(runner, host, port)
        if error is not None and marker.get("phase") == Phase.READY:
            where = "from here" if runner.name == "local" else f"from {runner.name.split(':', 1)[-1]}"
            view.unreachable = f"server reports ready, but http://{host}:{port} cannot be reached {where}: {error}"
        verified = record.extra.get(VERIFIED_KEY) == f"{host}:{port}"
        if view.health is None and verified and marker.get("phase") == Phase.READY:
            view.busy = busy(runner, host, port)
        if view.health == 200:
            if verified:
                view.identity = Identity(True)
            else:
                view.identity = probe.identify(runner, host, port, record.api_key, record.served_model_name)
    return view


def busy(runner: Runner, host: str, port: int) -> str | None:
    """Why a server whose ``/health`` did not answer in time is busy rather than down: its ``/metrics`` answers
    and shows requests running or waiting (vLLM's API server answers its probes late under overload, FACTS
    "vLLM"); ``None`` when ``/metrics`` does not answer (refused: the server is gone) or shows no request."""
    try:
        text = probe.metrics_text(runner, host, port, timeout=probe.probe_timeout())
    except ServerFailed:  # no answer, or not 200
        return None
    snap = parse_metrics(text, time.time())
    if not (snap.running or snap.waiting):
        return None
    return f"probe slow; {snap.running or 0:g} running, {snap.waiting or 0:g} waiting"


def read_startup_log(runner: Runner, record: JobRecord) -> str | None:
    """``startup.log`` while the breakdown is not frozen in the record yet (jobs/startup_phases.py)."""
    if "startup" in record.extra:
        return None
    try:
        return runner.read_bytes(f"{record.run_dir}/startup.log")[:65536].decode("utf-8", "replace")
    except OSError:
        return None


def look_all(runner: Runner, jobs: Sequence[tuple[JobRecord, SchedulerJob | None]]) -> list[RunDirView]:
    """:func:`look` at every job concurrently: ten hung servers cost one probe timeout, not ten."""
    if len(jobs) <= 1:
        return [look(runner, record, sched) for record, sched in jobs]
    with ThreadPoolExecutor(max_workers=min(LOOK_THREADS, len(jobs)), thread_name_prefix="pbstk-look") as pool:
        return list(pool.map(lambda job: look(runner, *job), jobs))
