"""Slurm: ``sbatch --parsable``, one batched ``squeue --states=all`` per poll, ``scancel``.

The status answer is a fixed ``--Format`` (the same columns on every Slurm since 17.x; ``--json`` changed shape
between 22.05 and 23.02, a fixed format did not). Exit codes are data (docs/slurm.md): squeue exits 1 with
"Invalid job id specified" when the only id asked for is unknown (a list with some unknown ids answers about the
known ones), "Socket timed out" / "Unable to contact slurm controller" are transient (retried). Finished jobs stay
in squeue for ``MinJobAge`` seconds (default 300); after that one ``sacct`` call asks the accounting database about
the ids squeue no longer knows (only then, and not again in this process where sacct does not work: many sites
restrict accounting); what neither knows is absent, and pbstk goes by its run directory's markers.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import ConfigError, SchedulerError, SchedulerUnavailable, UsageError
from pbs_toolkit.schedulers.base import (
    Accounting,
    JobRef,
    Outcome,
    ProfileSection,
    SchedState,
    Scheduler,
    SchedulerJob,
    first_line,
    hms_seconds,
    run_with_retry,
    scheduler_timeout,
    status_failed,
)
from pbs_toolkit.transports.base import Result, Runner

#: squeue's long state names -> what pbstk acts on (final ones get an outcome from :func:`outcome`)
STATES: dict[str, SchedState] = {
    "PENDING": SchedState.QUEUED, "CONFIGURING": SchedState.QUEUED, "REQUEUED": SchedState.QUEUED,
    "REQUEUE_FED": SchedState.QUEUED, "RESIZING": SchedState.RUNNING,
    "REQUEUE_HOLD": SchedState.HELD, "RESV_DEL_HOLD": SchedState.HELD, "SUSPENDED": SchedState.HELD,
    "STOPPED": SchedState.HELD,
    "RUNNING": SchedState.RUNNING, "SIGNALING": SchedState.RUNNING,
    "COMPLETING": SchedState.EXITING, "STAGE_OUT": SchedState.EXITING,
    "COMPLETED": SchedState.FINISHED, "FAILED": SchedState.FINISHED, "CANCELLED": SchedState.FINISHED,
    "TIMEOUT": SchedState.FINISHED, "DEADLINE": SchedState.FINISHED, "NODE_FAIL": SchedState.FINISHED,
    "BOOT_FAIL": SchedState.FINISHED, "PREEMPTED": SchedState.FINISHED, "OUT_OF_MEMORY": SchedState.FINISHED,
    "SPECIAL_EXIT": SchedState.FINISHED, "REVOKED": SchedState.FINISHED,
}
#: the squeue columns pbstk reads, in this order; each ends with ``|`` (a ``--Format`` suffix: no width, no padding)
FIELDS = ("JobID", "State", "Reason", "NodeList", "TimeLimit", "StartTime", "exit_code", "TimeUsed")
FORMAT = ",".join(f"{name}:|" for name in FIELDS)
_SEP = "|"
_JOB_ID = re.compile(r"^\d+(_\d+)?$")
_SIGKILL = 9
#: how squeue prints times (StartTime): ISO 8601 in the local time of the host that runs squeue
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
_TRANSIENT = ("socket timed out", "unable to contact slurm controller", "zero bytes were transmitted",
              "communication connection failure")
_UNKNOWN_ID = "invalid job id specified"
#: what scancel -v says about an id it did not stop
_CANCEL_GONE = ("invalid job id specified", "already completing or completed")
GPU_DIRECTIVES = ("gres", "gpus-per-node")


@dataclass(frozen=True)
class SlurmKeys(ProfileSection):
    """The profile keys only Slurm reads: they reach ``#SBATCH`` lines (docs/slurm.md)."""

    #: quality of service, node features, and how GPUs are asked for (``gres`` or ``gpus-per-node``)
    qos: str | None = None
    constraint: str | None = None
    gpu_directive: str = "gres"
    #: the job takes whole nodes
    exclusive: bool = False
    #: more ``#SBATCH`` lines, one long option each
    extra_directives: list[str] = field(default_factory=list)

    def without_whole_nodes(self) -> SlurmKeys:
        return replace(self, exclusive=False)


