"""PBS Pro / OpenPBS: ``qsub``, one batched ``qstat -x -f -F json`` per poll, ``qdel``.

Exit codes are data (docs/pbs.md): 153 = some id unknown (stdout still valid), 35 = finished,
255 or "cannot connect to server" = transient (retried, no state change). Everything else that is not an
answer (a hang past ``PBSTK_SCHEDULER_TIMEOUT_S``, a killed qstat, empty or garbled output) raises
``SchedulerUnavailable``: status shows UNKNOWN for that poll and records nothing.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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
    run_with_retry,
    scheduler_timeout,
    status_failed,
)
from pbs_toolkit.schedulers.pbs import qstat_text
from pbs_toolkit.schedulers.pbs.accounting import duration_s, sub_attr
from pbs_toolkit.transports.base import Result, Runner

STATES: dict[str, SchedState] = {
    "Q": SchedState.QUEUED, "W": SchedState.QUEUED, "T": SchedState.QUEUED, "M": SchedState.QUEUED,
    "B": SchedState.RUNNING, "H": SchedState.HELD, "S": SchedState.HELD, "U": SchedState.HELD,
    "R": SchedState.RUNNING, "E": SchedState.EXITING, "F": SchedState.FINISHED, "X": SchedState.FINISHED,
}
_JOB_ID = re.compile(r"^\d+(\[\d*\])?(\.[A-Za-z0-9_.-]+)?$")
_GONE = (153, 35)
#: qdel of a job PBS is already ending (state E, or R while its MoM runs the epilogue, or a second qdel):
#: PBSE_BADSTATE 15016 -> exit 168, "qdel: Request invalid for state of job ID" (seen on a real OpenPBS)
_ENDING_RC = 168
_ENDING_TEXT = "request invalid for state of job"
#: docs/pbs.md "Exit_status": JOB_EXEC_KILL_WALLTIME
WALLTIME_EXIT = -29
#: docs/pbs.md "Exit_status": a signal N ends the job with 256 + N
SIGNAL_BASE = 256


@dataclass(frozen=True)
class PBSKeys(ProfileSection):
    """The profile keys only PBS reads: they reach ``#PBS`` directive lines (docs/pbs.md)."""

    #: the node request; ``{nodes}``, ``{gpus_per_node}``, ``{cpus_per_node}`` are filled in
    select: str = "{nodes}:ncpus={cpus_per_node}:ngpus={gpus_per_node}"
    place: str | None = None
    filesystems: str | None = None
    keep_files: str | None = "doe"
    #: more ``#PBS`` lines, one qsub option each
    extra_directives: list[str] = field(default_factory=list)


#: what a profile may nest under ``pbs:``
PROFILE_KEYS = frozenset({"queue", "account", "account_required", *(f.name for f in fields(PBSKeys))})
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]+$")
#: how PBS prints times (``stime``, ``estimated.start_time``): ctime in the server host's local time
TIME_FORMAT = "%a %b %d %H:%M:%S %Y"
#: ``stime`` and ``resources_used.walltime`` may disagree by the MoM's polling lag; by more, the clocks or time
#: zones of the two hosts differ, and PBS's own counter wins (docs/pbs.md "Uptime and walltime left")
UPTIME_TOLERANCE_S = 300.0
_DIRECTIVE_RE = re.compile(r"-[A-Za-z]( [^\s]+)?")
#: ``qsub -a`` in its longest form, ``CCYYMMDDhhmm.SS``: no year/month/day roll-over guesses by qsub's cvtdate
EXEC_TIME_FORMAT = "%Y%m%d%H%M.%S"
_EXEC_TIME_RE = re.compile(r"^\d{12}\.\d{2}$")


def outcome(exit_status: int | None) -> tuple[Outcome, int | None]:
    """PBS ``Exit_status`` of an ended job -> the generic outcome and its number (docs/pbs.md "Exit_status")."""
    if exit_status is None:
        return Outcome.NEVER_RAN, None
    if exit_status == WALLTIME_EXIT:
        return Outcome.WALLTIME, None
    if exit_status < 0:
        return Outcome.SCHEDULER_ERROR, exit_status
    if exit_status >= SIGNAL_BASE:
        return Outcome.KILLED, exit_status - SIGNAL_BASE
    return Outcome.EXITED, exit_status


