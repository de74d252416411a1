"""The scheduler interface. A backend builds argument lists and parses output; the base runs the scheduler's
commands (``Scheduler.submit``/``query``/``cancel``), and the sequence around a launch (render, write, submit,
record) lives once in ``launch.py``."""

from __future__ import annotations

import enum
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import SchedulerError, SchedulerUnavailable, TransportError
from pbs_toolkit.schedulers.marker import MarkingRunner
from pbs_toolkit.transports.base import Result, Runner


class SchedState(enum.Enum):
    """What the scheduler says, reduced to what pbstk acts on."""

    QUEUED = "queued"      # Q, W, T, M, B
    HELD = "held"          # H, S, U
    RUNNING = "running"    # R
    EXITING = "exiting"    # E: not final yet
    FINISHED = "finished"  # F, X


class Outcome(enum.Enum):
    """How a finished job ended, in words every backend can say; ``SchedulerJob.outcome_code`` adds the number.

    Each backend maps its own exit information here (docs/<scheduler>.md says how), so the generic layer
    (``jobs/status.py``) never decodes a scheduler's codes.
    """

    EXITED = "exited"                    # the job script ended by itself; code = its exit code
    WALLTIME = "walltime"                # the scheduler stopped it at its time limit
    CANCELLED = "cancelled"              # stopped on request (``pbstk cancel``); code = the script's exit code
    NEVER_RAN = "never_ran"              # deleted before it started
    KILLED = "killed"                    # a signal ended it (a cancel, or the node); code = the signal number
    SCHEDULER_ERROR = "scheduler_error"  # the scheduler could not run it; code = the scheduler's own code


@dataclass(frozen=True)
class JobRef:
    """Identifies a job to its scheduler; ``run_dir`` is where its markers live."""

    job_id: str
    run_dir: str


@dataclass
class SchedulerJob:
    job_id: str
    state: SchedState
    raw_state: str
    comment: str | None = None
    exit_status: int | None = None
    exec_host: str | None = None
    walltime_used: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    #: how it ended, once it has (``FINISHED``, or ``EXITING`` with an exit status); ``None`` while it runs
    outcome: Outcome | None = None
    #: the number that goes with ``outcome`` (see :class:`Outcome`)
    outcome_code: int | None = None
    #: seconds the job has been running when the scheduler answered (``RUNNING`` only; ``None``: not known)
    uptime_s: float | None = None
    #: the job's walltime limit in seconds, when the scheduler says (``None``: none, or not known)
    walltime_s: int | None = None
    #: when the scheduler expects a queued job to start (epoch seconds), if it computed that; ``None`` otherwise
    estimated_start: float | None = None


@dataclass(frozen=True)
class ProfileSection:
    """The profile keys only one backend reads: a profile's ``backend`` (``Profile.backend``), of its scheduler's
    ``section_type``. A backend subclasses it with its own keys and their defaults; a profile file may nest them
    under a section named after the backend, and older flat profiles' top-level keys load into it too."""

    def without_whole_nodes(self) -> ProfileSection:
        """These keys for a small job (a service's router) that must not take whole nodes."""
        return self


@dataclass
class Accounting:
    """What the scheduler's own accounting says a job used (``pbstk usage``, docs/campaigns.md). ``None``: it
    does not say; ``source`` names where ``walltime_s`` came from, in the backend's words (its status command
    and field, or ``wall clock``): docs/campaigns.md lists them."""

    job_id: str
    walltime_s: float | None
    source: str
    nodes: int | None = None
    gpus: int | None = None
    #: the job has ended: these figures will not change any more (``usage`` keeps them with the job)
    final: bool = False


class RecordedJob(Protocol):
    """What a backend may read of a job the store recorded (``jobs.store.JobRecord`` is one)."""

    @property
    def scheduler(self) -> str: ...

    @property
    def run_dir(self) -> str: ...


