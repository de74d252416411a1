"""`LocalFiles`: files on this machine, with `os` alone; `LocalRunner` (transports/local.py) adds commands to it.

A module of its own so that reading a file here costs no more than its imports: `pbstk logs -n` of a job on this
machine reads the end of its log through this class, without `subprocess` and the command log that running
commands needs (tests/test_cli_startup.py holds `logs` to its imports).
"""

from __future__ import annotations

import os

from pbs_toolkit.transports.base import FileId, OpenFile


class LocalFiles:
    """The file half of the local transport: the `Runner` methods that read and write files on this machine."""

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(path, "rb") as fh:
            if offset:
                fh.seek(offset)
            return fh.read() if length is None else fh.read(length)

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def file_id(self, path: str) -> FileId | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return FileId(st.st_dev, st.st_ino, st.st_size)

    def open_file(self, path: str) -> OpenFile:
        return _LocalFile(path)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        import tempfile  # here: `pbstk logs -n` reads only, and tempfile brings shutil and the compressors

        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        os.makedirs(path, mode=mode, exist_ok=True)

    def home(self) -> str:
        return os.path.expanduser("~")


class _LocalFile(OpenFile):
    """A local file descriptor: reads follow the inode, identity is (device, inode) of the path vs the descriptor."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.key = (st.st_dev, st.st_ino)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def path_names_it(self) -> bool | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino) == self.key

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
