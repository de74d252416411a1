"""Writing a job's (or a service's) endpoint into a registry and taking entries out on request: what
``update-endpoint`` and ``update-endpoint --remove`` do (``Client.update_endpoint``, ``remove_endpoints``).

The registry is checked before the wait for readiness (not an hour later); every entry written is recorded with
the job in the store (endpoints/retire.py takes it back when the job ends, unless kept)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit.endpoints import atomic, check_registry, update_endpoint
from pbs_toolkit.endpoints.registry import check_target, parse_text, put_back, read_endpoints, remove_endpoint
from pbs_toolkit.endpoints.retire import refuse_kept_tunnel, remember
from pbs_toolkit.errors import JobNotFound

if TYPE_CHECKING:
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore, RegistryEntry
    from pbs_toolkit.transports.tunnel import Tunnel


def register(store: JobStore, record: Callable[[], JobRecord], ready: Callable[[JobRecord], JobStatus],
             registry: str | None, *, fmt: str = "auto", alias: str | None = None, follow_symlink: bool = False,
             force_format: bool = False, keep_after_end: bool = False,
             tunnel: Callable[[JobStatus], Tunnel] | None = None,
             notice: Callable[[Removal], Any] | None = None) -> EndpointUpdate:
    """Check ``registry`` for ``record()``, wait until ``ready``, then write its endpoint (``tunnel``: through a
    tunnel it opens, its local URL) and remember the entry with the job (``keep_after_end``: kept for good)."""
    refuse_kept_tunnel(tunnel is not None, keep_after_end)
    rec = record()
    fmt = check_registry(rec, registry, fmt, alias, follow_symlink=follow_symlink, force_format=force_format)
    st = ready(rec)
    opened = tunnel(st) if tunnel is not None else None
    result = update_endpoint(st, registry=registry, fmt=fmt, alias=alias, local_url=opened.url if opened else None,
                             follow_symlink=follow_symlink, force_format=force_format)
    remember(store, rec, result, keep=keep_after_end, tunnel=opened, notice=notice)
    return result


def remove_alias(store: JobStore, alias: str, registry: str | None, *, fmt: str = "auto",
                 follow_symlink: bool = False, force_format: bool = False) -> bool:
    """Remove ``alias`` from ``registry`` (default: pbstk's own) and forget it; ``True`` if it was there."""
    target, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
    removed = remove_endpoint(registry, alias, kind, follow_symlink=follow_symlink, force_format=force_format)
    store.forget_alias(str(target), alias)
    return removed


def remove_ref(store: JobStore, ref: str, registry: str | None, *, fmt: str = "auto", follow_symlink: bool = False,
               force_format: bool = False) -> list[Removal]:
    """``update-endpoint --remove REF``: the entry ``REF`` in ``registry`` (default: pbstk's own) if there is one,
    else every entry job ``REF`` wrote (only into ``registry`` when it is given) that still holds its URL, kept
    ones too. Nothing to remove is one ``absent`` outcome, not an error."""
    from pbs_toolkit.endpoints.retire import ABSENT, REMOVED, Removal, retire

    target, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
    current = read_endpoints(target, kind).get(ref)
    if current is not None:
        remove_endpoint(registry, ref, kind, follow_symlink=follow_symlink, force_format=force_format)
        store.forget_alias(str(target), ref)
        return [Removal(str(target), ref, REMOVED, current.url)]
    try:
        found = store.find(ref)
    except JobNotFound:
        return [Removal(str(target), ref, ABSENT)]
    entries = [e for e in store.registry_entries(found) if registry is None or e.registry == str(target)]
    return retire(store, found, include_kept=True, entries=entries) or [Removal(str(target), ref, ABSENT)]


@dataclass(frozen=True)
class Prior:
    """A registry as it was before a write that is only borrowed (``pbstk run``'s): its text and the store's
    records of its entries, so that the end puts back an alias the write re-pointed instead of removing it."""

    target: Path
    kind: str
    text: str | None
    rows: list[RegistryEntry]

    def aliases(self) -> set[str]:
        """The aliases the registry held."""
        return set(parse_text(self.text, self.kind, self.target)) if self.text is not None else set()


def note_prior(store: JobStore, registry: str | None, fmt: str = "auto") -> Prior:
    """The registry ``registry`` (checked as for a write) and the store's entries for it, now."""
    target, kind = check_target(registry, fmt)
    rows = [e for e in store.registry_entries() if e.registry == str(target)]
    return Prior(target, kind, atomic.read_text(target, follow=False), rows)


def give_back(store: JobStore, prior: Prior, update: EndpointUpdate) -> Removal | None:
    """End the borrowed write ``update``: an alias the registry held before (``prior``) gets its entry back, in
    the file (byte for byte while nothing else changed there) and in the store (whose job wrote it, kept or
    not). ``None``: the alias is new, and is the caller's to remove (``retire``)."""
    from pbs_toolkit.endpoints.retire import ABSENT, REPOINTED, RESTORED, Removal

    if prior.text is None or str(prior.target) != update.registry:
        return None
    old = parse_text(prior.text, prior.kind, prior.target).get(update.alias)
    if old is None:
        return None
    restored, current = put_back(prior.target, prior.kind, update.alias, prior.text, update.url)
    store.forget_alias(update.registry, update.alias)  # this run's record of it
    if not restored:  # re-pointed or removed meanwhile, by the user or another job: theirs now
        outcome = ABSENT if current is None else REPOINTED
        return Removal(update.registry, update.alias, outcome, update.url, detail=current.url if current else None)
    for row in prior.rows:
        if row.alias == update.alias:
            store.add_registry_entry(row)
    return Removal(update.registry, update.alias, RESTORED, update.url, detail=old.url)