def validate_directives(p: Any, where: str) -> None:
    """Check values that reach ``#PBS`` lines (qsub parses them, no shell: refuse instead of quoting)."""
    for key in ("queue", "account"):
        value = getattr(p, key)
        if value is not None and not _NAME_RE.fullmatch(value):  # ``$`` would accept a trailing newline
            raise UsageError(f"bad {key} {value!r}: only letters, digits and _ . @ - are allowed")
    for key in ("select", "place", "filesystems", "keep_files"):
        value = getattr(p.backend, key)
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ConfigError(f"{where}: key {key!r} must be a non-empty value without spaces, got {value!r}")
    for line in p.backend.extra_directives:
        # qsub parses every option on a directive line: "-l a=b -V" would smuggle in -V
        if not _DIRECTIVE_RE.fullmatch(line) or line.startswith("-V"):
            raise ConfigError(f"{where}: extra_directives entry {line!r} must be one qsub option like '-l foo=bar'")
    if any(c.isspace() for c in p.runs_root):
        raise ConfigError(f"{where}: key 'runs_root' must not contain spaces (PBS -o/-e paths cannot)")


def submit_argv(script_path: str, *, exec_time: str | None = None, after: str | None = None) -> list[str]:
    """``qsub [-a CCYYMMDDhhmm.SS] [-W depend=after:ID] script`` (command-line options win over ``#PBS`` lines)."""
    argv = ["qsub"]
    if exec_time is not None:
        argv += ["-a", exec_time]
    if after is not None:
        argv += ["-W", f"depend=after:{after}"]
    return [*argv, script_path]


def exec_time(runner: Runner, begin_at: float) -> tuple[str, dict[str, str]]:
    """The ``-a`` value for ``begin_at`` (epoch seconds), and the environment qsub must run with.

    qsub parses ``-a`` in its own local time (OpenPBS cvtdate.c, on the login node), so the string is made there:
    ``date -d @EPOCH`` through the runner, whatever this machine's time zone. Where that fails (no GNU date), the
    time is written in UTC and qsub runs with ``TZ=UTC0``: cvtdate then reads it as UTC, equally exact; the only
    trace is ``PBS_O_TZ=UTC0`` in the job's variable list. Rounded up: never eligible before ``begin_at``.
    """
    epoch = int(math.ceil(begin_at))
    result = runner.run(["date", "-d", f"@{epoch}", f"+{EXEC_TIME_FORMAT}"], timeout=scheduler_timeout())
    value = result.stdout.strip()
    if result.rc == 0 and _EXEC_TIME_RE.match(value):
        return value, {}
    return time.strftime(EXEC_TIME_FORMAT, time.gmtime(epoch)), {"TZ": "UTC0"}


def waiting_comment(raw_state: str, info: dict[str, Any]) -> str | None:
    """What pbstk says about a job the scheduler has not commented on: OpenPBS's scheduler never looks at a job
    waiting for its ``-a`` time (state W) or held by a dependency (H, ``Hold_Types`` s), so qstat shows no
    comment there; the job's own ``Execution_Time`` and ``depend`` say why it waits (server-local time, verbatim)."""
    if raw_state == "W" and isinstance(info.get("Execution_Time"), str):
        return f"eligible at {info['Execution_Time']} (qsub -a)"
    if raw_state == "H" and info.get("depend"):
        return f"held until its dependency is met: {re.sub(r'@[^:,]+', '', str(info['depend']))}"
    return None


def parse_job_id(stdout: str) -> str:
    job_id = stdout.strip()
    if not _JOB_ID.match(job_id):
        raise SchedulerError(f"qsub printed something that is not a job id: {first_line(stdout)}")
    return job_id


def status_argv(job_ids: Sequence[str]) -> list[str]:
    return ["qstat", "-x", "-f", "-F", "json", *job_ids]


def is_transient(result: Result) -> bool:
    return result.rc == 255 or "cannot connect to server" in result.stderr.lower()


def pbs_time(value: Any) -> float | None:
    """A PBS time string (``Mon Nov 23 10:00:00 2026``) -> epoch seconds, read in this machine's time zone
    (qstat prints the login node's local time; docs/pbs.md says when the two differ)."""
    if not isinstance(value, str):
        return None
    try:
        return time.mktime(time.strptime(value.strip(), TIME_FORMAT))
    except (ValueError, OverflowError):
        return None


