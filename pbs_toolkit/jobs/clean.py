"""``pbstk clean``: remove the run directories and job records of jobs that ended a while ago.

Run directories (logs, scripts, the local scheduler's spool) and job records otherwise only grow. Only a job the
store records as ended (``final_state``) is ever cleaned; a running, queued or UNKNOWN job never is. A run
directory is deleted only when, checked on the side that holds it (this machine or the login node, through the
runner, in one ``sh`` call whose values are arguments, never spliced into the script):

* it is a real directory, not a symlink, directly inside the runs root of the job's profile (compared by
  physical path, so a symlinked runs root is fine but a run directory leading elsewhere is not);
* it holds pbstk's markers as regular files: ``pbstk-job.json`` and ``job_id`` naming this very job.

``rm -rf`` never follows symlinks inside the directory. A directory that fails a check is left, with the reason,
and so is its record (so a later ``clean`` can say it again); one already gone just loses its record. A job that
an active service still names (``held_by_services``) is left too.

What ``pbstk usage`` reports of a removed job is not lost: its final accounting is read first, and the store
keeps the job's figures in its ledger when it forgets the record (``JobStore.remove``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.jobs.store import FINAL_AT_KEY, JOB_ID_MARKER, RECORD_MARKER, JobRecord, JobStore
from pbs_toolkit.schema import stamp
from pbs_toolkit.transports import Runner

DEFAULT_OLDER_THAN = "7d"

# $1 run dir, $2 runs root, $3 job id, $4 1 = only check. Prints one word (and a reason), exit 0 / 3.
_CHECK_AND_REMOVE = r"""
d=$1; r=$2
if [ ! -e "$d" ] && [ ! -L "$d" ]; then echo gone; exit 0; fi
if [ -L "$d" ] || [ ! -d "$d" ]; then echo "skip: not a directory (or a symlink)"; exit 3; fi
p=$(cd -P -- "$d/.." 2>/dev/null && pwd) || { echo "skip: cannot resolve its parent"; exit 3; }
q=$(cd -P -- "$r" 2>/dev/null && pwd) || { echo "skip: the runs root $r does not exist"; exit 3; }
if [ "$p" != "$q" ]; then echo "skip: not directly inside the runs root $r"; exit 3; fi
for m in "$5" "$6"; do
  if [ -L "$d/$m" ] || [ ! -f "$d/$m" ]; then echo "skip: no pbstk marker $m in it"; exit 3; fi
done
if [ "$(cat -- "$d/$6")" != "$3" ]; then echo "skip: its $6 marker names another job"; exit 3; fi
if [ "$4" = 1 ]; then echo ok; exit 0; fi
rm -rf -- "$d" && echo removed
"""


@dataclass
class CleanItem:
    """One ended job old enough to clean and what became of it: ``removed``, ``would remove`` or ``skipped``."""

    job_id: str
    name: str
    transport: str
    state: str
    run_dir: str
    #: seconds since it ended (since its launch for records that predate the recorded end)
    age_s: float
    action: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CleanReport:
    older_than_s: float
    dry_run: bool
    items: list[CleanItem] = field(default_factory=list)
    #: jobs left alone because they have not ended (running, queued, UNKNOWN) or ended too recently
    active: int = 0
    recent: int = 0
    #: problems that kept a whole group of jobs out (a scheduler or login node that did not answer)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return stamp("clean_report", {
            "older_than_s": self.older_than_s, "dry_run": self.dry_run, "active": self.active,
            "recent": self.recent, "warnings": self.warnings, "items": [i.to_dict() for i in self.items]})


def ended_at(record: JobRecord) -> float:
    value = record.extra.get(FINAL_AT_KEY)
    return float(value) if isinstance(value, (int, float)) else record.created


def select(records: Sequence[JobRecord], older_than_s: float, now: float | None = None
           ) -> tuple[list[JobRecord], int, int]:
    """(ended jobs old enough to clean, how many have not ended, how many ended too recently)."""
    now = time.time() if now is None else now
    old = [r for r in records if r.final_state and now - ended_at(r) >= older_than_s]
    active = sum(1 for r in records if not r.final_state)
    return old, active, len(records) - len(old) - active


def runs_root(record: JobRecord, runner: Runner) -> str:
    """The runs root of the job's profile under the current settings, expanded where the directory lives."""
    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    profile = resolve_launch_settings(RenderRequest(model=record.model, profile=record.profile)).written
    return runner.expanduser(profile.runs_root).rstrip("/") or "/"


