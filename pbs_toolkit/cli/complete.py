"""Shell completion of job ids and names (active services' names too), presets and profiles (Click's
``_PBSTK_COMPLETE`` machinery).

Completion runs on every TAB: it reads only the local job store and the preset/profile directories (no
scheduler query, no SSH login), and never raises: a broken store or YAML file completes nothing rather than
printing a traceback into the user's prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import click
from click.shell_completion import CompletionItem

__all__ = ["complete_job", "complete_preset", "complete_profile"]


def _items(candidates: Callable[[], Iterable[tuple[str, str]]], incomplete: str) -> list[CompletionItem]:
    """Candidates (value, help) starting with ``incomplete``, each once, in the order given; [] on any error."""
    try:
        seen: dict[str, str] = {}
        for value, help_text in candidates():
            if value and value.startswith(incomplete) and value not in seen:
                seen[value] = help_text
        return [CompletionItem(value, help=help_text or None) for value, help_text in seen.items()]
    except Exception:  # noqa: BLE001 - completion must never break the shell prompt
        return []


def _jobs() -> Iterable[tuple[str, str]]:
    import contextlib
    import io

    from pbs_toolkit.jobs.store import JobStore

    with contextlib.redirect_stderr(io.StringIO()):  # a store warning must not land in the prompt
        store = JobStore()
        records, services = store.all(), store.service_rows()
    for r in records:  # newest first
        yield r.job_id, f"{r.name} ({r.final_state or 'active'})"
    for r in records:
        yield r.name, r.job_id
    for row in services:  # the commands that take a job name take a service's too (docs/services.md)
        if row["ended"] is None:
            yield row["name"], "service"


def _presets() -> Iterable[tuple[str, str]]:
    from pbs_toolkit.settings.presets import list_presets

    for p in list_presets():
        yield p.name, p.summary


def _profiles() -> Iterable[tuple[str, str]]:
    from pbs_toolkit.settings.profiles import list_profiles

    for p in list_profiles():
        yield p.name, p.description


def complete_job(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Job ids (newest first), then job names, from the local job store."""
    return _items(_jobs, incomplete)


def complete_preset(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Preset names, shipped and the user's."""
    return _items(_presets, incomplete)


def complete_profile(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Site profile names, shipped and the user's."""
    return _items(_profiles, incomplete)
