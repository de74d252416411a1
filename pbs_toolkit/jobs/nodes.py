"""The per-node markers of a job spanning several nodes: ``RUN_DIR/nodes/K.json`` read and summed up.

Every node's start script writes its own marker (rank 0, the head, too; docs/status.md "Jobs over several
nodes"); the head alone writes ``server.json`` and serves the API. The head's answer is not enough to call
the job READY: a worker whose vLLM died leaves the head hanging (it may still answer ``/health``), so
``status`` also needs every node's marker. This module only reads and summarises; ``jobs.status`` judges.

The node count comes from ``server.json``'s ``nnodes`` or, before that exists (or from a start script that
does not write it), from ``nodes/0.json``: the runner has no directory listing, and one known count is cheaper
than listing over SFTP. Single-node jobs (no ``nnodes`` above 1 anywhere) read no more than that one file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.logs import FileReader, check_log_request, stream_path, tail_lines, tail_pieces

if TYPE_CHECKING:  # handed in: importing the transports here would load them for `pbstk logs` before it asks
    from pbs_toolkit.jobs.records import JobRecord
    from pbs_toolkit.transports import Runner

NODES_DIR = "nodes"
#: phases in which a node counts as up (a headless worker has no port of its own to prove it)
UP_PHASES = frozenset({"ready", "running"})
#: exit codes of a vLLM stopped by the job's own stop (TERM/INT/HUP): a consequence, not a cause
_STOPPED_CODES = frozenset({129, 130, 143})
#: more node markers than this are not read (a garbled ``nnodes`` must not make status read thousands of files)
MAX_NODES = 512
#: lines of a node's log read for its phase or its failure
NODE_LOG_LINES = 400


def node_log_name(rank: int) -> str:
    """The log file of node ``rank`` in the run directory: ``vllm.log`` for the head, ``vllm.node<K>.log``."""
    return "vllm.log" if rank == 0 else f"vllm.node{rank}.log"


def model_log_name(place: int) -> str:
    """The vLLM log of the model at ``place`` among a multi-model job's models (server/start/models.sh):
    ``vllm.log`` for the job's own (place 0), ``vllm.model<K+1>.log`` for its K-th other model."""
    return "vllm.log" if place == 0 else f"vllm.model{place + 1}.log"


