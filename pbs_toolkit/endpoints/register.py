"""Writing a job's (or a service's) endpoint into a registry and taking entries out on request: what
``update-endpoint`` and ``update-endpoint --remove`` do (``Client.update_endpoint``, ``remove_endpoints``).

The registry is checked before the wait for readiness (not an hour later); every entry written is recorded with
the job in the store (endpoints/retire.py takes it back when the job ends, unless kept)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pbs_toolkit.endpoints import EndpointUpdate
    from pbs_toolkit.endpoints.retire import Removal
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.transports.tunnel import Tunnel


def register(store: JobStore, record: Callable[[], JobRecord], ready: Callable[[JobRecord], JobStatus],
             registry: str | None, *, fmt: str = "auto", alias: str | None = None, follow_symlink: bool = False,
             force_format: bool = False, keep_after_end: bool = False,
             tunnel: Callable[[JobStatus], Tunnel] | None = None,
             notice: Callable[[Removal], Any] | None = None) -> EndpointUpdate:
    """Check ``registry`` for ``record()``, wait until ``ready``, then write its endpoint (``tunnel``: through a
    tunnel it opens, its local URL) and remember the entry with the job (``keep_after_end``: kept for good)."""
    from pbs_toolkit.endpoints import check_registry, update_endpoint
    from pbs_toolkit.endpoints.retire import refuse_kept_tunnel, remember

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
    from pbs_toolkit.endpoints.registry import check_target, remove_endpoint

    target, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
    removed = remove_endpoint(registry, alias, kind, follow_symlink=follow_symlink, force_format=force_format)
    store.forget_alias(str(target), alias)
    return removed


def remove_ref(store: JobStore, ref: str, registry: str | None, *, fmt: str = "auto", follow_symlink: bool = False,
               force_format: bool = False) -> list[Removal]:
    """``update-endpoint --remove REF``: the entry ``REF`` in ``registry`` (default: pbstk's own) if there is one,
    else every entry job ``REF`` wrote (only into ``registry`` when it is given) that still holds its URL, kept
    ones too. Nothing to remove is one ``absent`` outcome, not an error."""
    from pbs_toolkit.endpoints.registry import check_target, read_endpoints, remove_endpoint
    from pbs_toolkit.endpoints.retire import ABSENT, REMOVED, Removal, retire
    from pbs_toolkit.errors import JobNotFound

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
