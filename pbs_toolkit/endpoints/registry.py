"""Endpoint registries: write one endpoint entry into the file an evaluation tool reads, safely.

Formats (one module each, behind one ``RegistryFormat`` interface in ``formats.FORMATS``):

* ``py``   verifiers 0.1.x ``configs/endpoints.py`` (``py_dict``)
* ``toml`` verifiers 0.3.x ``configs/endpoints.toml`` (``verifiers_toml``)
* ``yaml``/``json`` pbstk's own registry (``data_file``), the only formats that may hold an API key

Every write is a read-modify-write under a lock in pbstk's state directory (never a ``.lock`` file beside the
registry) followed by an atomic rename (``atomic``), so
concurrent writers never lose each other's entries and readers never see a half-written file. A file that
does not parse is never touched, and only regular files are ever written (``target``: no devices, FIFOs,
sockets, pseudo-files or symlinks leading out of the named directory). tomlkit, yaml and filelock are imported
only when a function needs them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pbs_toolkit.endpoints import atomic
from pbs_toolkit.endpoints import target as safety
from pbs_toolkit.endpoints.entry import EndpointEntry, validate_entry
from pbs_toolkit.endpoints.formats import FORMATS, RegistryFormat, by_suffix
from pbs_toolkit.errors import RegistryError

#: a UTF-8 byte order mark (Windows editors write one): kept where it is, never parsed as text
BOM = "\ufeff"

__all__ = [
    "FORMATS",
    "EndpointEntry",
    "RegistryFormat",
    "check_target",
    "default_registry_path",
    "detect_format",
    "read_endpoints",
    "remove_endpoint",
    "write_endpoint",
]


def _without_bom(text: str) -> tuple[str, str]:
    """(the byte order mark or "", the text after it): formats parse the text, a write puts the mark back."""
    return (BOM, text[1:]) if text.startswith(BOM) else ("", text)


def detect_format(path: str | os.PathLike[str], fmt: str = "auto", *, force: bool = False) -> str:
    """The registry format of ``path``: ``fmt`` if given, else by suffix (.py/.toml/.yaml/.yml/.json).

    A named format must agree with a known suffix (``py`` for ``x.yaml`` would write Python into a YAML file)
    unless ``force``; a path without a known suffix takes the named format.
    """
    suffix = Path(path).suffix.lower()
    known = by_suffix()
    if fmt != "auto":
        if fmt not in FORMATS:
            raise RegistryError(
                f"{path}: unknown registry format {fmt!r} (known: {', '.join(FORMATS)}, auto)"
            )
        if suffix in known and known[suffix] != fmt and not force:
            raise RegistryError(
                f"{path}: format {fmt} does not match the suffix {suffix!r} ({known[suffix]}); "
                "rename the file or use --force-format"
            )
        return fmt
    if suffix not in known:
        raise RegistryError(
            f"{path}: cannot tell the registry format from the suffix {suffix or '(none)'!r}; "
            f"use one of {', '.join(known)} or name the format ({', '.join(FORMATS)})"
        )
    return known[suffix]


def default_registry_path() -> Path:
    """pbstk's own registry: ``<user data dir>/pbstk/endpoints.yaml`` (``$XDG_DATA_HOME`` is honoured)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("pbstk")) / "endpoints.yaml"


def _resolve(
    path: str | os.PathLike[str] | None, *, create_default_dir: bool, follow_symlink: bool = False
) -> Path:
    """The file to edit: a regular file or none yet, never a device, FIFO, socket, directory or pseudo-file.

    A symlinked registry is edited where it points, so the link survives, but only when the target stays in
    the directory the user named or ``follow_symlink`` allows it (see :mod:`.target`).
    """
    default = default_registry_path()
    named = Path(os.path.abspath(default if path is None else Path(path).expanduser()))
    target = Path(os.path.realpath(named))
    safety.refuse_non_regular(named, target)
    safety.refuse_pseudo_filesystem(named, target)
    parent = target.parent
    if not parent.is_dir():
        if create_default_dir and target == Path(os.path.realpath(default)):
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RegistryError(f"{parent}: cannot create directory: {exc.strerror or exc}") from exc
        else:
            raise RegistryError(f"{parent} does not exist")
    safety.refuse_foreign_symlink(named, target, follow_symlink)
    return target


def check_target(
    path: str | os.PathLike[str] | None,
    fmt: str = "auto",
    *,
    follow_symlink: bool = False,
    force_format: bool = False,
) -> tuple[Path, str]:
    """Everything :func:`write_endpoint` would refuse about the file itself, checked without writing anything.

    Returns the file that would be edited and its format. Callers run this before waiting for a server so that
    an unusable registry fails in milliseconds, not after the wait; the write checks it all again under the lock.
    """
    kind = detect_format(default_registry_path() if path is None else path, fmt, force=force_format)
    default_dir_missing = path is None and not default_registry_path().parent.is_dir()
    if default_dir_missing:
        return default_registry_path(), kind  # created on write; nothing there to check yet
    target = _resolve(path, create_default_dir=False, follow_symlink=follow_symlink)
    safety.check_writable(target)
    text = atomic.read_text(target, follow=False)
    if text is not None:
        FORMATS[kind].check(_without_bom(text)[1], target)
    return target, kind