#: what a profile may nest under ``slurm:``
PROFILE_KEYS = frozenset({"queue", "account", "account_required", *(f.name for f in fields(SlurmKeys))})
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]+$")
#: a constraint expression: features joined by & | , and brackets, multipliers like *2
_CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9_.&|,\[\]()*:-]+$")
#: one long option with an optional value without spaces: ``--mem=0``, ``--licenses=scratch``
_DIRECTIVE_RE = re.compile(r"--[a-z][a-z-]*(=[^\s]+)?")
#: options that would change what the job is or where its output goes behind pbstk's back
_REFUSED_DIRECTIVES = ("--export", "--output", "--error", "--job-name", "--chdir", "--array", "--wrap",
                       "--parsable", "--wait", "--test-only")


def validate_directives(p: Any, where: str) -> None:
    """Check values that reach ``#SBATCH`` lines (sbatch parses them, no shell: refuse instead of quoting)."""
    keys: SlurmKeys = p.backend
    for key, value in (("queue", p.queue), ("account", p.account), ("qos", keys.qos)):
        if value is not None and not _NAME_RE.fullmatch(value):  # ``$`` would accept a trailing newline
            raise UsageError(f"bad {key} {value!r}: only letters, digits and _ . @ - are allowed")
    if keys.constraint is not None and not _CONSTRAINT_RE.fullmatch(keys.constraint):
        raise ConfigError(f"{where}: key 'constraint' must be a feature expression like gpu or 'gpu&hbm80g', "
                          f"got {keys.constraint!r}")
    if keys.gpu_directive not in GPU_DIRECTIVES:
        raise ConfigError(f"{where}: key 'gpu_directive' must be one of {', '.join(GPU_DIRECTIVES)}, "
                          f"got {keys.gpu_directive!r}")
    for line in keys.extra_directives:
        # sbatch reads every option on a directive line: "--mem=0 --export=ALL" would smuggle in --export
        if not _DIRECTIVE_RE.fullmatch(line) or line.split("=", 1)[0] in _REFUSED_DIRECTIVES:
            raise ConfigError(f"{where}: extra_directives entry {line!r} must be one sbatch long option like "
                              f"'--mem=0' (not {', '.join(_REFUSED_DIRECTIVES)})")
    if any(c.isspace() for c in p.runs_root):
        raise ConfigError(f"{where}: key 'runs_root' must not contain spaces (#SBATCH --output paths cannot)")


def submit_argv(script_path: str, *, begin_at: float | None = None, after: str | None = None,
                now: float | None = None) -> list[str]:
    """``sbatch --parsable``; a start time becomes ``--begin=now+N`` (relative: the controller's clock and time
    zone need not match this machine's), a predecessor ``--dependency=after:ID`` (starts once ID has started)."""
    argv = ["sbatch", "--parsable"]
    if begin_at is not None:
        wait = max(0, math.ceil(begin_at - (time.time() if now is None else now)))
        argv.append(f"--begin=now+{wait}")
    if after is not None:
        if not _JOB_ID.fullmatch(after):
            raise UsageError(f"bad job id {after!r} to start after: expected a Slurm job id like 1234")
        argv.append(f"--dependency=after:{after}")
    return [*argv, script_path]


def parse_job_id(stdout: str) -> str:
    """``--parsable`` prints ``ID`` or ``ID;CLUSTER`` (multi-cluster sites): the id is the part pbstk keeps."""
    lines = stdout.strip().splitlines()
    job_id = lines[-1].split(";", 1)[0].strip() if lines else ""
    if not _JOB_ID.fullmatch(job_id):
        raise SchedulerError(f"sbatch printed something that is not a job id: {first_line(stdout)}")
    return job_id


def status_argv(job_ids: Sequence[str]) -> list[str]:
    return ["squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}", f"--Format={FORMAT}"]


def is_transient(result: Result) -> bool:
    text = result.stderr.lower()
    return result.rc != 0 and any(words in text for words in _TRANSIENT)


def slurm_time(value: str) -> float | None:
    """A squeue time (``2026-11-23T11:49:32``, local time of the login node) -> epoch seconds; N/A, NONE,
    Unknown -> ``None``."""
    try:
        return time.mktime(time.strptime(value.strip(), TIME_FORMAT))
    except (ValueError, OverflowError):
        return None


def exit_parts(value: str) -> tuple[int, int] | None:
    """(exit code, signal) from ``N:S`` (sacct, scontrol) or a raw wait status (squeue 22.05 prints ``768``)."""
    text = value.strip()
    if ":" in text:
        code, _, sig = text.partition(":")
        return (int(code), int(sig)) if code.isdigit() and sig.isdigit() else None
    if not text.isdigit():
        return None
    raw = int(text)
    return (raw >> 8) & 0xFF, raw & 0x7F


