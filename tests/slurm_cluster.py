"""A real two-node Slurm cluster on loopback, started by the test suite (session scope).

``slurm_cluster`` writes a slurm.conf into a pytest temp dir, starts ``munged`` (own key, socket, pid and log),
``slurmctld`` and two ``slurmd`` (``-N n1`` / ``-N n2``, one port each) in the foreground as children of this
process, waits (bounded) until both nodes are idle, and at session end cancels every job and stops the daemons by
pid. Nothing is written under /etc, /run or /var; the ports are picked free at start, so two pytest sessions on
one host do not clash (a port taken between the pick and the bind: the start is tried again in ``root/retry1``).
Register it in ``conftest.py`` with ``from slurm_cluster import slurm_cluster``.

Why it looks the way it does (Debian 12, Slurm 22.05):

- munged runs as root and refuses a socket whose parent directories are not searchable by everyone ("execute
  permissions for all required"); pytest's ``/tmp/pytest-of-root`` is 0700, so the socket alone lives in a short
  ``/tmp/pbstk-munge-*`` directory (mode 0711), removed at the end. Its key, pid, seed and log stay in ``root``.
- Both nodes claim 4 CPUs whatever the host has (``SlurmdParameters=config_overrides``), so a 2-core machine can
  run a few jobs at once and nodes do not go INVAL for "Low CPUs".
- Fake GPUs: ``gres.conf`` with ``File=`` plain files (``Count=`` alone registers none); Slurm then sets
  ``SLURM_GPUS_ON_NODE`` but no ``CUDA_VISIBLE_DEVICES``.
- No accounting database: plain ``sacct`` says "accounting storage is disabled"; ``JobCompType=jobcomp/filetxt``
  makes ``sacct -c`` (``--completion``) read finished jobs from ``jobcomp.txt``. ``MinJobAge=600`` keeps finished
  jobs in ``squeue --states=all`` for ten minutes.
- Each node has its own loopback address (``NodeAddr`` 127.0.0.2, 127.0.0.3: ``node_addresses``), but ``hostname``
  inside a job is this machine's on both: a job tells its node by ``$SLURMD_NODENAME``.
- ``OverTimeLimit=0`` and ``KillWait=2``: a job is signalled at its time limit and killed two seconds later.
- A second partition ``urgent`` (higher ``PriorityTier``, ``PreemptMode=CANCEL``) preempts jobs of ``debug`` when
  it needs their nodes: the way to produce PREEMPTED. ``debug`` is the default partition.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: read at import: the isolated_user fixture removes PBSTK_* variables before any test runs. scripts/test.sh
#: sets it after installing the packages, so CI fails where Slurm is missing instead of skipping.
REQUIRE_SLURM = os.environ.get("PBSTK_TEST_REQUIRE_SLURM") == "1"
DAEMONS = {"munged": "/usr/sbin/munged", "mungekey": "/usr/sbin/mungekey",
           "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun", "sacct", "salloc")
PACKAGES = "slurmctld slurmd slurm-client munge"
STANDARD_PATH = "/usr/local/bin:/usr/bin:/bin"
NODES = ("n1", "n2")
#: each node's own loopback address (slurmd listens on all of them; slurmctld and srun reach node K here), as the
#: fake PBS nodes have: ``scontrol show node n2`` says ``NodeAddr=127.0.0.3``
NODE_ADDRESSES = {name: f"127.0.0.{2 + k}" for k, name in enumerate(NODES)}
GPUS_PER_NODE = 4
CPUS_PER_NODE = 4
#: job states after which nothing runs any more (squeue's long names)
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})


class SlurmStartError(RuntimeError):
    """A daemon did not come up; the message names it and shows the tail of its log."""


@dataclass
class SlurmCluster:
    """A running cluster: where its files are and what a client needs to reach it."""

    root: Path  # temp dir holding conf, state, spool, logs, munge key (the socket: see ``munge_socket``)
    conf: Path  # slurm.conf
    env: dict[str, str]  # SLURM_CONF and a PATH (bin dir of Slurm clients + standard dirs): merge into a subprocess env
    partition: str = "debug"
    nodes: list[str] = field(default_factory=lambda: list(NODES))
    gpus_per_node: int = GPUS_PER_NODE
    node_addresses: dict[str, str] = field(default_factory=lambda: dict(NODE_ADDRESSES))
    munge_socket: Path = Path()
    logs: dict[str, Path] = field(default_factory=dict)  # daemon name -> its log

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A client command (``run("squeue", "-h")``) with the cluster's environment; never raises on exit code."""
        return subprocess.run(  # noqa: S603 - argument list
            list(argv), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout,
            check=False,
        )

    def active_jobs(self) -> list[str]:
        """Ids of every job that is not finished yet (pending, running, completing...)."""
        out = self.run("squeue", "--noheader", "--states=all", "--format=%i %T").stdout
        return [line.split()[0] for line in out.splitlines()
                if len(line.split()) == 2 and line.split()[1] not in FINAL_STATES]

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job and wait (bounded) until none is pending, running or completing."""
        deadline = time.monotonic() + timeout
        while True:
            active = self.active_jobs()
            if not active:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still active {timeout} s after scancel: {active}\n{self.log_tails()}")
            self.run("scancel", *active)
            time.sleep(0.3)

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(_tail(name, path, lines) for name, path in self.logs.items())


def _tail(name: str, path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        text = [f"(no log: {exc})"]
    return f"--- {name} ({path}), last lines:\n" + "\n".join(text)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together while probing, so they differ)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def missing_packages() -> str | None:
    """Why this host cannot run the cluster (None when it can)."""
    absent = [path for path in DAEMONS.values() if not os.access(path, os.X_OK)]
    absent += [name for name in CLIENTS if shutil.which(name, path=STANDARD_PATH) is None]
    if absent:
        return f"Slurm/munge not installed (missing {', '.join(absent)}): apt-get install {PACKAGES}"
    return None


def slurm_conf(root: Path, socket_path: Path, ctld_port: int, node_ports: list[int]) -> str:
    user = getpass.getuser()
    lines = [
        "ClusterName=pbstktest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket_path}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=2",  # begin times and dependencies start promptly
        "PreemptType=preempt/partition_prio",
        "PreemptMode=CANCEL",
        "MpiDefault=none",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MinJobAge=600",
        "KillWait=2",
        "OverTimeLimit=0",
        "InactiveLimit=0",
        "SlurmdTimeout=30",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobcomp.txt'}",
        "GresTypes=gpu",
    ]
    for name, port in zip(NODES, node_ports, strict=True):
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr={NODE_ADDRESSES[name]} Port={port} "
                     f"CPUs={CPUS_PER_NODE} RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
    nodes = ",".join(NODES)
    lines += [
        f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
        f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=10",
        "",
    ]
    return "\n".join(lines)


class _Daemons:
    """The child processes of one cluster, stopped in reverse start order."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(  # noqa: S603 - argument list
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()


