"""The per-node launchers of a fake multi-node job: `mpiexec` (Cray PALS / MPICH shapes) and `pbsdsh` (OpenPBS).

Every "node" is this machine; a task runs with that node's identity: PBSTK_FAKE_HOSTNAME (the `hostname` shim in
nodebin/ answers with it) and PBSTK_NODE_ADDRESS (fakenodeK -> 127.0.0.(2+K)), as if it ran there. Both tools
start their tasks, wait for all, forward SIGTERM/SIGINT, and exit with the first non-zero task status. Like
PALS, mpiexec ends the other ranks when one fails; pbsdsh leaves them (each task is on its own).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

#: what a pbsdsh task gets from the MoM: the job's basics, not the caller's environment
TASK_ENV = ("HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG", "TMPDIR")


def address(host: str) -> str:
    m = re.fullmatch(r"fakenode(\d+)", host.split(".")[0])
    return f"127.0.0.{2 + int(m.group(1))}" if m else "127.0.0.1"


def identity(env: dict[str, str], host: str) -> dict[str, str]:
    return dict(env, PBSTK_FAKE_HOSTNAME=host, PBSTK_NODE_ADDRESS=address(host))


def run_tasks(tasks: list[tuple[list[str], dict[str, str]]], kill_others_on_failure: bool) -> int:
    procs = [subprocess.Popen(argv, env=env) for argv, env in tasks]  # noqa: S603

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    first = 0
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() not in (None, 0) and first == 0:
                first = p.returncode if p.returncode > 0 else 128 - p.returncode
                if kill_others_on_failure:
                    print(f"mpiexec: rank exited with code {first}; terminating the application", file=sys.stderr)
                    forward(signal.SIGTERM, None)
        time.sleep(0.1)
    for p in procs:
        if p.returncode != 0 and first == 0:
            first = p.returncode if p.returncode > 0 else 128 - p.returncode
    return first


def usage(tool: str, message: str) -> int:
    print(f"{tool}: {message}", file=sys.stderr)
    return 2


MPIEXEC_OPTS = {"-n": "n", "-np": "n", "--np": "n", "--ppn": "ppn", "-ppn": "ppn", "--ranks-per-node": "ppn",
                "--hostfile": "hostfile", "-hostfile": "hostfile", "-f": "hostfile", "-host": "host",
                "--host": "host", "--hosts": "host", "-hosts": "host", "--env": "env", "-env": "env"}


def mpiexec_options(argv: list[str]) -> tuple[dict[str, list[str]], list[str]] | str:
    """Options (each a list of values) and the command, or an error message."""
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":
            i += 1
            break
        key = MPIEXEC_OPTS.get(argv[i])
        if key is None:
            return f"unrecognized argument {argv[i]}"
        if i + 1 >= len(argv):
            return f"option {argv[i]} needs a value"
        opts.setdefault(key, []).append(argv[i + 1])
        i += 2
    return opts, argv[i:]


def mpiexec(argv: list[str]) -> int:
    parsed = mpiexec_options(argv)
    if isinstance(parsed, str):
        return usage("mpiexec", parsed)
    opts, command = parsed
    n, ppn, hosts = int(opts.get("n", ["0"])[-1]), int(opts.get("ppn", ["1"])[-1]), None
    extra_env = dict(v.partition("=")[::2] for v in opts.get("env", []))
    if "hostfile" in opts:
        with open(opts["hostfile"][-1]) as fh:
            hosts = [line.split()[0] for line in fh if line.strip()]
    if "host" in opts:
        hosts = opts["host"][-1].split(",")
    if not command:
        return usage("mpiexec", "no command given")
    if hosts is None:
        with open(os.environ["PBS_NODEFILE"]) as fh:
            hosts = list(dict.fromkeys(line.strip() for line in fh if line.strip()))
    n = n or len(hosts) * ppn
    if n > len(hosts) * ppn:
        return usage("mpiexec", f"{n} ranks do not fit {len(hosts)} hosts x {ppn} per node")
    tasks = []
    for rank in range(n):
        node = rank // ppn
        env = identity(dict(os.environ, **extra_env), hosts[node])
        env.update(PALS_RANKID=str(rank), PALS_NODEID=str(node), PMI_RANK=str(rank), PMI_SIZE=str(n))
        tasks.append((command, env))
    return run_tasks(tasks, kill_others_on_failure=True)


def pbsdsh(argv: list[str]) -> int:
    index = None
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        opt = argv[i]
        if opt == "--":
            i += 1
            break
        if opt in ("-o", "-s", "-v"):
            i += 1
        elif opt in ("-n", "-c"):
            if i + 1 >= len(argv):
                return usage("pbsdsh", f"option {opt} needs a value")
            if opt == "-n":
                index = int(argv[i + 1])
            i += 2
        else:
            return usage("pbsdsh", f"illegal option {opt}\n"
                                   "Usage: pbsdsh [-c copies][-o][-s][-v] [-n node_index] program [args]")
    command = argv[i:]
    if not command:
        return usage("pbsdsh", "no program given")
    with open(os.environ["PBS_NODEFILE"]) as fh:
        entries = [line.strip() for line in fh if line.strip()]
    if index is not None and not 0 <= index < len(entries):
        return usage("pbsdsh", f"node index {index} out of range (0..{len(entries) - 1})")
    base = {k: v for k, v in os.environ.items()
            if k in TASK_ENV or k.startswith(("PBS_", "FAKEPBS_", "PBSTK_TEST_"))}
    chosen = [entries[index]] if index is not None else entries
    return run_tasks([(command, identity(base, host)) for host in chosen], kill_others_on_failure=False)


def main() -> int:
    tool = os.path.basename(sys.argv[0])
    return mpiexec(sys.argv[1:]) if tool == "mpiexec" else pbsdsh(sys.argv[1:])
