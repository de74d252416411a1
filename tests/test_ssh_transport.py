"""SSHRunner against a real sshd on 127.0.0.1 (see ``tests/sshd.py``)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sshd import SshdInfo, start_sshd

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.ssh import SSHRunner, build_remote_command, split_destination

pytestmark = pytest.mark.ssh

ARGV_ECHO = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def login_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdInfo]:
    with start_sshd(tmp_path_factory.mktemp("login"), {"PBSTK_SITE_MARK": "from authorized_keys"}) as info:
        yield info


@pytest.fixture
def runner(login_node: SshdInfo) -> Iterator[SSHRunner]:
    with SSHRunner(
        login_node.alias, config_path=login_node.ssh_config, known_hosts_path=login_node.known_hosts
    ) as ssh:
        assert isinstance(ssh, SSHRunner)
        yield ssh


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- commands -------------------------------------------------------------------------------------


def test_run_returns_rc_stdout_stderr(runner: SSHRunner) -> None:
    result = runner.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.rc, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok


def test_hostile_arguments_arrive_literally(runner: SSHRunner, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = [f"x; touch {marker}", "$(id)", "`id`", "a'b\"c", "", "*", "line\nbreak", "$HOME"]
    result = runner.run([*ARGV_ECHO, *hostile])
    assert result.rc == 0, result.stderr
    assert json.loads(result.stdout) == hostile
    assert not marker.exists()


def test_env_cwd_and_stdin(runner: SSHRunner, tmp_path: Path) -> None:
    workdir = tmp_path / "dir with space"
    workdir.mkdir()
    env = {"PBSTK_A": "it's $HOME; `id`", "PBSTK_B": "2"}
    script = "import os; print(os.getcwd()); print(os.environ['PBSTK_A']); print(os.environ['PBSTK_B'])"
    result = runner.run([sys.executable, "-c", script], env=env, cwd=str(workdir))
    assert result.stdout.splitlines() == [str(workdir), env["PBSTK_A"], "2"]
    assert runner.run(["cat"], stdin="fed through stdin\n").stdout == "fed through stdin\n"
    # variables from the authorized_keys line reach commands (the fixture's PATH relies on this)
    assert runner.run(["printenv", "PBSTK_SITE_MARK"]).stdout == "from authorized_keys\n"


def test_missing_command_gives_127(runner: SSHRunner) -> None:
    assert runner.run(["pbstk-no-such-command"]).rc == 127
    assert runner.run(["pbstk-no-such-command"], env={"X": "1"}).rc == 127


def test_large_output_on_both_streams(runner: SSHRunner) -> None:
    script = "head -c 3000000 /dev/zero | tr '\\0' a; head -c 2000000 /dev/zero | tr '\\0' b >&2"
    result = runner.run(["sh", "-c", script])
    assert (len(result.stdout), len(result.stderr)) == (3_000_000, 2_000_000)


def test_timeout_raises(runner: SSHRunner) -> None:
    with pytest.raises(TransportError, match="did not finish within"):
        runner.run(["sleep", "10"], timeout=0.5)
    assert runner.run(["true"]).ok  # the connection survives


def test_remote_command_line() -> None:
    line = build_remote_command(["qsub", "a b"], env={"K": "v w"}, cwd="/x y")
    assert line == "cd '/x y' && env 'K=v w' qsub 'a b'"
    assert shlex.split(line)[-1] == "a b"
    with pytest.raises(ValueError):
        build_remote_command(["true"], env={"BAD NAME": "1"})
    assert split_destination("me@login.example:2222") == ("me", "login.example", 2222)
    assert split_destination("polaris") == (None, "polaris", None)
    assert split_destination("[::1]:22") == (None, "::1", 22)


# -- files ----------------------------------------------------------------------------------------


def test_files(runner: SSHRunner, tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    runner.makedirs(str(target))
    runner.makedirs(str(target))  # exists: no error
    assert target.is_dir()

    path = str(target / "job.sh")
    runner.write_bytes(path, b"0123456789", mode=0o750)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
    runner.write_bytes(path, b"0123456789abcdef", mode=0o640)  # replaces atomically
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(os.listdir(target)) == ["job.sh"]  # no .tmp- file left behind

    assert runner.size(path) == 16
    assert runner.read_bytes(path) == b"0123456789abcdef"
    assert runner.read_bytes(path, offset=10) == b"abcdef"
    assert runner.read_bytes(path, offset=4, length=3) == b"456"
    assert runner.size(str(target / "missing")) is None
    with pytest.raises(FileNotFoundError):
        runner.read_bytes(str(target / "missing"))
    assert runner.home().endswith("/sshd/home")  # the test login's own (sshd.py), never the real home
    assert runner.expanduser("~/x") == runner.home() + "/x"
    assert runner.run(["sh", "-c", 'printf %s "$HOME"']).stdout == runner.home()


def test_one_connection_for_everything(runner: SSHRunner, tmp_path: Path, http_port: int) -> None:
    for i in range(5):
        assert runner.run(["echo", str(i)]).stdout == f"{i}\n"
        runner.write_bytes(str(tmp_path / f"f{i}"), b"x")
        assert runner.size(str(tmp_path / f"f{i}")) == 1
    runner.open_connection("127.0.0.1", http_port).close()
    assert runner.connections_opened == 1


# -- host keys, authentication, reachability ------------------------------------------------------


def test_unknown_host_key_is_refused_then_accepted_on_request(login_node: SshdInfo, tmp_path: Path) -> None:
    known_hosts = tmp_path / "ssh" / "known_hosts"
    with pytest.raises(TransportError, match=r"host key for \[127.0.0.1\]:\d+ is not known") as info:
        SSHRunner(login_node.alias, config_path=login_node.ssh_config, known_hosts_path=known_hosts).run(
            ["true"]
        )
    assert "--accept-new-host-key" in str(info.value) and str(known_hosts) in str(info.value)
    assert info.value.exit_code == 4

    accepting = SSHRunner(
        login_node.alias,
        config_path=login_node.ssh_config,
        known_hosts_path=known_hosts,
        accept_unknown_host=True,
    )
    assert accepting.run(["true"]).ok
    accepting.close()
    assert login_node.host_public_key in known_hosts.read_text()
    with SSHRunner(
        login_node.alias, config_path=login_node.ssh_config, known_hosts_path=known_hosts
    ) as again:
        assert again.run(["true"]).ok


def test_changed_host_key_is_refused(login_node: SshdInfo, tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)  # noqa: S603
    known_hosts = tmp_path / "known_hosts"
    fields = (tmp_path / "other.pub").read_text().split()
    known_hosts.write_text(f"[127.0.0.1]:{login_node.port} {fields[0]} {fields[1]}\n")
    runner = SSHRunner(
        login_node.alias,
        config_path=login_node.ssh_config,
        known_hosts_path=known_hosts,
        accept_unknown_host=True,
    )
    with pytest.raises(TransportError, match="CHANGED"):
        runner.run(["true"])


def test_wrong_key_fails_authentication(login_node: SshdInfo, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)  # noqa: S603
    config = tmp_path / "config"
    config.write_text(login_node.ssh_config.read_text().replace(str(login_node.user_key), str(wrong)))
    runner = SSHRunner(login_node.alias, config_path=config, known_hosts_path=login_node.known_hosts)
    with pytest.raises(TransportError, match="authentication to pbstk-test failed") as info:
        runner.run(["true"])
    assert str(wrong) in str(info.value)


def test_unreachable_port(login_node: SshdInfo, tmp_path: Path) -> None:
    port = _closed_port()
    runner = SSHRunner(
        f"{login_node.user}@127.0.0.1:{port}",
        config_path=tmp_path / "no-config",
        known_hosts_path=login_node.known_hosts,
    )
    with pytest.raises(TransportError, match=rf"cannot reach 127.0.0.1:{port}: connection refused"):
        runner.run(["true"])


def test_user_at_host_port_destination(login_node: SshdInfo, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(f"Host *\n    IdentityFile {login_node.user_key}\n    IdentitiesOnly yes\n")
    destination = f"{login_node.user}@127.0.0.1:{login_node.port}"
    with SSHRunner(destination, config_path=config, known_hosts_path=login_node.known_hosts) as runner:
        assert runner.run(["whoami"]).stdout.strip() == login_node.user


def test_proxy_command_and_proxy_jump(login_node: SshdInfo, tmp_path: Path) -> None:
    base = login_node.ssh_config.read_text()
    ssh_w = (
        f"ssh -F {login_node.ssh_config} -o BatchMode=yes -o UserKnownHostsFile={login_node.known_hosts} "
        f"-W %h:%p {login_node.alias}"
    )
    config = tmp_path / "config"
    config.write_text(
        base + f"\nHost via-command\n    HostName 127.0.0.1\n    Port {login_node.port}\n"
        f"    IdentityFile {login_node.user_key}\n    IdentitiesOnly yes\n    ProxyCommand {ssh_w}\n"
        + f"\nHost via-jump\n    HostName 127.0.0.1\n    Port {login_node.port}\n"
        f"    IdentityFile {login_node.user_key}\n    IdentitiesOnly yes\n    ProxyJump {login_node.alias}\n"
    )
    for alias in ("via-command", "via-jump"):
        runner = SSHRunner(alias, config_path=config, known_hosts_path=login_node.known_hosts)
        assert runner.run(["echo", alias]).stdout == f"{alias}\n"
        assert runner.connections_opened == 1
        runner.close()


# -- TCP through the login node -------------------------------------------------------------------


def test_http_get_through_open_connection(runner: SSHRunner, http_port: int) -> None:
    # the probe pbstk uses; the server answers HTTP/1.0 and closes, the case where a paramiko channel
    # closed by http.client after the headers lost the body (IncompleteRead) about half the time
    from pbs_toolkit.transports.http import http_request

    for _ in range(20):
        answer = http_request(runner, "127.0.0.1", http_port, "/v1/models", timeout=5)
        assert answer.status == 200
        assert answer.json() == {"path": "/v1/models"}


def test_refused_port_raises_connection_refused(runner: SSHRunner) -> None:
    with pytest.raises(ConnectionRefusedError):
        runner.open_connection("127.0.0.1", _closed_port())
    assert runner.run(["true"]).ok


def test_reconnects_once_after_a_drop(runner: SSHRunner, tmp_path: Path) -> None:
    assert runner.run(["true"]).ok
    assert runner._client is not None
    transport = runner._client.get_transport()
    assert transport is not None
    transport.close()  # the network drops under the runner
    assert runner.run(["echo", "back"]).stdout == "back\n"
    assert runner.connections_opened == 2
    runner._client.get_transport().close()  # type: ignore[union-attr]
    runner.write_bytes(str(tmp_path / "after-drop"), b"ok")  # SFTP reconnects too
    assert runner.read_bytes(str(tmp_path / "after-drop")) == b"ok"
    assert runner.connections_opened == 3


def test_reconnect_failure_is_a_transport_error(tmp_path: Path) -> None:
    with start_sshd(tmp_path) as own:
        runner = SSHRunner(own.alias, config_path=own.ssh_config, known_hosts_path=own.known_hosts)
        assert runner.run(["true"]).ok
    # the listening sshd is gone (open sessions live on in their own processes): drop ours too
    assert runner._client is not None
    runner._client.get_transport().close()  # type: ignore[union-attr]
    with pytest.raises(TransportError, match="cannot reach 127.0.0.1:.*connection refused"):
        runner.run(["true"])
    runner.close()


# -- MFA: keyboard-interactive after the key (OpenSSH without PAM cannot ask, so paramiko plays the server) --


class _MfaServer:
    """A login node that accepts the user key only as a first factor, then asks for a code."""

    def __init__(self, tmp_path: Path, user_public_key: Path) -> None:
        import paramiko

        class Interface(paramiko.ServerInterface):
            def __init__(self, owner: _MfaServer) -> None:
                self.owner = owner

            def get_allowed_auths(self, username: str) -> str:
                return "publickey,keyboard-interactive"

            def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
                if key.asbytes() == self.owner.user_blob:
                    return paramiko.common.AUTH_PARTIALLY_SUCCESSFUL
                return paramiko.common.AUTH_FAILED

            def check_auth_interactive(
                self, username: str, submethods: str
            ) -> paramiko.server.InteractiveQuery:
                return paramiko.server.InteractiveQuery(
                    "MFA", "Enter your code", ("Verification code: ", False)
                )

            def check_auth_interactive_response(self, responses: list[str]) -> int:
                ok = list(responses) == ["123456"]
                return paramiko.common.AUTH_SUCCESSFUL if ok else paramiko.common.AUTH_FAILED

            def check_channel_request(self, kind: str, chanid: int) -> int:
                return (
                    paramiko.common.OPEN_SUCCEEDED
                    if kind == "session"
                    else paramiko.common.OPEN_FAILED_UNKNOWN_CHANNEL_TYPE
                )

            def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
                threading.Thread(target=self.owner.reply, args=(channel, command), daemon=True).start()
                return True

        import base64
        import socket

        key_path = tmp_path / "mfa_host"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key_path)], check=True)  # noqa: S603
        self.host_key = paramiko.PKey.from_path(key_path)
        self.user_blob = base64.b64decode(user_public_key.read_text().split()[1])
        self.interface = Interface(self)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        self.channels: list[paramiko.Channel] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        import paramiko

        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(sock)
            transport.add_server_key(self.host_key)
            transport.start_server(server=self.interface)
            self.transports.append(transport)
            threading.Thread(target=self.accept_channels, args=(transport,), daemon=True).start()

    def accept_channels(self, transport: Any) -> None:
        while transport.is_active():
            channel = transport.accept(1)
            if channel is not None:
                self.channels.append(channel)  # a dropped Channel object closes itself

    def reply(self, channel: Any, command: bytes) -> None:
        time.sleep(0.05)
        channel.sendall(b"ran: " + command + b"\n")
        channel.send_exit_status(0)
        channel.close()

    def close(self) -> None:
        self.listener.close()
        for transport in self.transports:
            transport.close()


@pytest.fixture
def mfa_host(tmp_path: Path, login_node: SshdInfo) -> Iterator[tuple[str, Path, Path]]:
    server = _MfaServer(tmp_path, login_node.user_key.with_suffix(".pub"))
    fields = (tmp_path / "mfa_host.pub").read_text().split()
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{server.port} {fields[0]} {fields[1]}\n")
    config = tmp_path / "config"
    config.write_text(
        f"Host mfa\n    HostName 127.0.0.1\n    Port {server.port}\n    User {login_node.user}\n"
        f"    IdentityFile {login_node.user_key}\n    IdentitiesOnly yes\n"
    )
    yield "mfa", config, known_hosts
    server.close()


def test_keyboard_interactive_mfa_is_asked_once(mfa_host: tuple[str, Path, Path]) -> None:
    alias, config, known_hosts = mfa_host
    asked: list[tuple[str, bool]] = []

    def prompt(text: str, echo: bool) -> str:
        asked.append((text, echo))
        return "123456"

    runner = SSHRunner(alias, config_path=config, known_hosts_path=known_hosts, password_prompt=prompt)
    for _ in range(3):
        assert runner.run(["qstat", "-x"]).stdout == "ran: qstat -x\n"
    assert asked == [("MFA\nEnter your code\nVerification code: ", False)]
    assert runner.connections_opened == 1
    runner.close()

    wrong = SSHRunner(
        alias, config_path=config, known_hosts_path=known_hosts, password_prompt=lambda p, e: "0"
    )
    with pytest.raises(TransportError, match="authentication to mfa failed"):
        wrong.run(["true"])


def test_mfa_without_a_terminal_says_so(
    mfa_host: tuple[str, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    alias, config, known_hosts = mfa_host
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    with pytest.raises(TransportError, match="SSH host mfa needs interactive authentication"):
        SSHRunner(alias, config_path=config, known_hosts_path=known_hosts).run(["true"])
