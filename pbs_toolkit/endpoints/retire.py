"""Take a job's registry entries out again: on ``cancel``, when the job is first seen ended, and on request.

``update-endpoint`` records every entry it writes in the job store (``RegistryEntry``: registry, format,
alias, URL). A dead URL left in ``endpoints.py`` makes the next evaluation fail with a connection error far from
its cause, so those entries are removed when the job ends, unless the user asked to keep them
(``--keep-after-end``, ``cancel --keep-endpoint``). An entry is only removed while it still holds this job's
URL: an alias that the user or a newer job re-pointed is left alone, and the user is told. A registry that is
gone is nothing to do; one that cannot be written is one warning line, never a failed command.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pbs_toolkit.errors import RegistryError, UsageError
from pbs_toolkit.jobs.store import JobRecord, JobStore, RegistryEntry
from pbs_toolkit.schema import stamp

#: what happened to one entry (``restored``: the entry it replaced is back, ``pbstk run``'s end)
REMOVED, ABSENT, REPOINTED, FAILED, RESTORED = "removed", "absent", "re-pointed", "failed", "restored"


@dataclass(frozen=True)
class Removal:
    """The outcome for one registry entry (``to_dict`` for ``--json``)."""

    registry: str
    alias: str
    outcome: str
    url: str | None = None
    job_id: str | None = None
    #: the URL the alias points to now (re-pointed, restored), or why the removal failed
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return stamp("removal", asdict(self))

    def message(self) -> str | None:
        """The line to show on stderr (``None``: nothing worth saying)."""
        job = f" (job {self.job_id})" if self.job_id else ""
        if self.outcome == REMOVED:
            return f"pbstk: note: removed {self.alias!r} -> {self.url} from {self.registry}{job}"
        if self.outcome == REPOINTED:
            return (f"pbstk: note: left {self.alias!r} in {self.registry}: it now points to {self.detail}, "
                    f"not to {self.url}{job}")
        if self.outcome == RESTORED:
            return f"pbstk: note: put {self.alias!r} in {self.registry} back as it was: -> {self.detail}"
        if self.outcome == FAILED:
            return (f"pbstk: warning: could not remove {self.alias!r} from {self.registry}: {self.detail}; "
                    f"remove it with `pbstk update-endpoint --remove {self.alias} --registry {self.registry}`")
        return None


def print_removal(removal: Removal) -> None:
    """The default way a ``Client`` tells about removals: one line on stderr."""
    line = removal.message()
    if line:
        sys.stderr.write(line + "\n")


def retire_entry(entry: RegistryEntry) -> Removal:
    """Remove ``entry`` from its registry if it still holds the recorded URL. Never raises ``RegistryError``.

    One locked read-check-remove: the file is parsed once for the check (a 4 MB ``endpoints.py`` in about as
    long as a write takes), never read beforehand without the lock."""
    from pbs_toolkit.endpoints.registry import remove_entry

    def outcome(kind: str, detail: str | None = None) -> Removal:
        return Removal(entry.registry, entry.alias, kind, entry.url, entry.job_id, detail)

    if not os.path.lexists(entry.registry):
        return outcome(ABSENT)  # the registry (or its directory) is gone: nothing left to clean
    try:
        # the recorded path is the real file that was written: no symlink left to follow; the format is the one
        # that was used, even where it disagreed with the suffix (--force-format then)
        removed, current = remove_entry(entry.registry, entry.alias, entry.format, force_format=True,
                                        only_url=entry.url)
    except RegistryError as exc:
        return outcome(FAILED, exc.message)
    except OSError as exc:
        return outcome(FAILED, exc.strerror or str(exc))
    if removed:
        return outcome(REMOVED)
    return outcome(ABSENT) if current is None else outcome(REPOINTED, current.url)


def retire(store: JobStore, record: JobRecord, *, include_kept: bool = False,
           entries: list[RegistryEntry] | None = None,
           notice: Callable[[Removal], None] | None = None) -> list[Removal]:
    """Remove the entries ``record`` wrote (``entries``: those already read from the store) and forget them.

    Kept entries are skipped unless ``include_kept`` (an explicit ``update-endpoint --remove JOB``). Every entry
    is forgotten once handled, a failed one too: its warning says how to remove it by hand."""
    out = []
    for entry in store.registry_entries(record) if entries is None else entries:
        if entry.keep and not include_kept:
            continue
        removal = retire_entry(entry)
        store.forget_registry_entry(entry)
        if notice is not None:
            notice(removal)
        out.append(removal)
    return out


def refuse_kept_tunnel(via_tunnel: bool, keep_after_end: bool) -> None:
    """``--keep-after-end`` with ``--via-tunnel`` is refused before anything is written."""
    if via_tunnel and keep_after_end:
        raise UsageError("--keep-after-end with --via-tunnel: the tunnel's URL dies with the tunnel, so its entry "
                         "is removed when the tunnel closes")


def remember(store: JobStore, record: JobRecord, result: Any, *, keep: bool, tunnel: Any = None,
             notice: Callable[[Removal], None] | None = None) -> None:
    """Record the entry ``update-endpoint`` wrote (``result``) with ``record``: taken back when the job ends or is
    cancelled, unless ``keep``. One written through ``tunnel`` (its local URL) goes when the tunnel closes, still
    only while it holds that URL: a dead local URL must not stay behind."""
    store.forget_alias(result.registry, result.alias)  # the alias is this job's now, not an older one's
    entry = RegistryEntry(record.job_id, record.transport, result.registry, result.format, result.alias, result.url,
                          keep=keep)
    store.add_registry_entry(entry)
    if tunnel is not None:
        tunnel.on_close(lambda: _retire_if_recorded(store, record, entry, notice))


def _retire_if_recorded(store: JobStore, record: JobRecord, entry: RegistryEntry,
                        notice: Callable[[Removal], None] | None) -> None:
    """A tunnel's entry when the tunnel closes, unless already taken back (the job's end, or ``pbstk run``'s
    end putting back the entry it had replaced: the store's row is then that entry's, and must stay)."""
    key = (entry.registry, entry.alias, entry.url)
    if any((e.registry, e.alias, e.url) == key for e in store.registry_entries(record)):
        retire(store, record, entries=[entry], notice=notice)


def retire_ended(store: JobStore, records: list[JobRecord], notice: Callable[[Removal], None] | None = None) -> None:
    """Retire the entries of ``records`` (jobs seen ended): one store read, nothing when none wrote any."""
    if not records:
        return
    wrote: dict[tuple[str, str], list[RegistryEntry]] = {}
    for entry in store.registry_entries():
        wrote.setdefault((entry.transport, entry.job_id), []).append(entry)
    for record in records:
        entries = wrote.get((record.transport, record.job_id))
        if entries:
            retire(store, record, entries=entries, notice=notice)