def outcome(state: str, exit_code: tuple[int, int] | None, ran: bool) -> tuple[Outcome, int | None]:
    """A final Slurm state and its exit code -> the generic outcome and its number (docs/slurm.md "States")."""
    code, sig = exit_code or (0, 0)
    if state in ("TIMEOUT", "DEADLINE"):
        return Outcome.WALLTIME, None
    if state == "CANCELLED":
        if not ran:
            return Outcome.NEVER_RAN, None
        return Outcome.CANCELLED, code if exit_code and not sig else None
    if state in ("NODE_FAIL", "BOOT_FAIL", "SPECIAL_EXIT", "REVOKED"):
        return Outcome.SCHEDULER_ERROR, None
    if state == "OUT_OF_MEMORY":
        return Outcome.KILLED, _SIGKILL
    if state == "PREEMPTED":
        # the job ran and the scheduler ended it with a signal to make room: killed, not "could not run it"
        return Outcome.KILLED, sig or None
    if sig:
        return Outcome.KILLED, sig
    return Outcome.EXITED, code


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm host list (``n[1-2],m3`` -> ``n1``); ``None`` when empty."""
    text = nodelist.strip()
    if not text or text in ("(null)", "None assigned"):
        return None
    match = re.match(r"^([^,\[]+)(?:\[(\d+))?", text)
    if not match:
        return None
    return match.group(1) + (match.group(2) or "")


def parse_status(stdout: str, asked_at: float | None = None) -> dict[str, SchedulerJob]:
    """Jobs from the ``status_argv`` answer: one line per job, ``len(FIELDS)`` ``|``-terminated columns.

    A line of another shape is a garbled answer, not news about a job (``SchedulerUnavailable``)."""
    jobs: dict[str, SchedulerJob] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        cols = line.split(_SEP)
        if len(cols) != len(FIELDS) + 1 or cols[-1].strip() or not _JOB_ID.fullmatch(cols[0].strip()):
            raise SchedulerUnavailable(f"squeue printed a line pbstk cannot read: {line.strip()[:200]!r}")
        job = _job(dict(zip(FIELDS, (c.strip() for c in cols), strict=False)),
                   time.time() if asked_at is None else asked_at)
        jobs[job.job_id] = job
    return jobs


def _job(info: dict[str, str], asked_at: float) -> SchedulerJob:
    raw_state = info["State"]
    state = STATES.get(raw_state, SchedState.QUEUED)
    exit_code = exit_parts(info["exit_code"])
    used = hms_seconds(info["TimeUsed"])  # squeue's [D-]HH:MM:SS; None for UNLIMITED and the like
    start = slurm_time(info["StartTime"])
    ran = bool(used) or bool(first_host(info["NodeList"]))
    how, how_code = outcome(raw_state, exit_code, ran) if state is SchedState.FINISHED else (None, None)
    reason = info["Reason"]
    return SchedulerJob(
        job_id=info["JobID"],
        state=state,
        raw_state=raw_state,
        comment=None if reason in ("", "None", "(null)") else reason,
        exit_status=None if exit_code is None or state is not SchedState.FINISHED
        else (128 + exit_code[1] if exit_code[1] else exit_code[0]),
        exec_host=first_host(info["NodeList"]),
        walltime_used=info["TimeUsed"] or None,
        raw=dict(info),
        outcome=how,
        outcome_code=how_code,
        uptime_s=float(used) if state is SchedState.RUNNING and used is not None else None,
        walltime_s=hms_seconds(info["TimeLimit"]),
        # for a pending job StartTime is the scheduler's estimate (backfill), or its --begin time
        estimated_start=start if state is SchedState.QUEUED and start is not None and start > asked_at - 60
        else None,
    )


def check_answer(result: Result, ids: Sequence[str]) -> bool:
    """Whether ``result`` is an answer about ``ids``: ``True`` for a listing, ``False`` for "the one id asked for
    is unknown"; raises otherwise."""
    if result.rc == 0:
        return True
    if len(ids) == 1 and _UNKNOWN_ID in result.stderr.lower():
        return False
    raise status_failed("squeue", result)


#: the sacct columns read for jobs squeue has forgotten (``--parsable2``: ``|`` between columns, none after)
SACCT_FIELDS = ("JobID", "State", "Start", "Elapsed", "Timelimit", "NodeList", "ExitCode")
#: runners (by name) whose sacct did not answer: not asked again in this process
_NO_SACCT: set[str] = set()