class Scheduler:
    """One backend. Everything scheduler-specific lives in its module; CONTRIBUTING.md lists what to provide."""

    #: the registry key, the profile's ``scheduler:`` value and the name of the profile's own section
    name: str = ""
    #: one line for ``pbstk profiles`` and the docs
    description: str = ""
    #: directory of the job-script template, and the template's file name in it
    template_dir: Path = Path()
    template_name: str = ""
    #: the rendered job script's file name in the run directory
    script_name: str = "job.script"
    #: generic stream name -> file (relative to the run directory) where the scheduler puts the job's output
    streams: ClassVar[dict[str, str]] = {}
    #: older stream names still accepted -> generic ones (kept because users have them in scripts)
    stream_aliases: ClassVar[dict[str, str]] = {}
    #: profile keys a profile may nest under a section named after this backend (its ``section_type``'s, and the
    #: queue and account every batch scheduler has)
    profile_keys: frozenset[str] = frozenset()
    #: the keys only this backend reads, with their defaults: a profile's ``backend``
    section_type: type[ProfileSection] = ProfileSection
    #: the program that submits (``submit_command``'s); on PATH it says this host is the cluster's login node
    #: (settings/login_host.py). ``None`` for a backend that starts jobs itself
    submit_program: str | None = None
    #: whether ``cancel`` may still be called for a job already recorded final (the scheduler forgets ids
    #: safely; a process group id, for one, may belong to anything once the job has ended)
    cancel_when_final: bool = True
    #: node launchers of this scheduler (profile key ``node_launcher``; their shell functions come with
    #: ``node_launch.sh.j2`` in ``template_dir``), and the one a multi-node job uses when the profile names none
    node_launchers: tuple[str, ...] = ()
    default_node_launcher: str = "ssh"
    #: the launcher this backend always uses, whatever the profile says (its ``node_launcher`` is then ignored)
    fixed_node_launcher: str | None = None
    #: jobs run on the host that submits them, no compute nodes (``local``): replicas of a service share its ports
    #: and GPUs, several "nodes" are stand-ins on it, and a cluster's login node is no place for one by default
    runs_on_submit_host: bool = False
    #: hands out numbers never used before, for backends that make their own job ids (launch sets it from the
    #: job store: a backend never opens the store, a floor above it)
    id_source: Callable[[], int] | None = None
    #: the job store's record of a job id, ``JobNotFound`` if none (launch sets it): what a backend whose job ids
    #: say nothing about where a job runs (``local``) knows of ``after``
    find_job: Callable[[str], RecordedJob] | None = None

    def validate_profile(self, profile: Any, where: str) -> None:
        """Refuse profile values this backend cannot use safely (``ConfigError``/``UsageError``)."""
        return None

    def stop_hint(self, job_id: str, run_dir: str) -> str:
        """A command a user can run by hand to stop the job when pbstk cannot (shown after a failed record)."""
        return f"pbstk cancel {job_id}"

    # -- the sequence: submit, query and cancel through the scheduler's own programs. The base runs it once for
    # every such backend: the submission under the wrapper that leaves ``RUN_DIR/job_id`` (schedulers/marker.py),
    # retries of transient failures, the status and cancel timeout, and errors mapped to SchedulerError (refused)
    # or SchedulerUnavailable (no answer). A backend builds argument lists and reads answers (the hooks below);
    # one without such programs (``local``) overrides the three methods instead.

    def submit(self, runner: Runner, script_path: str, run_dir: str, job_name: str, *,
               walltime_s: int | None = None, begin_at: float | None = None, after: str | None = None,
               gpus: int = 0) -> str:
        """Submit the job script; return the full job id. Raises ``SchedulerError`` with the scheduler's words.

        ``walltime_s``: the profile's walltime, for backends that enforce it themselves. ``begin_at``: the job
        must not start before this time (epoch seconds). ``after``: the job must not start before job ``after``
        has started (a successor that overlaps its predecessor). ``gpus``: the GPUs the job uses in all, for a
        backend that books them itself (a scheduler's own backends read them from the script's request). A
        backend that cannot honour one raises ``UsageError`` before submitting anything."""
        argv, env = self.submit_command(runner, script_path, begin_at=begin_at, after=after)
        result = run_with_retry(MarkingRunner(runner, run_dir, env), argv, self.is_transient)
        if result.rc != 0:
            raise SchedulerError(f"{argv[0]} refused the job: {first_line(result.stderr or result.stdout)}")
        return self.parse_job_id(result.stdout)

    def query(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, SchedulerJob]:
        """State of all ``refs`` in one call. Jobs the scheduler does not know are absent from the result."""
        ids = list(dict.fromkeys(ref.job_id for ref in refs))
        if not ids:
            return {}
        result = run_with_retry(runner, self.status_argv(ids), self.is_transient, timeout=scheduler_timeout())
        return self.read_status(runner, ids, result)

    def cancel(self, runner: Runner, ref: JobRef) -> bool:
        """Stop the job. ``True`` when it was stopped now, ``False`` when it was already gone."""
        argv = self.cancel_argv(ref.job_id)
        result = run_with_retry(runner, argv, self.is_transient, timeout=scheduler_timeout())
        if self.already_gone(result):
            return False
        if result.rc == 0:
            return True
        if was_killed(result.rc):
            raise SchedulerUnavailable(f"{argv[0]} {ref.job_id} was killed (exit {result.rc}): is the job stopped? "
                                       "`pbstk status` will tell")
        raise SchedulerError(f"{argv[0]} {ref.job_id} failed (exit {result.rc}): {first_line(result.stderr)}")

    def accounting(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, Accounting]:
        """What each of ``refs`` used, by job id, in as few calls as the scheduler allows; jobs it cannot say
        anything about are absent. The default reads :meth:`query`'s ``walltime_used`` (``[D-]HH:MM:SS``), else
        the running job's uptime; backends with a better source (an accounting database) override it."""
        found = {}
        for job_id, job in self.query(runner, refs).items():
            used = hms_seconds(job.walltime_used)
            final = job.state is SchedState.FINISHED
            if used is None and job.uptime_s is not None:
                found[job_id] = Accounting(job_id, job.uptime_s, f"{self.name} uptime", final=final)
            elif used is not None:
                found[job_id] = Accounting(job_id, float(used), f"{self.name} walltime used", final=final)
        return found

    # -- the hooks of the sequence

    def machine_gpus(self, runner: Runner) -> list[Any] | None:
        """The GPUs of the machine ``runner`` runs on, as this backend books them (``entry``, ``memory_mib``), for a
        backend whose jobs run where they are submitted (``runs_on_submit_host``); ``None`` for the others."""
        return None

    def submit_command(self, runner: Runner, script_path: str, *, begin_at: float | None,
                       after: str | None) -> tuple[list[str], dict[str, str]]:
        """The submit command for ``script_path`` (its stdout is the job id) and extra environment variables it
        needs; ``UsageError`` for a ``begin_at``/``after`` this scheduler cannot honour. ``runner`` is there to
        ask the login node (its clock, say), never to submit."""
        raise NotImplementedError(f"{type(self).__name__} submits by itself")

    def parse_job_id(self, stdout: str) -> str:
        """The job id in the submit command's output; ``SchedulerError`` when it prints something else."""
        raise NotImplementedError(f"{type(self).__name__} submits by itself")

    def is_transient(self, result: Result) -> bool:
        """Whether a failed command is worth retrying (the server was briefly unreachable)."""
        return False

    def status_argv(self, job_ids: Sequence[str]) -> list[str]:
        """One command that reports on all ``job_ids``."""
        raise NotImplementedError(f"{type(self).__name__} queries by itself")

    def read_status(self, runner: Runner, job_ids: Sequence[str], result: Result) -> dict[str, SchedulerJob]:
        """The jobs in the status command's ``result`` (it may ask again through ``runner``, e.g. an accounting
        database); ``SchedulerUnavailable`` for a garbled or cut-off answer, ``status_failed`` otherwise."""
        raise NotImplementedError(f"{type(self).__name__} queries by itself")

    def cancel_argv(self, job_id: str) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} cancels by itself")

    def already_gone(self, result: Result) -> bool:
        """Whether the cancel command's ``result`` says the job was gone already (not an error)."""
        return False



