"""Whether this machine is one of a profile's login hosts (settings/login_host.py says what follows from it).

Kept apart from profiles.py, which asks it (``Profile.with_overrides`` drops ``ssh_host`` here), and from
login_host.py, which needs the profile list: this module knows a profile only by the three fields it reads."""

from __future__ import annotations

import fnmatch
import shutil
import socket
from dataclasses import replace
from typing import Any, ClassVar, Protocol, TypeVar

from pbs_toolkit.schedulers import BACKENDS


class Placed(Protocol):
    """What this module reads of a ``Profile`` (a dataclass: ``without_ssh_here`` replaces one field)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def scheduler(self) -> str: ...
    @property
    def ssh_host(self) -> str | None: ...
    @property
    def login_hosts(self) -> list[str]: ...


P = TypeVar("P", bound=Placed)


def host_names() -> list[str]:
    """This host's name and its first label (the fully qualified name is looked up only when a pattern needs it)."""
    name = socket.gethostname()
    return [name, name.split(".", 1)[0]]


def _matches(patterns: list[str]) -> bool:
    names = host_names()
    if any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns):
        return True
    if any("." in p for p in patterns):  # a pattern with a domain: ask DNS once (slow on some laptops)
        fqdn = socket.getfqdn()
        return any(fnmatch.fnmatchcase(fqdn, p) for p in patterns)
    return False


def submit_program(scheduler: str) -> str | None:
    backend = BACKENDS.get(scheduler)
    return getattr(backend, "submit_program", None) if backend is not None else None


def on_login_host(profile: Placed) -> bool:
    """Whether this is one of ``profile``'s login hosts, with its scheduler's submit program on PATH."""
    program = submit_program(profile.scheduler)
    return bool(profile.login_hosts and program and shutil.which(program) and _matches(profile.login_hosts))


def without_ssh_here(profile: P, explicit: set[str]) -> P:
    """``profile`` without its ``ssh_host`` on one of its own login hosts, unless ``ssh_host`` was set explicitly."""
    if profile.ssh_host and "ssh_host" not in explicit and on_login_host(profile):
        return replace(profile, ssh_host=None)
    return profile