def clean_run_dir(runner: Runner, record: JobRecord, root: str, dry_run: bool) -> tuple[str, str]:
    """Check (and unless ``dry_run`` remove) the run directory: ``(word, reason)`` with word one of ``gone``,
    ``ok`` (dry run), ``removed``, ``skip``."""
    run_dir = record.run_dir
    if not run_dir.startswith("/") or "/../" in f"{run_dir}/" or "/./" in f"{run_dir}/" or run_dir.rstrip("/") == "":
        return "skip", "not an absolute, normalised path"
    result = runner.run(["sh", "-c", _CHECK_AND_REMOVE, "pbstk-clean", run_dir.rstrip("/"), root, record.job_id,
                         "1" if dry_run else "0", RECORD_MARKER, JOB_ID_MARKER], timeout=300)
    word, _, reason = result.stdout.strip().partition(": ")
    if result.rc == 0 and word in ("gone", "ok", "removed"):
        return word, ""
    if word == "skip":
        return "skip", reason
    return "skip", f"the check failed (exit {result.rc}): {(result.stderr or result.stdout).strip()[:200]}"


def clean_one(runner: Runner, record: JobRecord, dry_run: bool, now: float,
              roots: dict[tuple[str, str], str | PbstkError] | None = None) -> CleanItem:
    """Clean one ended job's run directory; the caller forgets the record when ``action`` is ``removed``.
    ``roots``: runs roots already resolved, by (transport, profile), shared between calls."""
    item = CleanItem(record.job_id, record.name, record.transport, record.final_state or "", record.run_dir,
                     round(now - ended_at(record), 1), "skipped")
    roots = {} if roots is None else roots
    key = (record.transport, record.profile)
    if key not in roots:
        try:
            roots[key] = runs_root(record, runner)
        except PbstkError as exc:
            roots[key] = exc
    root = roots[key]
    if isinstance(root, PbstkError):
        item.detail = f"cannot tell the runs root of profile {record.profile!r}: {root.message}"
        return item
    word, reason = clean_run_dir(runner, record, root, dry_run)
    if word == "skip":
        item.detail = reason
    elif dry_run:
        item.action = "would remove"
        item.detail = "run directory already gone" if word == "gone" else ""
    else:
        item.action = "removed"
        item.detail = "run directory already gone" if word == "gone" else ""
    return item


def held_by_services(held: Mapping[str, str], records: Sequence[JobRecord], now: float
                     ) -> tuple[list[JobRecord], list[CleanItem]]:
    """(the records no active service references, a ``skipped`` item for each one that one does). ``held``: job
    id -> the name of the active service whose slots name it. A service's keeper reads every job its slots name
    on each tick: an ended replica still named there (a failed one not replaced yet, a drained predecessor)
    keeps its record until the service lets go of it or ends."""
    free, items = [], []
    for record in records:
        if record.job_id in held:
            items.append(CleanItem(record.job_id, record.name, record.transport, record.final_state or "",
                                   record.run_dir, round(now - ended_at(record), 1), "skipped",
                                   f"still a replica of service {held[record.job_id]} (cancel it first)"))
        else:
            free.append(record)
    return free, items


def clean(store: JobStore, runner: Callable[[str], Runner], ask: Callable[[list[JobRecord]], object],
          older_than: float, dry_run: bool, keep_usage: Callable[[list[JobRecord]], object] | None = None, *,
          held: Callable[[], Mapping[str, str]]) -> CleanReport:
    """Remove the run directories and records of jobs that ended at least ``older_than`` seconds ago
    (``Client.clean``). Jobs not recorded as ended are first ``ask``ed about (a status query per transport); one
    whose scheduler or login node does not answer is left alone. ``runner``: the transport's open runner.
    ``keep_usage`` gets the jobs about to be removed while their run directories still exist (their final
    accounting is read then); each removed record's usage figures stay in the store's ledger. ``held``: the
    jobs active services still name (job id -> service name; services/api.py ``held_replicas``), left alone."""
    from pbs_toolkit.jobs.store import forget_run_dirs

    report = CleanReport(older_than, dry_run)
    pending = [r for r in store.all() if not r.final_state]
    for transport in sorted({r.transport for r in pending}):
        group = [r for r in pending if r.transport == transport]
        try:
            ask(group)
        except PbstkError as exc:  # a refusing scheduler, an unreachable login node: its jobs stay
            report.warnings.append(f"could not ask about {len(group)} job(s) via {transport or 'this machine'}"
                                   f" ({exc.message}); they are left alone")
    now = time.time()
    old, report.active, report.recent = select(store.all(), older_than, now)
    old, report.items = held_by_services(held(), old, now)
    if old and keep_usage is not None and not dry_run:
        keep_usage(old)
    removed_here: set[str] = set()
    roots: dict[tuple[str, str], Any] = {}
    for record in old:
        try:
            item = clean_one(runner(record.transport), record, dry_run, now, roots)
        except PbstkError as exc:  # the login node did not answer: nothing there is touched
            item = CleanItem(record.job_id, record.name, record.transport, record.final_state or "",
                             record.run_dir, round(now - ended_at(record), 1), "skipped", exc.message)
        if item.action == "removed":
            store.remove(record)
            if not record.transport:
                removed_here.add(record.run_dir)
        report.items.append(item)
    if removed_here:
        forget_run_dirs(paths.user_state_dir(), removed_here)
    return report