def hms_seconds(value: str | None) -> int | None:
    """``[D-]HH:MM:SS``, ``MM:SS`` or plain seconds -> seconds; ``None`` for anything else."""
    text = (value or "").strip()
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        if not head.isdigit():
            return None
        days = int(head)
    parts = text.split(":")
    if not text or not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return days * 86400 + seconds

def status_failed(program: str, result: Result) -> SchedulerError:
    """The error for a status command that gave no answer: ``SchedulerUnavailable`` when a signal ended it (try
    again later), ``SchedulerError`` with the scheduler's words when it refused."""
    if was_killed(result.rc):
        return SchedulerUnavailable(f"{program} was killed (exit {result.rc}): {first_line(result.stderr)}")
    return SchedulerError(f"{program} failed (exit {result.rc}): {first_line(result.stderr)}")


#: how long a status or cancel command may take before we call the scheduler unresponsive
DEFAULT_SCHEDULER_TIMEOUT_S = 30.0


def scheduler_timeout() -> float:
    """``PBSTK_SCHEDULER_TIMEOUT_S`` (default 30): a hung status command must not look like a dead SSH link."""
    return env_float("PBSTK_SCHEDULER_TIMEOUT_S", DEFAULT_SCHEDULER_TIMEOUT_S, lambda v: 0 < v < float("inf"))


