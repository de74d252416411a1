"""One SSH login per working session: the connection holder, against a real sshd on loopback.

sshd here accepts public keys only (keyboard-interactive needs PAM, which a container's sshd does not have), so
logins are counted from sshd's own log (``LogLevel VERBOSE``: one "Accepted publickey" per authentication).
Every test stops the holders it started (fixture teardown) and waits for their processes to be gone.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import test_ssh_transport as transport_tests
from helpers import MODEL, launched_id, pbstk, until
from sshd import SshdInfo, start_sshd
from test_logs import Follower, _append

from pbs_toolkit.errors import ConfigError, TransportError
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.settings.config import resolve_settings
from pbs_toolkit.transports import ssh_mux
from pbs_toolkit.transports.ssh import SSHRunner

pytestmark = pytest.mark.ssh

PBS = ["--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto"]
login_node = transport_tests.login_node  # fixtures shared with the transport tests
http_port = transport_tests.http_port


def logins(info: SshdInfo) -> int:
    return info.log.read_text(errors="replace").count("Accepted publickey")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return status[0] != "Z"


def _holder_pids() -> list[int]:
    return [h.pid for h in ssh_mux.holders()]


@pytest.fixture
def sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private socket dir (pytest's tmp paths can exceed a Unix socket path's 108 bytes), holders on;
    at the end every holder in it is closed (SIGKILL if it does not go) and the dir removed."""
    directory = Path(tempfile.mkdtemp(prefix="pbstk-t-"))
    monkeypatch.setenv("PBSTK_SSH_SOCKET_DIR", str(directory))
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "120")
    pids: list[int] = []
    yield directory
    try:
        for holder in ssh_mux.holders():
            pids.append(holder.pid)
            ssh_mux.close_holder(holder)
        for pid in pids:
            until(lambda pid=pid: not _alive(pid), 10, f"holder {pid} to exit")  # type: ignore[misc]
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def login(fakepbs: Path, standins: Path, tmp_path: Path, sockets: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[SshdInfo]:
    """An sshd whose sessions find the fake PBS and the stand-ins; the client side points at it."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")  # jobs stay queued: status is one qstat per call
    passed = {k: v for k, v in os.environ.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))}
    with start_sshd(tmp_path / "login", passed) as info:
        monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
        monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
        yield info


def _launch(name: str, *extra: str) -> str:
    return launched_id(pbstk("launch", MODEL, "--ssh", "pbstk-test", "--name", name, *PBS, *extra))


def _ok(*args: str) -> str:
    result = pbstk(*args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.stdout


def test_twenty_commands_one_login(login: SshdInfo) -> None:
    job = _launch("held")
    run_dir = Path(JobStore().find(job).run_dir)  # the "login node" is this machine: write the log it would have
    (run_dir / "vllm.log").write_text("".join(f"INFO line {n}\n" for n in range(10)))
    for i in range(20):
        if i % 2:
            assert _ok("logs", job, "-n", "2").splitlines() == ["INFO line 8", "INFO line 9"]  # over SFTP
        else:
            assert json.loads(_ok("status", "--json"))[0]["state"] == "PENDING"
    assert logins(login) == 1  # launch and 20 commands: one authentication
    [holder] = list(ssh_mux.holders())
    assert holder.host == "pbstk-test" and holder.destination.endswith(f"@127.0.0.1:{login.port}")


def test_socket_is_private(login: SshdInfo, sockets: Path) -> None:
    _launch("private")
    [holder] = list(ssh_mux.holders())
    path = Path(holder.socket)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sockets).st_mode) == 0o700
    assert os.stat(path).st_uid == os.getuid()

    if os.getuid() != 0:
        pytest.skip("another uid can be tried only as root")
    # defence in depth: even with the directory and socket opened up, another user gets no answer
    os.chmod(sockets, 0o711)
    os.chmod(path, 0o666)
    assert _answer_as(65534, path) == b""  # connected, then closed without a word
    assert _ok("status", "--json")  # we still are served


def _answer_as(uid: int, path: Path) -> bytes:
    """What the holder at ``path`` answers an ``info`` request from a process running as ``uid`` (a forked
    child: it only connects, sends, reads and exits)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(5)
                sock.connect(str(path))
                try:
                    sock.sendall(b'{"op": "info"}\n')
                    answer = sock.recv(100)
                except (BrokenPipeError, ConnectionResetError):  # closed before or with our request unread
                    answer = b""
                os.write(write_fd, b"answer:" + answer)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write_fd, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    assert os.waitstatus_to_exitcode(status) == 0 and data.startswith(b"answer:"), data
    return data.removeprefix(b"answer:")


def test_idle_timeout_ends_the_holder(login: SshdInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "1")
    _launch("idle")
    [pid] = _holder_pids()
    # asking for its state (what `pbstk ssh status` does) every 0.05 s is no use: it still ends
    until(lambda: _holder_pids() == [], 10, "the idle holder to exit")
    until(lambda: not _alive(pid), 10, "the idle holder's process to end")
    assert _holder_pids() == [] and not list(Path(os.environ["PBSTK_SSH_SOCKET_DIR"]).glob("*.sock"))
    _ok("status")  # the next command logs in again
    assert logins(login) == 2


def test_ssh_status_and_close(login: SshdInfo) -> None:
    assert _ok("ssh", "status").strip() == "no SSH connection held"
    _launch("closing")
    # idle grows while we keep asking: the asking connection is not "use"
    [entry] = until(lambda: [e for e in json.loads(_ok("ssh", "status", "--json")) if e["idle"] >= 0.5], 10,
                    "the holder to report being idle")
    assert entry["host"] == "pbstk-test" and entry["persist"] == 120 and entry["active"] == 0
    assert set(entry) >= {"destination", "pid", "since", "idle", "socket"}
    assert "pbstk-test" in _ok("ssh", "status")

    result = pbstk("ssh", "close", "elsewhere")
    assert result.exit_code == 4 and result.stderr.startswith("pbstk: error: no SSH connection held for elsewhere")
    for both_or_neither in (("ssh", "close"), ("ssh", "close", "pbstk-test", "--all")):
        result = pbstk(*both_or_neither)
        assert result.exit_code == 2 and result.stderr.startswith("pbstk: error: pbstk ssh close: give a"), result
        assert len(result.stderr.splitlines()) == 1
    assert f"pid {entry['pid']}" in _ok("ssh", "close", "pbstk-test")
    until(lambda: not _alive(entry["pid"]), 10, "the closed holder to exit")
    assert json.loads(_ok("ssh", "status", "--json")) == []
    assert json.loads(_ok("ssh", "close", "--all", "--json")) == []


def test_killed_holder_means_one_more_login(login: SshdInfo) -> None:
    _launch("killed")
    [pid] = _holder_pids()
    os.kill(pid, signal.SIGKILL)
    until(lambda: not _alive(pid), 10, "the killed holder to be gone")
    result = pbstk("status", "--json")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "logging in to pbstk-test again" in result.stderr
    assert logins(login) == 2
    _ok("status")
    assert logins(login) == 2


def test_dropped_connection_means_one_more_login(login: SshdInfo) -> None:
    """sshd ends the held session (its per-connection process killed): the holder exits, the next command
    logs in again with a note, no traceback."""
    _launch("dropped")
    [pid] = _holder_pids()
    sessions = subprocess.run(["pgrep", "-f", f"sshd: {login.user}"], capture_output=True, text=True,  # noqa: S603,S607
                              check=False).stdout.split()
    mine = [int(p) for p in sessions if _parent_chain_has(int(p), _sshd_pid(login))]
    assert mine, "no sshd session process found"
    for session in mine:
        os.kill(session, signal.SIGTERM)
    until(lambda: not _alive(pid), 15, "the holder to notice the drop")
    result = pbstk("status", "--json")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "the held SSH connection is gone" in result.stderr and "logging in to pbstk-test again" in result.stderr
    assert logins(login) == 2


def test_parallel_statuses_share_one_login_within_max_sessions(fakepbs: Path, standins: Path, tmp_path: Path,
                                                               sockets: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """15 `pbstk status` at once through one held login: each holds an SFTP session and runs qstat, more than
    sshd's MaxSessions on one connection; the holder queues them instead of letting sshd refuse 5 of 15."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    passed = {k: v for k, v in os.environ.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))}
    with start_sshd(tmp_path / "sessions", passed, extra_config=["MaxSessions 4"]) as info:
        monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
        monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
        job = _launch("parallel")
        procs = [subprocess.Popen([sys.executable, "-m", "pbs_toolkit.cli.main", "status", job, "--json"],  # noqa: S603
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(15)]
        results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
        failed = [err for rc, _, err in results if rc != 0]
        assert not failed, failed[:2]
        assert all(json.loads(out)[0]["state"] == "PENDING" for _, out, _ in results)
        assert logins(info) == 1
        for holder in ssh_mux.holders():
            ssh_mux.close_holder(holder)


def _sshd_pid(info: SshdInfo) -> int:
    return int((info.directory / "sshd.pid").read_text().strip())


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    for _ in range(10):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def test_host_key_still_verified(login: SshdInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    known = tmp_path / "empty_known_hosts"
    known.write_text("")
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(known))
    result = pbstk("launch", MODEL, "--ssh", "pbstk-test", "--name", "stranger", *PBS)
    assert result.exit_code == 4, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not known" in lines[0] and "--accept-new-host-key" in lines[0], result.stderr
    assert known.read_text() == "" and _holder_pids() == []  # nothing held, nothing written

    _launch("stranger", "--accept-new-host-key")
    assert "[127.0.0.1]:" in known.read_text()
    assert len(_holder_pids()) == 1


def test_persist_zero_connects_per_command(login: SshdInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "0")
    _launch("direct")
    for _ in range(3):
        _ok("status")
    assert logins(login) == 4 and _holder_pids() == []


def test_tcp_through_the_holder(login: SshdInfo) -> None:
    """``open_connection`` (tunnels, /health) is a direct-tcpip channel relayed by the holder."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        runner = SSHRunner("pbstk-test")
        try:
            stream = runner.open_connection("127.0.0.1", port)
            conn, _ = server.accept()
            with conn, stream:
                stream.sendall(b"ping")
                stream.shutdown(socket.SHUT_WR)
                assert conn.recv(10) == b"ping" and conn.recv(10) == b""  # half-close passed on
                conn.sendall(b"pong")
                conn.shutdown(socket.SHUT_WR)
                assert stream.recv(10) == b"pong"
            with pytest.raises(ConnectionRefusedError):
                runner.open_connection("127.0.0.1", _closed_port())
            assert runner.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin="in\n").__dict__ == {
                "rc": 3, "stdout": "in\n", "stderr": "err\n"}
            runner.write_bytes(str(login.directory / "w.txt"), b"abc")
            assert runner.read_bytes(str(login.directory / "w.txt"), 1) == b"bc"
        finally:
            runner.close()
    assert logins(login) == 1


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_persist_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "soon")
    with pytest.raises(Exception, match="PBSTK_SSH_PERSIST: bad value 'soon'"):
        SSHRunner("somewhere").run(["true"])


