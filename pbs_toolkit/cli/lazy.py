"""Option values read from the library only when a command runs, so registering the commands stays cheap.

``pbstk --help`` imports every ``*_cmds`` module; a ``click.Choice(list(BACKENDS))`` there would import all the
schedulers (and through them the transports) just to print the top-level help.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import click


class LazyChoice(click.Choice):  # type: ignore[type-arg]
    """A ``click.Choice`` whose choices come from ``source()`` whenever they are needed (parsing, a command's
    ``--help``, shell completion), not when the option is declared: they follow the registry they name."""

    def __init__(self, source: Callable[[], Iterable[str]], case_sensitive: bool = True,
                 known: Iterable[str] = ()) -> None:
        self._source = source
        self.case_sensitive = case_sensitive
        #: values ``source()`` always lists: taken without asking it (``logs --stream vllm`` loads no backend)
        self.known = frozenset(known)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.known:
            return value
        return super().convert(value, param, ctx)

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return tuple(self._source())

    @choices.setter
    def choices(self, value: Any) -> None:
        fixed = tuple(value)
        self._source = lambda: fixed


def backend_names() -> list[str]:
    """The registered scheduler backends (``--scheduler``)."""
    from pbs_toolkit.schedulers import BACKENDS

    return list(BACKENDS)


def log_streams() -> tuple[str, ...]:
    """Every stream name ``pbstk logs --stream`` accepts."""
    from pbs_toolkit.jobs.logs import streams

    return streams()


def registry_formats() -> list[str]:
    """``--format`` of the registry commands: ``auto`` (by the file's suffix), then every name in ``FORMATS``."""
    from pbs_toolkit.endpoints.formats import FORMATS

    return ["auto", *FORMATS]