def timed_out(exc: TransportError) -> bool:
    """Whether a runner gave up waiting for the command (both transports chain the timeout they caught)."""
    return isinstance(exc.__cause__, (TimeoutError, subprocess.TimeoutExpired))


def was_killed(rc: int) -> bool:
    """A signal ended the command: negative locally, 128+N through a shell, -1 over SSH without a status.

    Some schedulers use such codes as data (one says "unknown job" with 153 = 128+25): callers check their data
    codes first.
    """
    return rc < 0 or 128 < rc < 255


def run_with_retry(
    runner: Runner,
    argv: Sequence[str],
    is_transient: Callable[[Result], bool],
    *,
    attempts: int = 4,
    first_delay: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    timeout: float | None = None,
) -> Result:
    """Run ``argv``; retry with exponential backoff while ``is_transient`` says the failure is temporary.

    With ``timeout`` the command has its own deadline, and missing it raises ``SchedulerUnavailable`` at once
    (exit 9, not the transport's exit 4: the login node answered, the scheduler did not). It is not retried:
    a server that hangs once usually hangs again, and four hangs would cost minutes.
    """
    delay = first_delay
    for attempt in range(attempts):
        try:
            result = runner.run(argv) if timeout is None else runner.run(argv, timeout=timeout)
        except TransportError as exc:
            if timeout is None or not timed_out(exc):
                raise
            raise SchedulerUnavailable(f"{argv[0]} did not answer within {timeout:g} s") from exc
        if result.rc == 127:
            where = "" if runner.name == "local" else f" on {runner.name.split(':', 1)[-1]}"
            raise SchedulerError(f"{argv[0]} not found on PATH{where}: is this the cluster's login node?")
        if not is_transient(result):
            return result
        if attempt + 1 < attempts:
            sleep(delay)
            delay *= 2
    raise SchedulerUnavailable(
        f"{argv[0]} could not reach the scheduler after {attempts} tries: {first_line(result.stderr)}"
    )


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines[:3]) if lines else "(no message)"
