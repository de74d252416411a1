"""A job's server state as status reports it: ``ServerState``, ``JobStatus`` (one job's answer), ``Absence``
(how long the scheduler has not known it) and the thresholds they use. jobs/judge.py decides them,
jobs/status.py asks for them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.envvars import env_float
from pbs_toolkit.jobs import idle, lease
from pbs_toolkit.jobs.nodes import node_log_name
from pbs_toolkit.jobs.store import JobRecord

#: consecutive scheduler answers without the job before it may be LOST ...
LOST_AFTER_POLLS = 3
#: ... spanning at least this many seconds (``PBSTK_LOST_AFTER_S``)
DEFAULT_LOST_AFTER_S = 60.0
#: record.extra key owned by this module (``rundir`` owns ``verified_endpoint``)
ABSENCE_KEY = "sched_absence"
#: a running job with less walltime left than this is flagged (``walltime_ending``): about to be killed
WALLTIME_ENDING_S = 600


def lost_after_s() -> float:
    """``PBSTK_LOST_AFTER_S``: how long the scheduler must not know a job before it is LOST (default 60)."""
    return env_float("PBSTK_LOST_AFTER_S", DEFAULT_LOST_AFTER_S, lambda v: 0 <= v < float("inf"))


class ServerState(enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    FINISHED = "FINISHED"
    CANCELLED = "CANCELLED"
    LOST = "LOST"
    #: the scheduler did not answer and neither the run directory nor HTTP tells (transient; not final)
    UNKNOWN = "UNKNOWN"

    @property
    def final(self) -> bool:
        return self in (ServerState.FAILED, ServerState.FINISHED, ServerState.CANCELLED, ServerState.LOST)


@dataclass
class JobStatus:
    record: JobRecord
    state: ServerState
    scheduler_state: str | None = None
    comment: str | None = None
    phase: str | None = None
    node: str | None = None
    address: str | None = None
    port: int | None = None
    exit_status: int | None = None
    reason: str | None = None
    eager_fallback: bool = False
    log_excerpt: list[str] = field(default_factory=list)
    #: False when only a log line says FAILED and the process may still restart (eager fallback)
    confirmed: bool = True
    #: the log shows a graph/compile failure and the start script will restart the server in eager mode
    restart_expected: bool = False
    #: another server answers on the job's port: how it gave itself away (``rejected the API key (401)``)
    foreign: str | None = None
    #: the server says it is ready but pbstk cannot reach its address (DNS, route, refused), in words
    unreachable: str | None = None
    #: seconds the job has been running, per its scheduler (``None``: not running, or not known)
    uptime_s: float | None = None
    #: the job's walltime limit in seconds (``None``: none, or not known)
    walltime_s: int | None = None
    #: when the scheduler expects the queued job to start (epoch seconds), if it says
    estimated_start: float | None = None
    #: a job over several nodes: how many, how many are up (``None``: single-node), every node's marker
    nnodes: int = 1
    nodes_ready: int | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    #: the worker whose failure ended the job (its log is ``vllm.node<K>.log``); ``None``: the head, or none
    failed_node: int | None = None
    #: seconds per start-up phase (jobs/startup_phases.py; docs/coldstart.md); ``None`` when nothing tells
    startup: dict[str, Any] | None = None
    #: READY but too busy to answer its ``/health`` probe in time, its ``/metrics`` showing the load, in words
    #: (``probe slow; 8 running, 30 waiting``); ``None`` for a server that answered
    busy: str | None = None
    #: a job of a multi-model service: its other models, served name -> port (server.json's ``models``,
    #: ``SERVED@PORT ...``; docs/multi-model.md); empty for a one-model job
    models: dict[str, int] = field(default_factory=dict)

    @property
    def nodes_text(self) -> str | None:
        """``2/2 nodes`` for a job over several nodes, ``None`` for a single-node one."""
        if self.nnodes <= 1 or self.nodes_ready is None:
            return None
        return f"{self.nodes_ready}/{self.nnodes} nodes"

    @property
    def log_file(self) -> str:
        """The log that explains this status: the failed worker's, else the head's ``vllm.log``."""
        return f"{self.record.run_dir}/{node_log_name(self.failed_node or 0)}"

    @property
    def walltime_left_s(self) -> float | None:
        """Seconds until the scheduler kills the running job for its walltime (``None``: not known)."""
        if self.uptime_s is None or self.walltime_s is None:
            return None
        return max(0.0, self.walltime_s - self.uptime_s)

    @property
    def walltime_ending(self) -> bool:
        """Within ``WALLTIME_ENDING_S`` of the walltime: clients should expect the server to go away soon."""
        left = self.walltime_left_s
        return left is not None and left <= WALLTIME_ENDING_S

    @property
    def url(self) -> str | None:
        if self.address and self.port:
            return f"http://{self.address}:{self.port}/v1"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The ``job`` object of ``status``/``wait --json``: the record's fields exactly as ``jobs --json``
        prints them (``JobRecord.to_dict``), then the state fields (docs/json.md)."""
        return {
            **self.record.to_dict(), "state": self.state.value,
            "scheduler_state": self.scheduler_state, "phase": self.phase, "node": self.node,
            "address": self.address, "port": self.port, "url": self.url, "exit_status": self.exit_status,
            "comment": self.comment, "reason": self.reason, "eager_fallback": self.eager_fallback,
            "confirmed": self.confirmed, "restart_expected": self.restart_expected, "foreign": self.foreign,
            "unreachable": self.unreachable,
            "log_excerpt": self.log_excerpt,
            "uptime_s": _rounded(self.uptime_s), "walltime_s": self.walltime_s,
            "walltime_left_s": _rounded(self.walltime_left_s), "walltime_ending": self.walltime_ending,
            "estimated_start": self.estimated_start,
            "nnodes": self.nnodes, "nodes_ready": self.nodes_ready, "nodes": self.nodes,
            "failed_node": self.failed_node, "startup": self.startup, "busy": self.busy,
            "ended": idle.ended_how(self.state.value, self.reason) or lease.ended_how(self.state.value, self.reason),
            **({"models": dict(self.models)} if self.models else {}),
        }


def _rounded(seconds: float | None) -> int | None:
    return None if seconds is None else int(round(seconds))


@dataclass(frozen=True)
class Absence:
    """How long the scheduler has not known a job: consecutive answers, and seconds since the first of them."""

    polls: int
    seconds: float

    @property
    def settled(self) -> bool:
        """Long enough to call the job LOST (when nothing in its run directory says otherwise)."""
        return self.polls >= LOST_AFTER_POLLS and self.seconds >= lost_after_s()


