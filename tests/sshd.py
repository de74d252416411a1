"""A real OpenSSH server on 127.0.0.1 playing the login node in tests.

``start_sshd(tmp_path)`` is a context manager giving an :class:`SshdInfo`: the ``Host`` alias of a client
config written for it, its port, the user key, and a known_hosts file holding its host key. Commands on the
"login node" see this process's ``PATH`` (so fake ``qsub`` executables put on ``PATH`` are found) plus
``extra_env``, through ``environment=`` options in authorized_keys (``PermitUserEnvironment yes``).

The ``sshd_server`` fixture (session scope) shares one server across tests; import it from ``conftest.py``::

    from sshd import sshd_server  # noqa: F401
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
#: read at import: the isolated_user fixture removes PBSTK_* variables before any test runs. scripts/test.sh
#: sets it, so that CI fails where sshd is missing instead of passing with every SSH test skipped.
REQUIRE_SSHD = os.environ.get("PBSTK_TEST_REQUIRE_SSHD") == "1"
HOST_ALIAS = "pbstk-test"


@dataclass(frozen=True)
class SshdInfo:
    """Where the test sshd listens and the client-side files that reach it."""

    alias: str  # Host alias in ``ssh_config`` (use it as the runner's host)
    host: str  # 127.0.0.1
    port: int
    user: str
    user_key: Path  # private key accepted by the server
    ssh_config: Path  # client config with ``Host <alias>``
    known_hosts: Path  # holds the server's host key for ``[127.0.0.1]:port``
    host_public_key: str  # "ssh-ed25519 AAAA..." line of the server's host key
    log: Path  # sshd's own log (``-e``), handy when a test fails
    directory: Path


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(  # noqa: S603 - argument list
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _authorized_keys_line(public_key: str, env: dict[str, str]) -> str:
    options = []
    for key, value in env.items():
        escaped = f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"')
        options.append(f'environment="{escaped}"')
    return ",".join(options) + " " + public_key.strip() + "\n"


def _wait_for_banner(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                if sock.recv(4).startswith(b"SSH-"):
                    return True
        except OSError:
            time.sleep(0.05)
    return False


@contextmanager
def start_sshd(tmp_path: Path, extra_env: dict[str, str] | None = None,
               extra_config: list[str] | None = None) -> Iterator[SshdInfo]:
    """Run ``sshd -D`` on a free loopback port until the block ends; skips the test when sshd is missing.
    ``extra_config``: more ``sshd_config`` lines (e.g. ``MaxSessions 1``)."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        missing = f"{SSHD} or ssh-keygen is not installed (apt-get install openssh-server)"
        if REQUIRE_SSHD:
            pytest.fail(f"{missing}; PBSTK_TEST_REQUIRE_SSHD=1 forbids skipping")
        pytest.skip(missing)
    directory = tmp_path / "sshd"
    directory.mkdir(parents=True, exist_ok=True)
    host_key, user_key = directory / "host_ed25519", directory / "user_ed25519"
    _keygen(host_key, "pbstk-test-host")
    _keygen(user_key, "pbstk-test-user")
    user = getpass.getuser()
    # the login's home is one of the test's own (its shell's HOME, and where SFTP starts: `runner.home()`), so that
    # nothing pbstk writes on the "login node" (a router's run directory, booked GPUs) lands in the real home
    home = directory / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **(extra_env or {})}
    authorized = directory / "authorized_keys"
    authorized.write_text(_authorized_keys_line(user_key.with_suffix(".pub").read_text(), env))
    authorized.chmod(0o600)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
    sftp_server = "/usr/lib/openssh/sftp-server"
    log = directory / "sshd.log"

    proc: subprocess.Popen[bytes] | None = None
    port = 0
    for _attempt in range(3):  # the free port may be taken between probe and bind
        port = _free_port()
        config = directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    "ListenAddress 127.0.0.1",
                    f"Port {port}",
                    f"HostKey {host_key}",
                    f"AuthorizedKeysFile {authorized}",
                    f"PidFile {directory / 'sshd.pid'}",
                    "StrictModes no",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "PermitUserEnvironment yes",
                    "AllowTcpForwarding yes",
                    "LogLevel VERBOSE",
                    f"Subsystem sftp {sftp_server if os.path.exists(sftp_server) else 'internal-sftp'} -d {home}",
                    *(extra_config or []),
                    "",
                ]
            )
        )
        with open(log, "ab") as log_file:
            proc = subprocess.Popen(  # noqa: S603 - argument list
                [SSHD, "-D", "-e", "-f", str(config)], stdout=log_file, stderr=subprocess.STDOUT
            )
        if _wait_for_banner(port, proc):
            break
        proc.kill()
        proc.wait()
        proc = None
    if proc is None:
        raise RuntimeError(f"sshd did not start; its log:\n{log.read_text(errors='replace')}")

    try:
        host_public = host_key.with_suffix(".pub").read_text().split()
        host_public_key = f"{host_public[0]} {host_public[1]}"
        known_hosts = directory / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_public_key}\n")
        ssh_config = directory / "ssh_config"
        ssh_config.write_text(
            f"Host {HOST_ALIAS}\n"
            "    HostName 127.0.0.1\n"
            f"    Port {port}\n"
            f"    User {user}\n"
            f"    IdentityFile {user_key}\n"
            "    IdentitiesOnly yes\n"
        )
        yield SshdInfo(
            alias=HOST_ALIAS,
            host="127.0.0.1",
            port=port,
            user=user,
            user_key=user_key,
            ssh_config=ssh_config,
            known_hosts=known_hosts,
            host_public_key=host_public_key,
            log=log,
            directory=directory,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def sshd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdInfo]:
    """One sshd for the whole session (tests that need their own environment call ``start_sshd``)."""
    with start_sshd(tmp_path_factory.mktemp("sshd")) as info:
        yield info