def sacct_argv(job_ids: Sequence[str]) -> list[str]:
    return ["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(job_ids)}",
            f"--format={','.join(SACCT_FIELDS)}"]


def parse_sacct(stdout: str, asked_at: float | None = None) -> dict[str, SchedulerJob]:
    """Finished jobs from the ``sacct_argv`` answer, read like squeue's. ``State`` may say ``CANCELLED by 1000``,
    ``Timelimit`` is ``HH:MM:SS`` (slurmdbd) or minutes (jobcomp), ``ExitCode`` is ``N:S``. Jobs not finished,
    and lines of another shape, are left out: sacct is a second opinion, never a reason to drop a poll."""
    jobs: dict[str, SchedulerJob] = {}
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.split(_SEP)]
        if len(cols) != len(SACCT_FIELDS) or not _JOB_ID.fullmatch(cols[0]):
            continue
        row = dict(zip(SACCT_FIELDS, cols, strict=True))
        state = row["State"].split(" ", 1)[0]
        if STATES.get(state) is not SchedState.FINISHED:
            continue
        limit = row["Timelimit"]
        info = {"JobID": row["JobID"], "State": state, "Reason": "", "StartTime": row["Start"],
                "TimeUsed": row["Elapsed"], "NodeList": row["NodeList"], "exit_code": row["ExitCode"],
                "TimeLimit": f"{limit}:00" if limit.isdigit() else limit}
        jobs[row["JobID"]] = _job(info, time.time() if asked_at is None else asked_at)
    return jobs


def ask_sacct(runner: Runner, job_ids: Sequence[str]) -> dict[str, SchedulerJob]:
    """What the accounting database says about ``job_ids`` (finished jobs only); ``{}`` when sacct cannot say."""
    if runner.name in _NO_SACCT:
        return {}
    try:
        result = run_with_retry(runner, sacct_argv(job_ids), is_transient, attempts=1, timeout=scheduler_timeout())
    except (SchedulerError, SchedulerUnavailable):
        result = Result(1, "", "")
    if result.rc != 0:
        _NO_SACCT.add(runner.name)  # "Slurm accounting storage is disabled", no sacct, a hang: do not ask again
        return {}
    return parse_sacct(result.stdout)


def cancel_argv(job_id: str) -> list[str]:
    # -v: without it scancel says nothing, and exits 0, for an id it did not stop
    return ["scancel", "-v", job_id]


class SlurmScheduler(Scheduler):
    name = "slurm"
    description = "Slurm: sbatch, squeue, scancel on the login node"
    template_dir = Path(__file__).resolve().parent
    template_name = "job.slurm.j2"
    script_name = "job.slurm"
    # the template's #SBATCH --output/--error lines
    streams = {"sched-out": "slurm.out", "sched-err": "slurm.err"}
    profile_keys = PROFILE_KEYS
    section_type = SlurmKeys
    submit_program = "sbatch"
    #: one job step per node (node_launch.sh.j2)
    node_launchers = ("srun",)
    default_node_launcher = "srun"

    def validate_profile(self, profile: Any, where: str) -> None:
        validate_directives(profile, where)

    def stop_hint(self, job_id: str, run_dir: str) -> str:
        return f"scancel {job_id}"

    def submit_command(self, runner: Runner, script_path: str, *, begin_at: float | None,
                       after: str | None) -> tuple[list[str], dict[str, str]]:
        return submit_argv(script_path, begin_at=begin_at, after=after), {}

    parse_job_id = staticmethod(parse_job_id)
    is_transient = staticmethod(is_transient)
    status_argv = staticmethod(status_argv)
    cancel_argv = staticmethod(cancel_argv)

    def read_status(self, runner: Runner, ids: Sequence[str], result: Result) -> dict[str, SchedulerJob]:
        if not check_answer(result, ids):
            return ask_sacct(runner, ids)
        found = parse_status(result.stdout)
        missing = [job_id for job_id in ids if job_id not in found]
        if missing:
            found.update(ask_sacct(runner, missing))
        return {job_id: found[job_id] for job_id in ids if job_id in found}

    def accounting(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, Accounting]:
        from pbs_toolkit.schedulers.slurm.accounting import accounting

        return accounting(runner, refs, lambda: self.query(runner, refs), self.is_transient)

    def already_gone(self, result: Result) -> bool:
        text = (result.stderr + result.stdout).lower()
        return any(words in text for words in _CANCEL_GONE)
