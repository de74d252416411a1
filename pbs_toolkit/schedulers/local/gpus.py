"""The ``local`` scheduler's GPUs: this machine's, booked like a scheduler books them (docs/settings.md "The local
scheduler's GPUs").

The pool is what the submitting shell's ``CUDA_VISIBLE_DEVICES`` names (a workstation shared by GPU:
``CUDA_VISIBLE_DEVICES=2,3 pbstk launch ...``), else every GPU ``nvidia-smi`` lists; a machine without either has
no pool and books nothing (the job runs as it always did). A job that asks for G GPUs gets G that no running local
job holds: its supervisor books them before the job script starts and exports them as its
``CUDA_VISIBLE_DEVICES``; while fewer are free it waits QUEUED, first come first served, with the reason in its
spool's ``waiting`` file (``waiting for 1 free GPU of 1 (held by 7.host.local)``), as ``qsub`` leaves a job queued
on a full node. A booking is a file per GPU under the pool directory (``held/ENTRY``: the holder's pid and spool);
it lasts until the holder's exit status is written, which its supervisor does only once every process of the job
has ended (schedulers/local/__init__.py ``_END_JOB``), so a GPU is free again only when its memory can be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pbs_toolkit.paths import user_state_dir
from pbs_toolkit.transports.base import Runner

#: where the bookings of one user's local jobs on one machine live, under that machine's XDG state directory
POOL_SUBDIR = "local-gpus"
#: a pool entry is a GPU index or UUID (``GPU-...``, ``MIG-...``): what may name a booking file
_ENTRY = re.compile(r"^[A-Za-z0-9._-]+$")

# The machine's pool: ``cvd ENTRIES`` when the shell names GPUs, else one ``index, MiB`` line per GPU nvidia-smi lists.
_POOL = r"""
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  printf 'cvd %s\n' "$CUDA_VISIBLE_DEVICES"
fi
command -v nvidia-smi >/dev/null 2>&1 || exit 0
nvidia-smi --query-gpu=index,uuid,memory.total --format=csv,noheader,nounits 2>/dev/null
exit 0
"""


@dataclass(frozen=True)
class MachineGpu:
    """One GPU of the pool: its ``CUDA_VISIBLE_DEVICES`` entry and its memory in MiB (``None``: unknown)."""

    entry: str
    memory_mib: int | None = None


def machine_gpus(runner: Runner) -> list[MachineGpu]:
    """The pool of the machine ``runner`` runs on (empty: no GPUs, or none that can be named)."""
    result = runner.run(["bash", "-c", _POOL, "pbstk-gpus"], timeout=30)
    if result.rc != 0:
        return []
    named: list[str] | None = None
    table: dict[str, int | None] = {}
    for line in result.stdout.splitlines():
        if line.startswith("cvd "):
            named = [e.strip() for e in line[4:].split(",") if e.strip()]
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit():
            mib = int(fields[2]) if fields[2].isdigit() else None
            table[fields[0]] = table[fields[1]] = mib
    entries = named if named is not None else [k for k in table if k.isdigit()]
    return [MachineGpu(e, table.get(e)) for e in entries if _ENTRY.match(e)]


def pool_dir(runner: Runner) -> str:
    """The bookings' directory on the machine ``runner`` runs on."""
    if runner.name == "local":
        return str(user_state_dir() / POOL_SUBDIR)
    return runner.expanduser(f"~/.local/state/pbstk/{POOL_SUBDIR}")


# The supervisor's booking (schedulers/local/__init__.py _SUPERVISOR calls book_gpus). Its variables: spool (this
# job's spool). A booking file says "PID SPOOL"; a ticket in queue/ is "NANOSECONDS.PID" (first come first served).
BOOK = r"""
held_live() {  # FILE: a booking whose supervisor lives and whose job has not ended
  local pid sp
  read -r pid sp 2>/dev/null <"$1" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ ! -e "$sp/exit_status" ]
}
book_lock() {  # a directory as the lock (atomic mkdir); one left by a process killed holding it goes after 10 s
  local i
  for i in $(seq 1 100); do
    mkdir "$1/lock" 2>/dev/null && return 0
    if [ -n "$(find "$1/lock" -maxdepth 0 -mmin +0.17 2>/dev/null)" ]; then rmdir "$1/lock" 2>/dev/null; fi
    sleep 0.05
  done
  return 1
}
book_gpus() {  # G POOL DIR: book G entries of POOL (comma list); exports CUDA_VISIBLE_DEVICES
  local g=$1 dir=$3 entry first t holders why
  local -a all free chosen
  IFS=, read -ra all <<<"$2"
  mkdir -p "$dir/held" "$dir/queue" || return 1
  ticket="$dir/queue/$(date +%s%N).$$"
  : >"$ticket"
  while :; do
    if book_lock "$dir"; then
      for t in "$dir"/queue/*; do  # tickets of supervisors that are gone
        [ -e "$t" ] && ! kill -0 "${t##*.}" 2>/dev/null && rm -f "$t"
      done
      first=$(ls "$dir/queue" 2>/dev/null | sort | head -n 1)
      free=() holders=''
      for entry in "${all[@]}"; do
        if held_live "$dir/held/$entry"; then
          read -r _ t <"$dir/held/$entry" 2>/dev/null
          t=$(cat "$t/../job_id" 2>/dev/null)
          [[ " $holders " == *" ${t:-?} "* ]] || holders+="${holders:+ }${t:-?}"
        else
          free+=("$entry")
        fi
      done
      if [ "$first" = "${ticket##*/}" ] && [ "${#free[@]}" -ge "$g" ]; then
        chosen=("${free[@]:0:$g}")
        for entry in "${chosen[@]}"; do printf '%s %s\n' "$$" "$spool" >"$dir/held/$entry"; done
        rm -f "$ticket"
        rmdir "$dir/lock"
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${chosen[*]}")
        export CUDA_VISIBLE_DEVICES
        echo "$CUDA_VISIBLE_DEVICES" >"$spool/gpus"
        return 0
      fi
      rmdir "$dir/lock"
      why=${holders:+held by ${holders// /, }}
      [ "$first" != "${ticket##*/}" ] && why="${why:+$why; }an earlier job waits first"
      printf 'waiting for %s free GPU%s of %s (%s)\n' "$g" "$([ "$g" = 1 ] || echo s)" "${#all[@]}" "$why" \
        >"$spool/waiting"
    fi
    sleep 0.5 & wait $!
  done
}
book_release() {  # DIR: this job's bookings and ticket go (its exit status, written next, frees them anyway)
  local f pid
  rm -f "${ticket:-}"
  for f in "$1"/held/*; do
    read -r pid _ 2>/dev/null <"$f" && [ "$pid" = "$$" ] && rm -f "$f"
  done
}
"""
