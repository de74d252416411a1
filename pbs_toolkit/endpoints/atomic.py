"""Read-modify-write of a registry file under a cross-process lock, replacing the file atomically.

Readers take no lock: ``os.replace`` makes them see the old file or the new one, never a half-written one.
The lock file lives in pbstk's state directory (``locks/<sha256 of the real path>.lock``), never beside the
user's registry: an evaluation repository's ``configs/`` must not collect ``endpoints.py.lock`` files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pbs_toolkit import paths
from pbs_toolkit.endpoints.target import describe
from pbs_toolkit.errors import RegistryError

LOCK_TIMEOUT_S = 60.0
MODE_PLAIN = 0o644
MODE_SECRET = 0o600


def lock_path(path: Path) -> Path:
    """``<state dir>/locks/<sha256 of realpath(path)>.lock``: one lock per real file, whatever name reached it."""
    digest = hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()
    return paths.user_state_dir() / "locks" / f"{digest}.lock"


@contextlib.contextmanager
def locked(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold ``path``'s lock in the state directory (a ``filelock.FileLock``) for the duration of the block."""
    from filelock import FileLock, Timeout

    where = lock_path(path)
    try:
        where.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise RegistryError(f"{path}: cannot create the lock directory {where.parent}: {exc.strerror or exc}") from exc
    lock = FileLock(str(where), timeout=timeout)
    try:
        lock.acquire(poll_interval=0.01)  # writes take milliseconds; the default 50 ms poll dominates
    except Timeout as exc:
        raise RegistryError(
            f"{path}: another process held {lock.lock_file} for more than {timeout:g} s"
        ) from exc
    except OSError as exc:
        raise RegistryError(
            f"{path}: cannot create lock file {lock.lock_file}: {exc.strerror or exc}"
        ) from exc
    try:
        yield
    finally:
        lock.release()


def read_text(path: Path, *, follow: bool = True) -> str | None:
    """The file's text (newlines untouched), or None if it does not exist.

    Only a regular file is opened: ``stat`` first (opening a FIFO would block, opening a device may act), then
    ``O_NONBLOCK`` and ``fstat`` on the descriptor in case the path changed in between. ``follow=False`` adds
    ``O_NOFOLLOW`` for writers, which have resolved the path already.
    """
    try:
        kind = describe((os.stat if follow else os.lstat)(path).st_mode)
        if kind is not None:
            raise RegistryError(f"{path} is {kind}, not a regular file")
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "rb") as handle:
            kind = describe(os.fstat(handle.fileno()).st_mode)
            if kind is not None:
                raise RegistryError(f"{path} is {kind}, not a regular file")
            data = handle.read()
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegistryError(
            f"{path}: cannot parse: not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from exc


def existing_mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def replace_atomically(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to a temp file beside ``path`` with ``mode``, fsync it, and rename it over ``path``."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise RegistryError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise RegistryError(f"{path}: cannot write: {exc.strerror or exc}") from exc
        raise
    # Make the rename itself durable; some filesystems (NFS, some FUSE) refuse to fsync a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
