"""Where a registry write may land: a regular file (or none yet) in a writable directory, nothing else.

A registry path comes from the user and is written by replacing the file, so a careless or hostile path must
not turn the write into something else: a device replaced by a regular file (``/dev/null``), a FIFO that
blocks the writer forever, a kernel pseudo-file (``/proc/...``) that fails only after the lock times out, or a
symlink that makes pbstk rewrite a file elsewhere (``e.py -> /etc/hostname``). Every check here looks with
``lstat``/``stat``/``statvfs`` and never opens the path: opening a FIFO blocks and opening a device may act.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pbs_toolkit.errors import RegistryError

#: directories whose entries are kernel interfaces, never files a registry may live in
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
#: filesystem types (``/proc/self/mountinfo``) of the same kind, wherever they are mounted
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "configfs", "bpf", "pstore", "efivarfs", "mqueue", "fusectl", "binfmt_misc",
})
_MOUNTINFO = "/proc/self/mountinfo"


def describe(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO", ...), or None for a regular file."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink that does not resolve"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _pseudo_devices() -> set[int]:
    """``st_dev`` of every mounted pseudo-filesystem (empty where there is no mountinfo to read)."""
    devices: set[int] = set()
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return devices
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 3:
            continue
        fstype = line.split(" - ", 1)[1].split(" ", 1)[0]
        major, _, minor = fields[2].partition(":")
        if fstype in PSEUDO_FILESYSTEMS and major.isdigit() and minor.isdigit():
            devices.add(os.makedev(int(major), int(minor)))
    return devices


def refuse_pseudo_filesystem(named: Path, real: Path) -> None:
    """Refuse a path under ``/proc``, ``/sys`` or ``/dev``, or in a directory on such a filesystem."""
    for candidate in (str(named), str(real)):
        for root in PSEUDO_ROOTS:
            if _under(candidate, root):
                raise RegistryError(
                    f"{named}: {root} holds kernel interfaces, not files; a registry must be a regular file"
                )
    try:
        device = os.stat(real.parent).st_dev
    except OSError:
        return  # a missing directory is reported by the caller
    if device in _pseudo_devices():
        raise RegistryError(
            f"{named}: {real.parent} is on a kernel pseudo-filesystem; a registry must be a regular file"
        )


def refuse_foreign_symlink(named: Path, real: Path, follow_symlink: bool) -> None:
    """Refuse a symlink whose target leaves the directory the user named, unless following it is allowed.

    A link beside its target (``endpoints.py -> endpoints.real.py``) is the user's own arrangement and is
    edited where it points, keeping the link. The directory is compared after resolving it, so naming a
    directory through a symlink (``~/configs -> /shared/configs``) is not a "leaving" link.
    """
    if not named.is_symlink() or follow_symlink:
        return
    if real.parent != Path(os.path.realpath(named.parent)):
        raise RegistryError(
            f"{named} is a symlink to {real}, outside {named.parent}; pbstk does not write through it "
            "(--follow-symlink edits the file it points to)"
        )


def refuse_non_regular(named: Path, real: Path) -> None:
    """Refuse an existing ``real`` that is not a regular file; a missing one is fine (it will be created)."""
    try:
        mode = os.lstat(real).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RegistryError(f"{named}: cannot inspect {real}: {exc.strerror or exc}") from exc
    kind = describe(mode)
    if kind is not None:
        shown = f"{named} ({real})" if named != real else str(named)
        raise RegistryError(f"{shown} is {kind}, not a regular file; pbstk writes registries only to regular files")


def _write_bits_allow(st: os.stat_result, path: Path, access: int) -> bool:
    """Whether we may write ``path``. No write bit at all means read-only even for root, who ignores bits."""
    if not st.st_mode & 0o222:
        return False
    effective = os.access in os.supports_effective_ids
    return os.access(path, access, effective_ids=effective)


def check_writable(target: Path) -> None:
    """Refuse a write that would fail or that the file's owner has ruled out, before any lock or wait.

    The write creates a temp file beside ``target`` and renames it over ``target``, so the directory must be
    writable; an existing file without write permission (0444) is read-only on purpose and is not replaced.
    """
    directory = target.parent
    try:
        vfs = os.statvfs(directory)
        dir_st = os.stat(directory)
    except OSError as exc:
        raise RegistryError(f"{target}: cannot inspect {directory}: {exc.strerror or exc}") from exc
    if vfs.f_flag & os.ST_RDONLY:
        raise RegistryError(f"{target}: {directory} is on a read-only filesystem")
    try:
        file_st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        file_st = None
    except OSError as exc:
        raise RegistryError(f"{target}: cannot inspect: {exc.strerror or exc}") from exc
    if file_st is not None and not _write_bits_allow(file_st, target, os.W_OK):
        mode = stat.S_IMODE(file_st.st_mode)
        raise RegistryError(f"{target} is read-only (mode {mode:04o}); pbstk will not replace it")
    if not _write_bits_allow(dir_st, directory, os.W_OK | os.X_OK):
        mode = stat.S_IMODE(dir_st.st_mode)
        raise RegistryError(
            f"{target}: the directory {directory} is read-only for us (mode {mode:04o}); "
            "the registry is written as a new file renamed into it"
        )
