"""A file held open over SFTP (``SSHRunner.open_file``), through the runner's SFTP call (which reopens the
session after a dropped connection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import paramiko

from pbs_toolkit.transports.base import OpenFile

_T = TypeVar("_T")


class SftpFile(OpenFile):
    """A file held open over SFTP: reads reach the same file after a rename or an unlink (sftp-server keeps it
    open), so a rotated log is drained to its end.

    SFTP attributes carry no inode, so "the path still names it" is judged from (size, mtime): fstat the
    handle, stat the path, fstat again; the path is this file when its attributes equal the handle's at either
    end or, while the file grows, its size lies between the two. A replacement with exactly the old size and
    mtime second would pass for the old file until either changes. After a dropped connection the handle is
    gone: the path is opened again and taken for the same file.
    """

    def __init__(self, path: str, sftp_call: Callable[[Callable[[paramiko.SFTPClient], Any]], Any]) -> None:
        super().__init__(path)
        #: the runner's ``_sftp_call``: runs an operation on its SFTP session, reconnecting once if it dropped
        self._sftp_call = sftp_call
        self._fh: paramiko.SFTPFile | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._call(lambda _fh: None)  # opens it now: FileNotFoundError when missing

    def _call(self, operation: Callable[[paramiko.SFTPFile], _T]) -> _T:
        def call(sftp: paramiko.SFTPClient) -> _T:
            if self._fh is None or self._sftp is not sftp:  # first use, or a new session after a drop
                self._fh, self._sftp = sftp.open(self.path, "rb"), sftp
            return operation(self._fh)

        result: _T = self._sftp_call(call)
        return result

    def read(self, offset: int, length: int) -> bytes:
        def read(fh: paramiko.SFTPFile) -> bytes:
            fh.seek(offset)
            return fh.read(length)

        return self._call(read)

    def size(self) -> int:
        return int(self._call(lambda fh: fh.stat().st_size) or 0)

    def path_names_it(self) -> bool | None:
        def check(fh: paramiko.SFTPFile) -> bool | None:
            before = fh.stat()
            try:
                now = fh.sftp.stat(self.path)
            except FileNotFoundError:
                return None
            after = fh.stat()
            ends = {(before.st_size, before.st_mtime), (after.st_size, after.st_mtime)}
            if (now.st_size, now.st_mtime) in ends:
                return True
            grew = (before.st_size or 0) < (after.st_size or 0)
            return grew and (before.st_size or 0) <= (now.st_size or 0) <= (after.st_size or 0)

        return self._call(check)

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except Exception:  # noqa: S110 - closing on a dead session may fail in many ways
                pass
            self._fh = None
