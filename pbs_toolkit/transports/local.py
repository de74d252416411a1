"""``LocalRunner``: commands and files on this machine."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.base import FileId, OpenFile, Result, Runner, tcp_connect
from pbs_toolkit.transports.trace import log_command


class LocalRunner(Runner):
    name = "local"

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        timeout: float | None = 60.0,
        cwd: str | None = None,
    ) -> Result:
        log_command("run", argv, env=env, cwd=cwd, stdin=stdin)
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        try:
            proc = subprocess.run(  # noqa: S603 - argument list, no shell
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                env=full_env,
                timeout=timeout,
                cwd=cwd,
                stdin=None if stdin is not None else subprocess.DEVNULL,
                # Ctrl-C at the terminal must not kill a submission half-way: pbstk decides what to interrupt
                start_new_session=True,
            )
        except FileNotFoundError:
            return Result(127, "", f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired as exc:
            raise TransportError(f"{argv[0]} did not finish within {timeout:g} s") from exc
        except OSError as exc:
            raise TransportError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
        return Result(proc.returncode, proc.stdout, proc.stderr)

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

    def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
        return tcp_connect(host, port, timeout)


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
