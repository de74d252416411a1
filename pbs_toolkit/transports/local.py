"""``LocalRunner``: commands and files on this machine (the files through ``LocalFiles``, transports/local_files.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.base import Result, Runner, tcp_connect
from pbs_toolkit.transports.local_files import LocalFiles
from pbs_toolkit.transports.trace import log_command


class LocalRunner(LocalFiles, Runner):
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

    def open_connection(self, host: str, port: int, timeout: float = 5.0) -> Any:
        return tcp_connect(host, port, timeout)