@dataclass
class NodeMarker:
    """One ``nodes/K.json``, fields of the wrong type dropped (a bad marker spoils only its own node)."""

    rank: int
    host: str | None = None
    address: str | None = None
    phase: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    attempt: int | None = None
    updated: float | None = None
    nnodes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``nodes`` entry of a status's JSON (docs/json.md)."""
        return {"rank": self.rank, "host": self.host, "address": self.address, "phase": self.phase,
                "pid": self.pid, "exit_code": self.exit_code}

    @property
    def name(self) -> str:
        """``node 1 (x3001c0s1b0n0)``: how messages name it."""
        return f"node {self.rank} ({self.host})" if self.host else f"node {self.rank}"

    def failed(self, running: bool = False) -> bool:
        """The node's vLLM failed, or exited with a non-zero code; ``running``: the job should still be serving,
        so a worker that exited at all left the head hanging."""
        if self.phase == "exited":
            return running or self.exit_code not in (0, None)
        return self.phase == "failed"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def parse_node(raw: bytes, rank: int) -> NodeMarker | None:
    """``nodes/K.json`` -> its marker, ``None`` when it is not a JSON object. The rank is the file's name."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    updated = data.get("updated")
    when = float(updated) if isinstance(updated, (int, float)) and not isinstance(updated, bool) else None
    return NodeMarker(rank=rank, host=_str(data.get("host")), address=_str(data.get("address")),
                      phase=_str(data.get("phase")), pid=_int(data.get("pid")), exit_code=_int(data.get("exit_code")),
                      attempt=_int(data.get("attempt")), updated=when if when is not None and math.isfinite(when)
                      else None, nnodes=_int(data.get("nnodes")))


@dataclass
class NodesView:
    """Every node's marker (``None``: not written yet) and the logs read for the nodes that need explaining."""

    nnodes: int
    markers: list[NodeMarker | None]
    #: log tails by rank: the failed nodes' and the first node still starting (rank 0's is the job's vllm.log)
    logs: dict[int, list[str]] = field(default_factory=dict)
    #: ``RUN_DIR/stop`` exists: someone (the head, the job script, ``pbstk cancel``) decided the job is over
    stopped: bool = False

    def node_dicts(self) -> list[dict[str, Any]]:
        return [(m or NodeMarker(rank=k)).to_dict() for k, m in enumerate(self.markers)]

    @property
    def attempt(self) -> int:
        """The newest start attempt any node reports (the eager fallback restarts them all with a new one)."""
        return max((m.attempt or 0 for m in self.markers if m), default=0)

    def culprit(self, running: bool = False) -> NodeMarker | None:
        """The node whose failure ended the job: the first to fail in the current attempt.

        When a worker dies the head writes ``stop`` and fails too, and the other workers stop (143): those come
        later, or on the same second as consequences (the head and stopped nodes sort after a worker that failed
        by itself). A marker of an earlier attempt is about to be rewritten and is not looked at.
        """
        current = self.attempt
        failed = [m for m in self.markers if m and m.failed(running) and (m.attempt or 0) >= current]
        if not failed:
            return None
        return min(failed, key=lambda m: (m.updated if m.updated is not None else math.inf,
                                          m.exit_code in _STOPPED_CODES, m.rank == 0, m.rank))

    def up(self, head_ours: bool) -> list[bool]:
        """Per rank: is the node up? Its marker says ready (or running); once the head answered as ours, a
        worker still marked ``starting`` is up too, since vLLM's head serves only after every rank joined."""
        out = []
        for rank, marker in enumerate(self.markers):
            phase = marker.phase if marker else None
            proven = head_ours and (rank == 0 or phase == "starting")  # the head's answer proves itself too
            out.append(phase in UP_PHASES or proven)
        return out

    def first_down(self, head_ours: bool) -> int | None:
        """The lowest rank not up yet, ``None`` when every node is."""
        return next((k for k, ok in enumerate(self.up(head_ours)) if not ok), None)


def _read(runner: FileReader, path: str) -> bytes | None:
    try:
        return runner.read_bytes(path)
    except OSError:
        return None


def node_count(runner: FileReader, run_dir: str, server_marker: dict[str, Any] | None) -> int | None:
    """How many nodes the job runs on, as its run directory says (``None``: not known yet)."""
    count = _int((server_marker or {}).get("nnodes"))
    if count is not None and count >= 1:
        return count
    raw = _read(runner, f"{run_dir}/{NODES_DIR}/0.json")
    head = parse_node(raw, 0) if raw is not None else None
    if head is not None and head.nnodes is not None and head.nnodes >= 1:
        return head.nnodes
    return 1 if server_marker else None


def read_nodes(runner: Runner, run_dir: str, server_marker: dict[str, Any] | None) -> NodesView | None:
    """The node markers of a multi-node job, with the logs that explain it; ``None`` for a single-node job."""
    count = node_count(runner, run_dir, server_marker)
    if count is None or count <= 1:
        return None
    count = min(count, MAX_NODES)
    markers: list[NodeMarker | None] = []
    for rank in range(count):
        raw = _read(runner, f"{run_dir}/{NODES_DIR}/{rank}.json")
        markers.append(parse_node(raw, rank) if raw is not None else None)
    view = NodesView(count, markers, stopped=runner.size(f"{run_dir}/stop") is not None)
    wanted = {m.rank for m in markers if m and m.failed(running=True)}
    down = view.first_down(head_ours=False)
    if down is not None:
        wanted.add(down)
    for rank in sorted(wanted - {0}):  # the head's log is the job's vllm.log, read anyway
        view.logs[rank] = tail_lines(runner, f"{run_dir}/{node_log_name(rank)}", NODE_LOG_LINES)
    return view


