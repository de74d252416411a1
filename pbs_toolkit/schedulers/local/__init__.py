"""``local``: run the very same job script on this machine (or the SSH host), no scheduler.

The job runs detached in its own session (``setsid``) under a small supervisor that sets the PBS
variables the script expects, enforces the walltime and leaves markers in ``RUN_DIR/.local-job/``:
``pid`` (= process group; its mtime is when the job started), ``walltime_limit`` (the limit enforced, in seconds),
``exit_status`` (the script's own exit code, written at the end), ``cancelled``
(written by ``cancel``), ``walltime`` (written when the walltime stopped it),
``token`` (a random value also exported as ``PBSTK_LOCAL_JOB_TOKEN`` into the job's environment: a process group
is only treated as the job's, by ``query`` and ``cancel``, while one of its processes carries it, so a PGID reused
by an unrelated process after the job died is never signalled). Job ids look like ``7.myhost.local``: a counter
kept in the job store plus the host, so parallel launches never share one; ``RUN_DIR/job_id`` holds it before the
job starts.

It reports :class:`Outcome` directly: no scheduler's exit codes are imitated, and the walltime comes from the
profile (``submit(walltime_s=...)``), not from the script's text.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from pbs_toolkit.errors import JobNotFound, SchedulerError, UsageError
from pbs_toolkit.schedulers.base import (
    Accounting,
    JobRef,
    Outcome,
    RecordedJob,
    SchedState,
    Scheduler,
    SchedulerJob,
    first_line,
)
from pbs_toolkit.schedulers.local.gpus import BOOK, MachineGpu, machine_gpus, pool_dir
from pbs_toolkit.schedulers.pbs import PBSKeys, PBSScheduler, validate_directives
from pbs_toolkit.transports.base import Runner

SPOOL = ".local-job"
#: a job whose processes are gone without an exit status was killed hard (kill -9 of the group, a reboot)
_SIGKILL = 9
#: seconds a cancel waits for the job to end itself (its start script stops vLLM, then the supervisor ends the
#: rest) before it kills what is left
CANCEL_WAIT_S = 60

# The end of a job, as a PBS MoM ends a job's session: every live process of the job's process group but the caller,
# and every process anywhere that carries the job's token in its environment (one that left the group: a vLLM the
# start script put in a group of its own, whose engine outlived a SIGKILL), gets SIGTERM, and SIGKILL after
# $END_GRACE seconds. A zombie is gone (it holds nothing).
_END_JOB = r"""
job_left() {  # GROUP TOKEN: pids of the job's live processes, this shell (and this subshell) excluded
  local e st rest found='' p
  local -a f
  if [ -n "$2" ]; then  # one grep over every environment, without the token in its own
    found=$(env -u PBSTK_LOCAL_JOB_TOKEN grep -lzxF "PBSTK_LOCAL_JOB_TOKEN=$2" /proc/[0-9]*/environ 2>/dev/null)
  fi
  for e in /proc/[0-9]*; do
    p=${e#/proc/}
    [ "$p" = "$$" ] || [ "$p" = "$BASHPID" ] && continue
    { read -r st <"$e/stat"; } 2>/dev/null || continue
    rest=${st##*) }
    read -r -a f <<<"$rest"
    [ "${f[0]}" = Z ] && continue
    if [ "${f[2]}" = "$1" ] || [[ $'\n'$found$'\n' == *$'\n'$e/environ$'\n'* ]]; then echo "$p"; fi
  done
}
end_job() {  # GROUP TOKEN GRACE
  local waited=0
  local -a left
  mapfile -t left < <(job_left "$1" "$2")
  [ "${#left[@]}" -gt 0 ] || return 0
  echo "$(date +%H:%M:%S) the job script ended; ending what it left running: ${left[*]}" >&2
  kill -TERM "${left[@]}" 2>/dev/null
  while [ "${#left[@]}" -gt 0 ]; do
    sleep 0.2
    waited=$((waited + 1))
    mapfile -t left < <(job_left "$1" "$2")
    if [ "${#left[@]}" -gt 0 ] && [ "$waited" -ge $(( $3 * 5 )) ]; then
      echo "$(date +%H:%M:%S) still running $3 s after SIGTERM: ${left[*]}; killing them" >&2
      kill -KILL "${left[@]}" 2>/dev/null
      sleep 0.5
      return 0
    fi
  done
}
"""

# Constant scripts; every value arrives as a positional parameter, never spliced into the text.
_SUPERVISOR = _END_JOB + BOOK + r"""
spool=$1 script=$2 gpus=${10:-0} pool=${11:-} pooldir=${12:-}
exec </dev/null >"$spool/supervisor.log" 2>&1
# a job that must wait says so before its pid exists: a job started `after` it must never see it started early
if [ -n "$7" ]; then
  printf 'eligible at %s\n' "$(date -d "@$7" +%H:%M:%S 2>/dev/null || date -r "$7" +%H:%M:%S)" >"$spool/waiting"
elif [ -n "$8" ]; then
  printf 'waiting for job %s to start\n' "$9" >"$spool/waiting"
elif [ "$gpus" -gt 0 ]; then
  printf 'waiting for %s free GPU(s)\n' "$gpus" >"$spool/waiting"
fi
echo "$$" >"$spool/pid"
hostname >"$spool/nodefile"
export PBS_JOBID=$3 PBS_JOBNAME=$4 PBS_O_WORKDIR=$5 PBS_NODEFILE="$spool/nodefile"
export PBS_ENVIRONMENT=PBS_BATCH PBS_O_HOST="$(hostname)" PBS_QUEUE=local
cd "$HOME" || exit 1
# begin_at ($7, epoch seconds) / after ($8, another local job's spool) / GPUs ($10 of the pool $11, booked under
# $12): wait QUEUED, "$spool/waiting" holding the comment; a cancel meanwhile ends the wait as a cancelled job. The
# pid marker is touched when the wait ends: its mtime is when the job started.
if [ -n "$7$8" ] || [ "$gpus" -gt 0 ]; then
  stop() {
    [ "$gpus" -gt 0 ] && book_release "$pooldir"
    echo 143 >"$spool/exit_status.tmp" && mv -f "$spool/exit_status.tmp" "$spool/exit_status"; exit 143
  }
  trap stop TERM INT HUP
  if [ -n "$7" ]; then
    while [ "$(date +%s)" -lt "$7" ]; do sleep 0.5 & wait $!; done
  fi
  if [ -n "$8" ]; then
    printf 'waiting for job %s to start\n' "$9" >"$spool/waiting"
    while [ ! -s "$8/pid" ] || [ -e "$8/waiting" ]; do
      [ -e "$8/exit_status" ] && break
      sleep 0.5 & wait $!
    done
  fi
  if [ "$gpus" -gt 0 ]; then
    book_gpus "$gpus" "$pool" "$pooldir" || { echo "cannot book GPUs under $pooldir" >&2; stop; }
  fi
  trap - TERM INT HUP
  rm -f "$spool/waiting"
  touch "$spool/pid"
fi
# --foreground keeps the job in this process group, so cancelling the group reaches every process.
timeout --foreground --signal=TERM --kill-after=30 "$6" bash "$script" >"$spool/stdout" 2>"$spool/stderr" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
while :; do
  wait "$child"; rc=$?
  if ! kill -0 "$child" 2>/dev/null; then
    # a trap may have interrupted wait just as the child ended: collect the real status if it is pending
    wait "$child" 2>/dev/null; r=$?; [ "$r" != 127 ] && rc=$r
    break
  fi
done
[ "$rc" = 124 ] && [ ! -e "$spool/cancelled" ] && : >"$spool/walltime"
trap '' TERM INT HUP  # a cancel's signal now must not cut the end short
end_job "$$" "${PBSTK_LOCAL_JOB_TOKEN:-}" "${PBSTK_END_GRACE_S:-10}"
[ "$gpus" -gt 0 ] && book_release "$pooldir"
echo "$rc" >"$spool/exit_status.tmp" && mv -f "$spool/exit_status.tmp" "$spool/exit_status"
"""
# ours PGID TOKEN: is some process of group PGID carrying the job's token? (no token file: a job from an older
# pbstk, trusted as before)
_OURS = r"""
ours() {
  [ -z "$2" ] && return 0
  [ -r /proc/self/environ ] || return 0  # no /proc (not Linux): cannot tell, trust the pid as before
  tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qxF "PBSTK_LOCAL_JOB_TOKEN=$2" && return 0
  for e in /proc/[0-9]*; do
    read -r st 2>/dev/null <"$e/stat" || continue
    rest=${st##*) }
    set -- "$1" "$2" $rest
    [ "$5" = "$1" ] || continue
    tr '\0' '\n' 2>/dev/null <"$e/environ" | grep -qxF "PBSTK_LOCAL_JOB_TOKEN=$2" && return 0
  done
  return 1
}
"""
_STATUS = _OURS + r"""
for d in "$@"; do
  s="$d/.local-job"
  pid=$(cat "$s/pid" 2>/dev/null || echo -)
  tok=$(cat "$s/token" 2>/dev/null)
  alive=0; [ "$pid" != - ] && kill -0 -- "-$pid" 2>/dev/null && ours "$pid" "$tok" && alive=1
  ex=$(cat "$s/exit_status" 2>/dev/null || echo -)
  c=0; [ -e "$s/cancelled" ] && c=1
  w=0; [ -e "$s/walltime" ] && w=1
  up=-; if [ "$alive" = 1 ]; then
    t=$(stat -c %Y "$s/pid" 2>/dev/null || stat -f %m "$s/pid" 2>/dev/null) && up=$(( $(date +%s) - t ))
  fi
  wl=$(cat "$s/walltime_limit" 2>/dev/null || echo -)
  wait_for=; [ "$alive" = 1 ] && [ -e "$s/waiting" ] && wait_for=$(head -c 200 "$s/waiting" 2>/dev/null | tr -d '\t\n')
  [ -d "$s" ] || pid=missing
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$pid" "$alive" "$ex" "$c" "$w" "$up" "$wl" "$wait_for"
done
"""
# seconds each job ran (pid marker's mtime to the exit marker's, or to now), ``-`` when it never started
_WALL_CLOCK = r"""
m() { stat -c %Y "$1" 2>/dev/null || stat -f %m "$1" 2>/dev/null; }
for d in "$@"; do
  s="$d/.local-job"
  if [ ! -s "$s/pid" ] || [ -e "$s/waiting" ]; then echo -; continue; fi
  a=$(m "$s/pid") || { echo -; continue; }
  f=0; if [ -e "$s/exit_status" ]; then f=1; b=$(m "$s/exit_status") || b=$a; else b=$(date +%s); fi
  [ "$b" -ge "$a" ] && echo "$((b - a)) $f" || echo "0 $f"
done
"""
# A cancel: SIGTERM to the job's group (the supervisor passes it to the script, whose stop trap ends vLLM's group);
# the supervisor ends the rest and writes the exit status. Should that not come within $2 seconds (a script that
# ignores the signal), the job's group and every process with its token are killed here instead.
_CANCEL = _OURS + _END_JOB + r"""
s=$1/.local-job
pid=$(cat "$s/pid" 2>/dev/null) || exit 3
[ -e "$s/exit_status" ] && exit 2
tok=$(cat "$s/token" 2>/dev/null)
ours "$pid" "$tok" || exit 2
: >"$s/cancelled"
kill -TERM -- "-$pid" 2>/dev/null || exit 2
for _ in $(seq 1 $(( $2 * 10 ))); do [ -e "$s/exit_status" ] && exit 0; sleep 0.1; done
kill -KILL -- "-$pid" 2>/dev/null
end_job "$pid" "$tok" 0 2>/dev/null
sleep 0.2
[ -e "$s/exit_status" ] || echo 137 >"$s/exit_status"
exit 0
"""


class LocalScheduler(Scheduler):
    name = "local"
    description = "this machine (or the SSH host): the job script runs detached under a small supervisor"
    # Deliberately the PBS backend's template: the very same script a cluster would run, so a job can be tried
    # here first; its #PBS lines are comments to bash, and the supervisor sets the PBS_* variables it reads.
    template_dir = PBSScheduler.template_dir
    template_name = PBSScheduler.template_name
    script_name = PBSScheduler.script_name
    section_type = PBSKeys  # what the shared template reads (no ``local:`` section: ``profile_keys`` is empty)
    streams = {"sched-out": f"{SPOOL}/stdout", "sched-err": f"{SPOOL}/stderr"}  # what the supervisor captures
    cancel_when_final = False  # a process group id may belong to anything once the job has ended
    fixed_node_launcher = "local"  # the start script's own: every node's copy on this machine
    runs_on_submit_host = True

    def validate_profile(self, profile: Any, where: str) -> None:
        # the shared template still renders the directive lines: keep them single, plain lines
        validate_directives(profile, where)

    def stop_hint(self, job_id: str, run_dir: str) -> str:
        return f"kill -TERM -- -$(cat {run_dir}/{SPOOL}/pid)"

    def __init__(self, walltime_seconds: int = 4 * 3600, id_source: Callable[[], int] | None = None,
                 find_job: Callable[[str], RecordedJob] | None = None) -> None:
        self.walltime_seconds = walltime_seconds
        #: hands out numbers never used before (``JobStore.next_id``; launch passes its own store's)
        self.id_source = id_source
        self.find_job = find_job

    def new_job_id(self, runner: Runner) -> str:
        """``<counter>.<host>.local``: unique per job store, and says where the job runs."""
        if self.id_source is None:
            raise SchedulerError("a local job is numbered by the job store: set the scheduler's id_source "
                                 "(jobs/launch.py passes the store's next_id)")
        host = socket.gethostname() if runner.name == "local" else runner.name.split(":", 1)[-1]
        host = re.sub(r"[^A-Za-z0-9-]+", "-", host.split(".", 1)[0]).strip("-") or "host"
        return f"{self.id_source()}.{host}.local"

    def machine_gpus(self, runner: Runner) -> list[MachineGpu]:
        """This machine's GPUs as local jobs book them (schedulers/local/gpus.py)."""
        return machine_gpus(runner)

    def submit(self, runner: Runner, script_path: str, run_dir: str, job_name: str, *,
               walltime_s: int | None = None, begin_at: float | None = None, after: str | None = None,
               gpus: int = 0) -> str:
        after_spool = self._after_spool(after) if after else ""
        pool = [g.entry for g in machine_gpus(runner)] if gpus > 0 else []
        if pool and gpus > len(pool):
            raise UsageError(f"the job asks for {gpus} GPU(s) but this machine has {len(pool)} ("
                             f"{', '.join(pool)}; CUDA_VISIBLE_DEVICES, else nvidia-smi): it could never start")
        if runner.size(script_path) is None:
            raise SchedulerError(f"job script {script_path} does not exist")
        job_id = self.new_job_id(runner)
        spool = f"{run_dir}/{SPOOL}"
        runner.makedirs(spool, 0o700)
        walltime = walltime_s or self.walltime_seconds
        token = secrets.token_hex(16)
        runner.write_bytes(f"{spool}/token", token.encode(), 0o600)
        runner.write_bytes(f"{spool}/walltime_limit", f"{walltime}\n".encode(), 0o644)
        runner.write_bytes(f"{run_dir}/job_id", f"{job_id}\n".encode(), 0o644)  # before it can run: adoptable
        begin = "" if begin_at is None else str(int(begin_at))
        argv = ["setsid", "-f", "bash", "-c", _SUPERVISOR, "pbstk-local", spool, script_path, job_id,
                job_name, run_dir, f"{walltime}s", begin, after_spool, after or "",
                str(gpus if pool else 0), ",".join(pool), pool_dir(runner) if pool else ""]
        # in the environment the supervisor starts with, so /proc/<group leader>/environ shows it too
        result = runner.run(argv, timeout=30, env={"PBSTK_LOCAL_JOB_TOKEN": token})
        if result.rc != 0:
            raise SchedulerError(f"could not start the local job: {first_line(result.stderr)}")
        for _ in range(50):  # the pid marker proves the supervisor started
            if runner.size(f"{spool}/pid"):
                return job_id
            time.sleep(0.05)
        raise SchedulerError(f"the local job did not start (see {spool}/supervisor.log)")

    def _after_spool(self, after: str) -> str:
        """The spool of local job ``after`` (from the job store: a local job id says nothing about its run
        directory), whose start the new job waits for."""
        if self.find_job is None:
            raise UsageError("after: a local job finds the job it waits for in the job store: set the "
                             "scheduler's find_job (jobs/launch.py passes the store's find)")
        try:
            record = self.find_job(after)
        except JobNotFound:
            raise UsageError(f"after: no local job {after!r} in the job store") from None
        if record.scheduler != self.name:
            raise UsageError(f"after: job {after} is not a local job")
        return f"{record.run_dir}/{SPOOL}"

    def query(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, SchedulerJob]:
        if not refs:
            return {}
        result = runner.run(["bash", "-c", _STATUS, "pbstk-status", *[r.run_dir for r in refs]], timeout=60)
        lines = result.stdout.splitlines()
        if result.rc != 0 or len(lines) != len(refs):
            raise SchedulerError(f"could not read local job markers: {first_line(result.stderr)}")
        jobs: dict[str, SchedulerJob] = {}
        for ref, line in zip(refs, lines):
            job = _job(ref.job_id, *line.split("\t"))
            if job is not None:  # None: no spool at all, like a job a scheduler has forgotten
                jobs[ref.job_id] = job
        return jobs

    def accounting(self, runner: Runner, refs: Sequence[JobRef]) -> dict[str, Accounting]:
        """Wall clock from the spool: the pid marker's mtime (the start) to the exit marker's (or now)."""
        if not refs:
            return {}
        result = runner.run(["bash", "-c", _WALL_CLOCK, "pbstk-usage", *[r.run_dir for r in refs]], timeout=60)
        lines = result.stdout.splitlines()
        if result.rc != 0 or len(lines) != len(refs):
            raise SchedulerError(f"could not read local job markers: {first_line(result.stderr)}")
        return {ref.job_id: Accounting(ref.job_id, float(line.split()[0]), "wall clock", nodes=1,
                                       final=line.endswith(" 1"))
                for ref, line in zip(refs, lines) if re.fullmatch(r"\d+ [01]", line)}

    def cancel(self, runner: Runner, ref: JobRef) -> bool:
        result = runner.run(["bash", "-c", _CANCEL, "pbstk-cancel", ref.run_dir, str(CANCEL_WAIT_S)],
                            timeout=CANCEL_WAIT_S + 60)
        if result.rc == 0:
            return True
        if result.rc in (2, 3):
            return False
        raise SchedulerError(f"could not cancel local job {ref.job_id}: {first_line(result.stderr)}")


def _seconds(text: str) -> int | None:
    return int(text) if re.fullmatch(r"\d+", text.strip()) else None


def _job(job_id: str, pid: str, alive: str, exit_text: str, cancelled: str, walltime: str, up: str = "-",
         limit: str = "-", waiting: str = "", *_: str) -> SchedulerJob | None:
    """One line of the status script -> the job, with its :class:`Outcome` once it has ended.

    ``up``: seconds since the supervisor started (the pid marker's age, on the job's host's own clock);
    ``limit``: the walltime it enforces. Both ``-`` when unknown (a job from an older pbstk has no limit file)."""
    if pid == "missing":
        return None
    code = int(exit_text) if re.fullmatch(r"-?\d+", exit_text) else None
    if code is not None:
        if walltime == "1":
            how = Outcome.WALLTIME
        else:
            how = Outcome.CANCELLED if cancelled == "1" else Outcome.EXITED
        return SchedulerJob(job_id, SchedState.FINISHED, "F", exit_status=code, outcome=how,
                            outcome_code=None if how is Outcome.WALLTIME else code)
    if alive == "1" and waiting:  # begin_at / after: not started yet, like PBS's W state
        return SchedulerJob(job_id, SchedState.QUEUED, "W", comment=waiting, walltime_s=_seconds(limit))
    if alive == "1":
        uptime = _seconds(up)
        return SchedulerJob(job_id, SchedState.RUNNING, "R", exec_host="localhost",
                            uptime_s=None if uptime is None else float(uptime), walltime_s=_seconds(limit))
    # no exit marker and no process: killed hard (machine reboot, kill -9 of the group)
    return SchedulerJob(job_id, SchedState.FINISHED, "F", comment="the job's processes are gone without an exit "
                        "status", outcome=Outcome.KILLED, outcome_code=_SIGKILL)