def uptime(info: dict[str, Any], asked_at: float) -> float | None:
    """Seconds a running job has run: from ``stime`` (exact) while it agrees with ``resources_used.walltime``
    (which PBS updates only every MoM poll), else PBS's own counter."""
    used = duration_s(sub_attr(info, "resources_used", "walltime"))
    started = pbs_time(info.get("stime"))
    since = asked_at - started if started is not None else None
    if since is None or since < 0 or (used is not None and abs(since - used) > UPTIME_TOLERANCE_S):
        return None if used is None else float(used)
    return since


def parse_status(stdout: str) -> dict[str, SchedulerJob]:
    """Jobs from ``qstat -f -F json`` output (``Jobs`` is absent when nothing matched).

    Output that does not parse, or parses to the wrong shape, is a garbled answer, not news about the jobs.
    """
    if not stdout.strip():
        return {}
    try:
        data = json.loads(stdout)
    except ValueError as exc:
        raise SchedulerUnavailable(f"qstat -F json printed invalid JSON: {exc}") from exc
    try:
        stamp = data.get("timestamp")
        asked_at = float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else time.time()
        jobs = {job_id: _job(str(job_id), info, asked_at) for job_id, info in (data.get("Jobs") or {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise SchedulerUnavailable(f"qstat -F json printed JSON of an unexpected shape: {exc}") from exc
    return jobs


def _job(job_id: str, info: dict[str, Any], asked_at: float | None = None) -> SchedulerJob:
    """One job of the answer; ``asked_at``: when qstat answered (its document's ``timestamp``), for the uptime."""
    raw_state = str(info.get("job_state", "?"))
    exit_status = info.get("Exit_status")
    exec_host = info.get("exec_host")
    comment = info.get("comment")
    if comment is None:
        comment = waiting_comment(raw_state, info)
    code = int(exit_status) if exit_status is not None else None
    state = STATES.get(raw_state, SchedState.QUEUED)
    # PBS sets Exit_status on entering E and keeps it at F; a job at F without one never ran
    ended = state is SchedState.FINISHED or (state is SchedState.EXITING and code is not None)
    how, how_code = outcome(code) if ended else (None, None)
    return SchedulerJob(
        job_id=job_id,
        state=state,
        raw_state=raw_state,
        comment=None if comment is None else str(comment),
        exit_status=code,
        exec_host=str(exec_host).split("/", 1)[0] if exec_host else None,
        walltime_used=(info.get("resources_used") or {}).get("walltime"),
        raw=info,
        outcome=how,
        outcome_code=how_code,
        uptime_s=uptime(info, time.time() if asked_at is None else asked_at)
        if state is SchedState.RUNNING else None,
        walltime_s=duration_s(sub_attr(info, "Resource_List", "walltime")),
        # OpenPBS: ``estimated.start_time``, set when the scheduler calendars the job (backfill, strict order)
        estimated_start=pbs_time(sub_attr(info, "estimated", "start_time"))
        if state is SchedState.QUEUED else None,
    )


def check_answer(result: Result, ids: Sequence[str]) -> None:
    """Raise unless ``result`` is an answer about ``ids`` (rc 0, or 153/35 with the JSON document)."""
    if result.rc not in (0, *_GONE):
        raise status_failed("qstat", result)
    if not result.stdout.strip():
        # -F json always prints the document, even when no id matched: nothing at all is a cut-off answer
        raise SchedulerUnavailable(
            f"qstat printed nothing (exit {result.rc}) for {len(ids)} job(s): {first_line(result.stderr)}"
        )


def _listed(ids: Sequence[str], found: dict[str, SchedulerJob], rc: int) -> dict[str, SchedulerJob]:
    """``found`` by the ids asked for; qstat exits 153 when it does not know an id, so 0 with an id missing is not
    an answer about it (``SchedulerUnavailable``)."""
    jobs = {job_id: found[m] for job_id in ids if (m := match_id(job_id, found))}
    if rc == 0 and len(jobs) < len(ids):
        raise SchedulerUnavailable(f"qstat exited 0 without listing {', '.join(i for i in ids if i not in jobs)}")
    return jobs


def _query_text(runner: Runner, ids: Sequence[str]) -> dict[str, SchedulerJob]:
    """``ids`` asked in qstat's text format (``qstat_text``): one call, every job listed."""
    result = run_with_retry(runner, qstat_text.text_argv(ids), is_transient, timeout=scheduler_timeout())
    if result.rc not in (0, *_GONE):
        check_answer(result, ids)  # raises: killed, or refused
    if result.rc == 0 and not result.stdout.strip():
        raise SchedulerUnavailable(f"qstat printed nothing (exit 0) for {len(ids)} job(s)")
    asked_at = time.time()
    try:
        found = {job_id: _job(job_id, info, asked_at) for job_id, info in qstat_text.parse_text(result.stdout).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise SchedulerUnavailable(f"qstat -f printed a job pbstk cannot read: {exc}") from exc
    return _listed(ids, found, result.rc)


def cancel_argv(job_id: str) -> list[str]:
    return ["qdel", job_id]


def match_id(wanted: str, known: dict[str, Any]) -> str | None:
    """qstat may print a longer server name than we stored (or the reverse): match on the sequence part."""
    if wanted in known:
        return wanted
    seq = wanted.split(".", 1)[0]
    for job_id in known:
        if job_id.split(".", 1)[0] == seq:
            return job_id
    return None


class PBSScheduler(Scheduler):
    name = "pbs"
    description = "PBS Pro / OpenPBS: qsub, qstat, qdel on the login node"
    template_dir = Path(__file__).resolve().parent
    template_name = "job.pbs.j2"
    script_name = "job.pbs"
    # the template's #PBS -o/-e lines
    streams = {"sched-out": "pbs.out", "sched-err": "pbs.err"}
    stream_aliases = {"pbs-out": "sched-out", "pbs-err": "sched-err"}
    profile_keys = PROFILE_KEYS
    section_type = PBSKeys
    submit_program = "qsub"
    node_launchers = ("pbsdsh",)
    default_node_launcher = "pbsdsh"

    def validate_profile(self, profile: Any, where: str) -> None:
        validate_directives(profile, where)

    def stop_hint(self, job_id: str, run_dir: str) -> str:
        return f"qdel {job_id}"

    def submit_command(self, runner: Runner, script_path: str, *, begin_at: float | None,
                       after: str | None) -> tuple[list[str], dict[str, str]]:
        if after is not None and not _JOB_ID.match(after):
            raise UsageError(f"cannot start a job after {after!r}: not a PBS job id")
        when, env = exec_time(runner, begin_at) if begin_at is not None else (None, {})
        return submit_argv(script_path, exec_time=when, after=after), env

    parse_job_id = staticmethod(parse_job_id)
    is_transient = staticmethod(is_transient)
    status_argv = staticmethod(status_argv)
    cancel_argv = staticmethod(cancel_argv)

    def query(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, SchedulerJob]:
        ids = list(dict.fromkeys(ref.job_id for ref in refs))
        if len(ids) > 1 and qstat_text.batching_broken(runner.name):
            return _query_text(runner, ids)  # this server's batched JSON lists one job: one call in text
        return super().query(runner, refs)

    def read_status(self, runner: Runner, ids: Sequence[str], result: Result) -> dict[str, SchedulerJob]:
        check_answer(result, ids)
        found = parse_status(result.stdout)
        jobs = {job_id: found[m] for job_id in ids if (m := match_id(job_id, found))}
        unknown = qstat_text.unknown_ids(result.stderr)
        left_out = [i for i in ids if i not in jobs and i.split(".", 1)[0] not in unknown]
        if len(ids) > 1 and left_out:
            # openpbs #2672: a batched JSON answer lists only its first job (qstat_text.py); ask again in text
            qstat_text.remember_broken(runner.name, qstat_text.server_name(result.stdout))
            return {**jobs, **_query_text(runner, left_out)}
        return _listed(ids, found, result.rc)

    def accounting(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, Accounting]:
        from pbs_toolkit.schedulers.pbs.accounting import accounting

        return accounting(self.query(runner, refs))  # the same one batched qstat -x -f -F json

    def already_gone(self, result: Result) -> bool:
        """Unknown, finished, or already ending: a job in state E (its obit in, end-of-job work under way) ends
        by itself, and qdel refuses it (docs/pbs.md "Cancelling")."""
        text = (result.stderr + result.stdout).lower()
        ending = result.rc == _ENDING_RC and _ENDING_TEXT in text
        return result.rc != 0 and (result.rc in _GONE or ending or "unknown job id" in text
                                    or "job has finished" in text)