def node_phase_text(view: NodesView, rank: int, head_phase: str | None, lines: Sequence[str]) -> str:
    """What node ``rank`` is doing, for ``1/2 nodes up (node 1 x: loading weights)``."""
    from pbs_toolkit.vllm.startup import current_phase

    marker = view.markers[rank]
    if marker is None:
        return f"node {rank}: no marker yet"
    if rank == 0:
        doing = head_phase or marker.phase or "starting"
    elif marker.phase in (None, "setup"):
        doing = "waiting for the head" if marker.phase else "job started"
    else:
        doing = current_phase(lines) if lines else marker.phase or "starting"
    return f"{marker.name}: {doing}"


def request_stop(runner: Runner, run_dir: str) -> bool:
    """Create ``RUN_DIR/stop`` for a job over several nodes; ``True`` when written.

    Every node's start script checks the file each second and stops its vLLM: the scheduler's cancel ends the
    job script, but nodes it started over ``ssh`` are not the scheduler's processes. The file is left empty: a
    ``stop`` with text in it is a failure whose reason is that text (the launcher's), and the head would fail
    with it. Idempotent (the file is replaced); nothing is written for a single-node job or a run directory that
    is gone, and a file that cannot be written never fails the cancel (the scheduler's cancel is the main path).
    """
    count = node_count(runner, run_dir, _server_marker(runner, run_dir))
    if count is None or count <= 1:
        return False
    try:
        runner.write_bytes(f"{run_dir}/stop", b"")
    except OSError:
        return False
    return True


def _server_marker(runner: FileReader, run_dir: str) -> dict[str, Any] | None:
    """``server.json`` as a dict, ``None`` when missing or unusable (``rundir`` parses it field by field)."""
    raw = _read(runner, f"{run_dir}/server.json")
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def node_log_path(runner: FileReader, run_dir: str, job_id: str, rank: int) -> str:
    """The log of node ``rank`` (``logs --node K``); a rank the job does not have is a ``UsageError`` naming
    how many nodes it has. Before the job started its node count is not known: any rank is taken then (``-f``
    waits for the file to appear)."""
    if rank < 0:
        raise UsageError(f"--node must be 0 (the head) or more, not {rank}")
    if rank == 0:
        return f"{run_dir}/{node_log_name(0)}"
    count = node_count(runner, run_dir, _server_marker(runner, run_dir))
    if count is not None and rank >= count:
        has = "runs on 1 node (node 0 only)" if count == 1 else f"has {count} nodes (0 to {count - 1})"
        raise UsageError(f"job {job_id} {has}: there is no node {rank}")
    return f"{run_dir}/{node_log_name(rank)}"


def job_log_path(runner: Callable[[], FileReader], run_dir: str, scheduler: str, job_id: str, stream: str,
                 node: int | None = None, model: int | None = None) -> str:
    """The file of a job's ``stream``; ``node``: that node's vLLM log (found through ``runner()``); ``model``:
    the vLLM log of the model at that place of a multi-model job (``model_log_name``)."""
    if model is not None:
        return f"{run_dir}/{model_log_name(model)}"
    if node is not None:
        return node_log_path(runner(), run_dir, job_id, node)
    return stream_path(run_dir, scheduler, stream)


def job_log_text(record: JobRecord, runner: Callable[[], FileReader], lines: int, stream: str = "vllm",
                 node: int | None = None, model: int | None = None) -> Iterator[str]:
    """The last ``lines`` of the job's ``stream`` (``node``: that node's vLLM log; ``model``: that model's)
    exactly as the file holds them, in pieces, read from the end of the file (``Client.log_text``, ``pbstk
    logs -n``)."""
    check_log_request(lines, stream, node, model)
    path = job_log_path(runner, record.run_dir, record.scheduler, record.job_id, stream, node, model)
    return tail_pieces(runner(), path, lines, f"job {record.job_id}")
