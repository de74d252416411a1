"""One SSH exec channel's I/O: the remote shell line (every value quoted), stdin fed from a thread, stdout and
stderr drained together (no deadlock on large outputs). Used by ``SSHRunner`` and the connection holder."""

from __future__ import annotations

import re
import select
import shlex
import threading
import time
from collections.abc import Mapping, Sequence

import paramiko

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def build_remote_command(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
) -> str:
    """The shell line run on the login node: every value quoted; env set through ``env`` (no AcceptEnv)."""
    if not argv:
        raise ValueError("argv must not be empty")
    parts = []
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} && ")
    if env:
        for key in env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"invalid environment variable name: {key!r}")
        parts.append("env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " ")
    parts.append(shlex.join(argv))
    return "".join(parts)


def collect(channel: paramiko.Channel, stdin: str | None, timeout: float | None) -> tuple[int, bytes, bytes]:
    """Feed stdin and drain stdout and stderr together (no deadlock on large outputs); return rc and both."""
    feed_stdin(channel, stdin)
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = drain_channel(channel, deadline)
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not channel.status_event.wait(remaining):
        raise TimeoutError
    return channel.recv_exit_status(), out, err


def feed_stdin(channel: paramiko.Channel, stdin: str | None) -> None:
    """Send ``stdin`` from a thread (a command that writes before reading must not block us), then EOF."""
    if stdin is None:
        channel.shutdown_write()
        return
    data = stdin.encode()

    def feed() -> None:
        try:
            channel.sendall(data)
            channel.shutdown_write()
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True, name="pbstk-ssh-stdin").start()


def drain_channel(channel: paramiko.Channel, deadline: float | None) -> tuple[bytes, bytes]:
    """stdout and stderr until stdout's EOF (``TimeoutError`` past ``deadline``)."""
    out: list[bytes] = []
    err: list[bytes] = []
    stdout_open = True
    while stdout_open:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([channel], [], [], remaining)
        if not ready:
            raise TimeoutError
        while channel.recv_stderr_ready():
            err.append(channel.recv_stderr(65536))
        if channel.recv_ready() or channel.eof_received or channel.closed:
            chunk = channel.recv(65536)
            if chunk:
                out.append(chunk)
            elif not channel.recv_ready():
                stdout_open = False
    while True:  # EOF covers both streams: what is left of stderr is already buffered
        chunk = channel.recv_stderr(65536) if channel.recv_stderr_ready() else b""
        if not chunk:
            break
        err.append(chunk)
    return b"".join(out), b"".join(err)