# -- the Runner interface through a holder: the transport tests' checks, held ----------------------------------


@pytest.fixture
def held_runner(sshd_server: SshdInfo, sockets: Path) -> Iterator[SSHRunner]:
    with SSHRunner(sshd_server.alias, config_path=sshd_server.ssh_config,
                   known_hosts_path=sshd_server.known_hosts) as runner:
        assert isinstance(runner, SSHRunner)
        yield runner
        assert runner._client is None  # nothing went around the holder


@pytest.mark.parametrize("check", [
    transport_tests.test_run_returns_rc_stdout_stderr, transport_tests.test_hostile_arguments_arrive_literally,
    transport_tests.test_missing_command_gives_127, transport_tests.test_large_output_on_both_streams,
    transport_tests.test_timeout_raises, transport_tests.test_files,
    transport_tests.test_http_get_through_open_connection, transport_tests.test_refused_port_raises_connection_refused,
], ids=lambda check: check.__name__.removeprefix("test_"))
def test_runner_behaviour_through_the_holder(check: Callable[..., None], held_runner: SSHRunner, tmp_path: Path,
                                             http_port: int) -> None:
    available = {"runner": held_runner, "tmp_path": tmp_path, "http_port": http_port}
    check(**{name: available[name] for name in inspect.signature(check).parameters})
    assert len(_holder_pids()) == 1