def write_endpoint(
    path: str | os.PathLike[str] | None,
    entry: EndpointEntry,
    fmt: str = "auto",
    *,
    api_key: str | None = None,
    follow_symlink: bool = False,
    force_format: bool = False,
) -> Path:
    """Insert or replace the entry for ``entry.alias`` in the registry at ``path``; every other entry is kept.

    ``path=None`` means :func:`default_registry_path` (its directory is created if needed; a directory
    named by the user never is). ``api_key`` is accepted by the yaml/json formats only; a file holding one
    gets mode 0600. A new file otherwise gets 0644; an existing file keeps its mode. Returns the path written.
    Only a regular file (or none yet) is written, see :func:`_resolve`; ``force_format`` lets ``fmt`` disagree
    with the file's suffix.
    """
    target = _resolve(path, create_default_dir=True, follow_symlink=follow_symlink)
    kind = detect_format(target if path is None else path, fmt, force=force_format)
    validate_entry(entry, kind, target)
    fmt_impl: RegistryFormat = FORMATS[kind]
    if api_key is not None and not fmt_impl.holds_secrets:
        raise RegistryError(
            f"{target}: {kind} registries name the key's environment variable ({entry.key_env}); "
            "they never hold the key itself"
        )
    if api_key is not None and (not api_key or any(c in api_key for c in "\r\n")):
        raise RegistryError(f"{target}: api_key for {entry.alias!r} must be non-empty and on one line")
    safety.check_writable(target)
    with atomic.locked(target):
        safety.refuse_non_regular(target, target)  # again under the lock: it may have changed meanwhile
        read = atomic.read_text(target, follow=False)
        bom, text = _without_bom(read) if read is not None else ("", None)
        new_text, holds_secret = fmt_impl.upsert(text, entry, target, api_key)
        new_text = bom + new_text
        mode = atomic.existing_mode(target)
        if mode is None:
            mode = atomic.MODE_SECRET if holds_secret else atomic.MODE_PLAIN
        elif holds_secret:
            mode = (mode & ~0o077) | 0o600  # a key must not stay readable by group or others
        atomic.replace_atomically(target, new_text, mode)
    return target


def read_endpoints(path: str | os.PathLike[str] | None, fmt: str = "auto") -> dict[str, EndpointEntry]:
    """Every entry in the registry at ``path`` (None: the default registry) by alias; {} if there is no file.

    Takes no lock: writers replace the file atomically, so a read sees either the old or the new file.
    """
    target = Path(default_registry_path() if path is None else path).expanduser()
    kind = detect_format(target, fmt, force=True)  # reading writes nothing: the caller's format wins
    text = atomic.read_text(target)
    if text is None:
        return {}
    return FORMATS[kind].parse(_without_bom(text)[1], target)


def remove_endpoint(
    path: str | os.PathLike[str] | None,
    alias: str,
    fmt: str = "auto",
    *,
    follow_symlink: bool = False,
    force_format: bool = False,
    only_url: str | None = None,
) -> bool:
    """Remove the entry for ``alias``; True if it was there. The file keeps its mode and everything else.

    ``only_url``: remove it only while it still points there (see :func:`remove_entry`)."""
    return remove_entry(path, alias, fmt, follow_symlink=follow_symlink, force_format=force_format,
                        only_url=only_url)[0]


def remove_entry(
    path: str | os.PathLike[str] | None,
    alias: str,
    fmt: str = "auto",
    *,
    follow_symlink: bool = False,
    force_format: bool = False,
    only_url: str | None = None,
) -> tuple[bool, EndpointEntry | None]:
    """:func:`remove_endpoint`, and the entry found under the lock when ``only_url`` is given (``None``: absent).

    ``only_url``: remove it only while it still points there, checked under the lock, so a job's end never
    removes an alias that the user or a newer job has re-pointed meanwhile."""
    target = _resolve(path, create_default_dir=False, follow_symlink=follow_symlink)
    kind = detect_format(target if path is None else path, fmt, force=force_format)
    safety.check_writable(target)
    with atomic.locked(target):
        safety.refuse_non_regular(target, target)
        read = atomic.read_text(target, follow=False)
        if read is None:
            return False, None
        bom, text = _without_bom(read)
        current = None
        if only_url is not None:
            current = FORMATS[kind].parse(text, target).get(alias)
            if current is None or current.url != only_url:
                return False, current
        new_text = FORMATS[kind].remove(text, alias, target)
        if new_text is None:
            return False, None
        mode = atomic.existing_mode(target)
        atomic.replace_atomically(target, bom + new_text, atomic.MODE_PLAIN if mode is None else mode)
    return True, current


def parse_text(text: str, kind: str, path: Path) -> dict[str, EndpointEntry]:
    """Every entry by alias in ``text``, a registry file's whole text (a byte order mark included)."""
    return FORMATS[kind].parse(_without_bom(text)[1], path)


def put_back(path: Path, kind: str, alias: str, before: str, only_url: str) -> tuple[bool, EndpointEntry | None]:
    """Give ``alias`` back the entry it had in ``before`` (the file's text before a borrowed write), while it
    still points to ``only_url`` (the borrowed URL), under the lock. When nothing else in the file changed
    meanwhile, the file becomes ``before`` again, byte for byte; otherwise only the entry is written back.
    Returns whether it was put back, and the entry found (``None``: absent)."""
    fmt_impl = FORMATS[kind]
    old = parse_text(before, kind, path)
    safety.check_writable(path)
    with atomic.locked(path):
        safety.refuse_non_regular(path, path)
        read = atomic.read_text(path, follow=False)
        if read is None:
            return False, None
        bom, text = _without_bom(read)
        now = fmt_impl.parse(text, path)
        current = now.get(alias)
        if current is None or current.url != only_url:
            return False, current
        others_unchanged = {k: v for k, v in now.items() if k != alias} == {k: v for k, v in old.items()
                                                                            if k != alias}
        new_text = before if others_unchanged else bom + fmt_impl.upsert(text, old[alias], path, None)[0]
        mode = atomic.existing_mode(path)
        atomic.replace_atomically(path, new_text, atomic.MODE_PLAIN if mode is None else mode)
    return True, current