def cluster_processes(root: Path) -> list[int]:
    """Pids of every process started for the cluster under ``root``: daemons, slurmstepd and jobs all carry its
    ``SLURM_CONF`` in their environment (slurmstepd detaches from slurmd, so its pid is known to nobody here)."""
    marker = f"SLURM_CONF={root}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            pid = int(environ.parent.name)
            if pid != os.getpid() and any(v.startswith(marker) for v in environ.read_bytes().split(b"\0")):
                found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def _kill_leftovers(root: Path) -> None:
    """SIGKILL what outlived the daemons (jobs a failed cancel left running, their slurmstepd), by pid."""
    for pid in cluster_processes(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """``check()`` until true; raise SlurmStartError naming ``what`` with its log tail on death or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SlurmStartError(f"{what} exited with status {proc.returncode} while starting\n{_tail(what, log)}")
        try:
            if check():
                return
        except subprocess.TimeoutExpired:
            pass  # a client that hung counts as "not yet"; the deadline still holds
        time.sleep(0.2)
    raise SlurmStartError(f"{what} not ready after {timeout} s\n{_tail(what, log)}")


def _start(root: Path, munge_socket: Path, daemons: _Daemons, timeout: float) -> SlurmCluster:
    for sub in ("state", "munge", "bin", "gpu", *(f"spool-{n}" for n in NODES)):
        (root / sub).mkdir(mode=0o755, parents=True, exist_ok=True)
    for name in CLIENTS:
        link = root / "bin" / name
        if not link.exists():
            link.symlink_to(shutil.which(name, path=STANDARD_PATH) or name)
    for k in range(GPUS_PER_NODE):
        (root / "gpu" / f"nvidia{k}").touch()
    key = root / "munge" / "munge.key"
    subprocess.run([DAEMONS["mungekey"], "--create", "--keyfile", str(key)], check=True,  # noqa: S603
                   capture_output=True, timeout=30)

    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, munge_socket, ctld_port, node_ports))
    (root / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={root / 'gpu'}/nvidia[0-{GPUS_PER_NODE - 1}]\n")
    env = {"SLURM_CONF": str(conf), "PATH": f"{root / 'bin'}{os.pathsep}{STANDARD_PATH}"}
    daemon_env = {**os.environ, **env}
    logs = {"munged": root / "munge" / "munged.log", "slurmctld": root / "slurmctld.log",
            **{f"slurmd {n}": root / f"slurmd-{n}.log" for n in NODES}}
    cluster = SlurmCluster(root=root, conf=conf, env=env, munge_socket=munge_socket, logs=logs)

    proc = daemons.start("munged", [
        DAEMONS["munged"], "--foreground", "--num-threads=10", f"--socket={munge_socket}", f"--key-file={key}",
        f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={logs['munged']}",
        f"--seed-file={root / 'munge' / 'munged.seed'}",
    ], logs["munged"], daemon_env)
    _wait("munged", lambda: subprocess.run(  # noqa: S603
        ["munge", "--no-input", "--socket", str(munge_socket)], input=b"", capture_output=True, timeout=10,
        check=False).returncode == 0, proc, logs["munged"], timeout)

    # slurmctld logs to SlurmctldLogFile; its stdout/stderr (early errors) go to the same file
    proc = daemons.start("slurmctld", [DAEMONS["slurmctld"], "-D", "-f", str(conf)], logs["slurmctld"], daemon_env)
    _wait("slurmctld", lambda: "is UP" in cluster.run("scontrol", "ping", timeout=10).stdout,
          proc, logs["slurmctld"], timeout)
    node_procs = [daemons.start(f"slurmd {n}", [DAEMONS["slurmd"], "-D", "-N", n, "-f", str(conf)],
                                logs[f"slurmd {n}"], daemon_env) for n in NODES]

    def all_idle() -> bool:
        out = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %T", timeout=10).stdout
        states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
        return all(states.get(n) == "idle" for n in NODES)

    deadline = time.monotonic() + timeout
    while not all_idle():
        for n, node_proc in zip(NODES, node_procs, strict=True):
            if node_proc.poll() is not None:
                raise SlurmStartError(f"slurmd {n} exited with status {node_proc.returncode} while starting\n"
                                      f"{_tail(f'slurmd {n}', logs[f'slurmd {n}'])}")
        if time.monotonic() > deadline:
            out = cluster.run("sinfo", "--Node", "--long").stdout
            raise SlurmStartError(f"nodes {', '.join(NODES)} not idle after {timeout} s:\n{out}\n"
                                  f"{cluster.log_tails()}")
        time.sleep(0.3)
    return cluster


@contextlib.contextmanager
def start_slurm_cluster(root: Path, timeout: float = 60) -> Iterator[SlurmCluster]:
    """Start the cluster under ``root`` and stop it (jobs cancelled first) when the block ends."""
    reason = missing_packages()
    if reason:
        if REQUIRE_SLURM:
            pytest.fail(f"{reason}; PBSTK_TEST_REQUIRE_SLURM=1 forbids skipping")
        pytest.skip(reason)
    daemons = _Daemons()
    cluster: SlurmCluster | None = None
    socket_dir = Path(tempfile.mkdtemp(prefix="pbstk-munge-", dir="/tmp"))
    socket_dir.chmod(0o711)  # munged wants every parent of its socket searchable by all
    try:
        for attempt in range(2):  # a port picked free may be taken before the daemon binds it: once more then
            try:
                cluster = _start(root / f"retry{attempt}" if attempt else root, socket_dir / f"sock{attempt}",
                                 daemons, timeout)
                break
            except SlurmStartError as exc:
                daemons.stop()
                if attempt or "Address already in use" not in str(exc):
                    raise
        assert cluster is not None
        yield cluster
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.cancel_all()
        daemons.stop()
        _kill_leftovers(root)
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One real Slurm cluster (n1, n2; partition debug) for the whole session."""
    with start_slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