def test_follow_through_the_holder_drains_a_rotated_file_and_survives_a_killed_holder(
        held_runner: SSHRunner, tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_bytes(b"old\n")
    f = Follower(held_runner, path)
    f.wait_for("old")
    _append(path, b"old 2, written just before the rotation\n")
    os.rename(path, tmp_path / "vllm.log.1")
    path.write_bytes(b"new file, first line, longer than the old one\nnew 2\n")
    f.wait_for("new 2")
    [pid] = _holder_pids()
    os.kill(pid, signal.SIGKILL)  # the held login is lost under the follower: one new login, same lines
    until(lambda: not _alive(pid), 10, "the killed holder to be gone")
    _append(path, b"after the kill\n")
    f.wait_for("after the kill", timeout=20)
    f.stop()
    assert f.error is None
    assert f.lines == ["old", "old 2, written just before the rotation",
                       "new file, first line, longer than the old one", "new 2", "after the kill"]


# -- keyboard-interactive MFA through a holder: asked once, on the terminal, then never again ------------------


def _run_in_pty(argv: list[str], env: dict[str, str], answer: str | None, timeout: float = 30.0) -> str:
    """Run ``argv`` on a new pseudo-terminal (its controlling tty); type ``answer`` at the first prompt."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
                if answer is not None and b"code: " in output:
                    os.write(fd, answer.encode() + b"\n")
                    answer = None
            elif os.waitpid(pid, os.WNOHANG)[0]:
                pid = 0
                break
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        os.close(fd)
    return output.decode(errors="replace").replace("\r\n", "\n")


def test_mfa_passcode_is_asked_once_for_many_commands(login_node: SshdInfo, tmp_path: Path,
                                                      sockets: Path) -> None:
    server = transport_tests._MfaServer(tmp_path, login_node.user_key.with_suffix(".pub"))
    try:
        fields = (tmp_path / "mfa_host.pub").read_text().split()
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{server.port} {fields[0]} {fields[1]}\n")
        config = tmp_path / "config"
        config.write_text(f"Host mfa\n    HostName 127.0.0.1\n    Port {server.port}\n    User {login_node.user}\n"
                          f"    IdentityFile {login_node.user_key}\n    IdentitiesOnly yes\n")
        env = {**os.environ, "PBSTK_SSH_CONFIG": str(config), "PBSTK_KNOWN_HOSTS": str(known_hosts),
               "PYTHONPATH": str(Path(__file__).parent.parent)}
        script = ("import sys; from pbs_toolkit.transports.ssh import SSHRunner;"
                  "print('OUT', SSHRunner('mfa').run(['qstat', '-x']).stdout.strip())")
        first = _run_in_pty([sys.executable, "-c", script], env, answer="123456")
        assert "Verification code: " in first and "OUT ran: qstat -x" in first, first
        for _ in range(5):  # no terminal now: a prompt would fail ("needs interactive authentication")
            out = subprocess.run([sys.executable, "-c", script], env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                                 capture_output=True, text=True, timeout=30, check=False)
            assert out.returncode == 0 and out.stdout.strip() == "OUT ran: qstat -x", out.stderr
        assert len(server.transports) == 1  # one connection, one passcode
    finally:
        for holder in ssh_mux.holders():
            ssh_mux.close_holder(holder)
        server.close()


def test_concurrent_first_commands_log_in_once(sshd_server: SshdInfo, sockets: Path) -> None:
    """Commands started together with no holder yet: one starts it (one login), the others wait and use it."""
    from concurrent.futures import ThreadPoolExecutor

    before = logins(sshd_server)
    runners = [SSHRunner(sshd_server.alias, config_path=sshd_server.ssh_config,
                         known_hosts_path=sshd_server.known_hosts) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(lambda r: r.run(["echo", "hi"]).stdout, runners))
    finally:
        for runner in runners:
            runner.close()
    assert outputs == ["hi\n"] * 4
    assert logins(sshd_server) - before == 1 and len(_holder_pids()) == 1


def test_too_many_sessions_on_the_held_connection_is_one_clear_error(tmp_path: Path, sockets: Path) -> None:
    """One connection carries every command's sessions; past sshd's MaxSessions the error says so."""
    with start_sshd(tmp_path / "one-session", extra_config=["MaxSessions 1"]) as info:
        with SSHRunner(info.alias, config_path=info.ssh_config, known_hosts_path=info.known_hosts) as runner:
            assert runner.size(str(info.log)) is not None  # its SFTP session stays open: the one allowed
            with pytest.raises(TransportError, match="MaxSessions"):
                runner.run(["true"])
            runner.close()  # the SFTP session ends: commands run again, on the same login

            def again() -> str | None:  # sshd frees the session slot a moment after the channel closes
                try:
                    return runner.run(["echo", "again"]).stdout
                except TransportError as exc:
                    assert "MaxSessions" in exc.message
                    return None

            assert until(again, 10, "sshd to free the SFTP session's slot") == "again\n"
        assert logins(info) == 1
        for holder in ssh_mux.holders():
            ssh_mux.close_holder(holder)


def test_persist_setting_order_and_checks(isolated_user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = isolated_user / "config" / "pbstk" / "config.yaml"
    config.parent.mkdir(parents=True)
    monkeypatch.delenv("PBSTK_SSH_PERSIST")
    assert ssh_mux.persist_seconds() == 8 * 3600  # a working day by default
    config.write_text("ssh_persist: 3600\n")
    assert ssh_mux.persist_seconds() == 3600
    assert "ssh_persist" not in resolve_settings({}).profile_overrides  # a known key, not a profile setting
    monkeypatch.setenv("PBSTK_SSH_PERSIST", "0")  # the variable wins; 0 = connect per command
    assert ssh_mux.persist_seconds() == 0
    monkeypatch.delenv("PBSTK_SSH_PERSIST")
    for bad in ("abc", "-5", "[1]", "true", ".nan"):
        config.write_text(f"ssh_persist: {bad}\n")
        with pytest.raises(ConfigError, match=r"config.yaml: key 'ssh_persist': bad value"):
            ssh_mux.persist_seconds()
