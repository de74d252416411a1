"""A fake OpenPBS (qsub/qstat/qdel) that runs jobs for real, for tests.

The executables in ``bin/`` are thin shims around :func:`main`. All state lives in
``$FAKEPBS_HOME`` (one JSON file per job); a detached runner process per job plays the part of
the scheduler and MoM. The aim is fidelity: the toolkit must be able to fail against this fake
exactly where it would fail against a real server. See README.md for knobs and fault injection.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import getopt
import getpass
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

PBS_VERSION = "23.06.06"
# PBS error numbers, as the client tools exit with them (mod 256).
RC_UNKNOWN_JOB = 153  # PBSE_UNKJOBID 15001
RC_HISTORY = 35  # PBSE_HISTJOBID 15139
RC_NO_SERVER = 255
JOB_EXEC_KILL_WALLTIME = -29
HELD_COMMENT = "job held, too many failed attempts to run"
QUEUED_COMMENT = "Not Running: Not enough free nodes available"
TIME_FMT = "%a %b %d %H:%M:%S %Y"
POLL = 0.05


class PbsError(Exception):
    """A client-visible error: message for stderr and the exit code."""

    def __init__(self, message: str, rc: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.rc = rc


# --------------------------------------------------------------------------- state on disk


def home() -> str:
    path = os.environ.get("FAKEPBS_HOME")
    if not path:
        raise PbsError("fakepbs: FAKEPBS_HOME is not set (it names the fake server's state directory)")
    os.makedirs(os.path.join(path, "jobs"), exist_ok=True)
    os.makedirs(os.path.join(path, "spool"), exist_ok=True)
    return path


def server_name() -> str:
    return os.environ.get("FAKEPBS_SERVER", "fakepbs")


def short_host() -> str:
    return socket.gethostname().split(".")[0]


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@contextlib.contextmanager
def locked(name: str = ".lock") -> Iterator[None]:
    with open(os.path.join(home(), name), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def job_path(seq: int) -> str:
    return os.path.join(home(), "jobs", f"{seq}.json")


def load_job(seq: int) -> dict[str, Any] | None:
    try:
        with open(job_path(seq)) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def update_job(seq: int, **changes: Any) -> dict[str, Any]:
    """Apply ``changes`` (top-level keys; ``attrs``/``internal`` merged) under the lock."""
    with locked():
        job = load_job(seq)
        assert job is not None
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(job.get(key), dict):
                job[key].update(value)
            else:
                job[key] = value
        job["internal"]["mtime"] = int(time.time())
        write_json(job_path(seq), job)
        return job


def all_seqs() -> list[int]:
    names = os.listdir(os.path.join(home(), "jobs"))
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def read_faults() -> dict[str, Any]:
    try:
        with open(os.path.join(home(), "faults.json")) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def take_fault_count(key: str) -> bool:
    """Decrement counter fault ``key`` atomically; True when one was consumed."""
    path = os.path.join(home(), "faults.json")
    with locked(".faults.lock"):
        faults = read_faults()
        count = int(faults.get(key) or 0)
        if count <= 0:
            return False
        faults[key] = count - 1
        write_json(path, faults)
        return True


def take_script_entry(key: str) -> dict[str, Any] | None:
    """Pop the first entry of list fault ``key`` atomically (one per call); None when the list is empty."""
    path = os.path.join(home(), "faults.json")
    with locked(".faults.lock"):
        faults = read_faults()
        script = faults.get(key)
        if not isinstance(script, list) or not script:
            return None
        entry = script.pop(0)
        write_json(path, faults)
    return entry if isinstance(entry, dict) else {}


def play_script_entry(entry: dict[str, Any]) -> int | None:
    """Act out one scripted answer: hang, die by a signal, or print canned output and return its rc.

    Returns None when the entry leaves the answer to the real tool (``{}``, or ``{"hang": S}`` alone).
    """
    if entry.get("hang"):
        time.sleep(float(entry["hang"]))
    if entry.get("signal"):
        sys.stdout.flush()
        os.kill(os.getpid(), int(entry["signal"]))
        time.sleep(5)  # a caught or ignored signal must not turn into an answer
    if not any(k in entry for k in ("rc", "stdout", "stderr")):
        return None
    sys.stdout.write(str(entry.get("stdout", "")))
    sys.stdout.flush()
    sys.stderr.write(str(entry.get("stderr", "")))
    return int(entry.get("rc", 0))


def log_call(tool: str, argv: list[str]) -> None:
    line = json.dumps({"tool": tool, "argv": argv, "time": round(time.time(), 3)}) + "\n"
    fd = os.open(os.path.join(home(), "calls.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def resolve_id(text: str) -> int | None:
    """Map a job id as a user types it (``12`` or ``12.server``) to its sequence number."""
    seq, _, server = text.partition(".")
    if not seq.isdigit() or (server and server != server_name()):
        return None
    return int(seq)


def full_id(seq: int) -> str:
    return f"{seq}.{server_name()}"


# --------------------------------------------------------------------------- qsub


def parse_walltime(text: str) -> int:
    """HH:MM:SS, MM:SS or plain seconds, as PBS accepts them; raises ValueError."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ValueError(text)
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds


def fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


QSUB_OPTS = "a:A:c:C:e:fhIj:J:k:l:m:M:N:o:p:P:q:r:S:u:v:VW:Xz"


def directive_args(script_text: str) -> list[str]:
    """Options from ``#PBS`` lines before the first command, in order."""
    args: list[str] = []
    for line in script_text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#PBS"):
            args += shlex.split(stripped[4:], comments=True)
        elif not stripped.startswith("#"):
            break
    return args


def merge_options(cmd: list[tuple[str, str]], directives: list[tuple[str, str]]) -> dict[str, Any]:
    """Fold options; command line wins. ``-l`` merges per resource, ``-v`` accumulates."""
    opts: dict[str, Any] = {"-l": {}, "-v": []}
    for source in (directives, cmd):  # later source overrides
        for flag, value in source:
            if flag == "-l":
                for item in value.split(","):
                    key, eq, val = item.partition("=")
                    if not eq or not key:
                        raise PbsError("qsub: illegal -l value")
                    opts["-l"][key] = val
            elif flag == "-v":
                opts["-v"].append(value)
            else:
                opts[flag] = value
    return opts


def parse_select(select: str) -> tuple[int, dict[str, str]]:
    first = select.split("+")[0]
    parts = first.split(":")
    nchunks = 1
    if parts and parts[0].isdigit():
        nchunks = int(parts.pop(0))
    chunk = {}
    for p in parts:
        k, _, v = p.partition("=")
        chunk[k] = v
    return nchunks, chunk


def qsub(argv: list[str]) -> int:
    faults = read_faults()
    try:
        cmd_opts, rest = getopt.getopt(argv, QSUB_OPTS)
    except getopt.GetoptError as err:
        raise PbsError(f"qsub: {err}\nusage: qsub [options] script", 2) from None
    if not rest or rest[0] == "-":
        raise PbsError("qsub: script from standard input is not allowed at this site")
    if len(rest) > 1 or rest[0] == "--":
        raise PbsError("qsub: executable (-- form) submissions are not supported by fakepbs")
    submit_dir = os.getcwd()
    script = os.path.join(submit_dir, rest[0])
    try:
        with open(script) as fh:
            script_text = fh.read()
    except OSError:
        raise PbsError(f"qsub: could not open script file: {rest[0]}") from None
    if "\r" in script_text:
        raise PbsError("qsub: script contains cr, lf")
    try:
        dir_opts, _ = getopt.getopt(directive_args(script_text), QSUB_OPTS)
    except getopt.GetoptError:
        raise PbsError("qsub: directive error: illegal option in #PBS line") from None
    opts = merge_options(cmd_opts, dir_opts)

    if faults.get("qsub_reject"):
        raise PbsError(str(faults["qsub_reject"]))
    if os.environ.get("FAKEPBS_REQUIRE_ACCOUNT") == "1" and not opts.get("-A"):
        raise PbsError("qsub: Account_Name is required to be set.")
    resources: dict[str, str] = opts["-l"]
    if os.environ.get("FAKEPBS_REQUIRE_FILESYSTEMS") == "1" and not resources.get("filesystems"):
        raise PbsError("qsub: Resource: filesystems is required to be set.")
    walltime_s: int | None = None
    if "walltime" in resources:
        try:
            walltime_s = parse_walltime(resources["walltime"])
        except ValueError:
            raise PbsError("qsub: illegal -l value") from None
        resources["walltime"] = fmt_duration(walltime_s)
    max_wall = os.environ.get("FAKEPBS_MAX_WALLTIME")
    if max_wall and walltime_s is not None and walltime_s > float(max_wall):
        raise PbsError("qsub: Job violates queue and/or server resource limits")
    queue = opts.get("-q") or os.environ.get("FAKEPBS_DEFAULT_QUEUE", "workq")
    allowed = [q for q in os.environ.get("FAKEPBS_QUEUES", "").split(",") if q]
    if allowed and queue not in allowed:
        raise PbsError("qsub: Unknown queue")
    keep = opts.get("-k", "n")
    if not re.fullmatch(r"n|d?[oe]{0,2}|[oe]{0,2}d?", keep) or keep == "d":
        raise PbsError("qsub: illegal -k value")
    join = opts.get("-j", "n")
    if join not in ("oe", "eo", "n"):
        raise PbsError("qsub: illegal -j value")
    rerun = opts.get("-r", "y")
    if rerun not in ("y", "n"):
        raise PbsError("qsub: illegal -r value")
    name = opts.get("-N") or os.path.basename(script)
    if not re.fullmatch(r"[A-Za-z0-9_+\-][^\s@:/]{0,235}", name):
        raise PbsError("qsub: illegal -N value")

    nchunks, chunk = parse_select(resources.get("select", "1"))
    if "select" in resources:
        resources.setdefault("place", "free")
        resources["nodect"] = str(nchunks)
        resources["ncpus"] = str(nchunks * int(chunk.get("ncpus", "1") or 1))
        if "ngpus" in chunk:
            resources["ngpus"] = str(nchunks * int(chunk["ngpus"] or 0))
    else:
        resources.setdefault("ncpus", "1")
        resources.setdefault("nodect", "1")

    env = dict(os.environ)
    host = socket.gethostname()
    user = env.get("USER") or env.get("LOGNAME") or getpass.getuser()
    var_list = {
        "PBS_O_HOME": env.get("HOME", ""),
        "PBS_O_LANG": env.get("LANG", ""),
        "PBS_O_LOGNAME": env.get("LOGNAME", user),
        "PBS_O_PATH": env.get("PATH", ""),
        "PBS_O_MAIL": env.get("MAIL", f"/var/mail/{user}"),
        "PBS_O_SHELL": env.get("SHELL", "/bin/bash"),
        "PBS_O_WORKDIR": submit_dir,
        "PBS_O_SYSTEM": os.uname().sysname,
        "PBS_O_QUEUE": queue,
        "PBS_O_HOST": host,
    }
    if "-V" in opts:
        var_list.update(env)
    for item in opts["-v"]:
        for pair in item.split(","):
            key, eq, val = pair.partition("=")
            if key:
                var_list[key] = val if eq else env.get(key, "")

    with locked():
        counter = os.path.join(home(), "seq")
        try:
            with open(counter) as fh:
                seq = int(fh.read().strip()) + 1
        except (FileNotFoundError, ValueError):
            seq = int(os.environ.get("FAKEPBS_SEQ_START", "1"))
        with open(counter, "w") as fh:
            fh.write(str(seq))
    jobid = full_id(seq)
    if faults.get("reject_after_submit"):
        print(jobid)  # a routing queue will drop it: never runs, never seen by qstat
        return 0

    def out_path(flag: str, suffix: str, ext: str) -> str:
        given = opts.get(flag)
        if not given:
            return os.path.join(submit_dir, f"{name}.{suffix}{seq}")
        given = given.split(":", 1)[1] if re.match(r"^[\w.\-]+:/", given) else given
        path = os.path.join(submit_dir, given)
        if given.endswith("/") or os.path.isdir(path):
            path = os.path.join(path, f"{jobid}.{ext}")
        return os.path.normpath(path)

    out_final, err_final = out_path("-o", "o", "OU"), out_path("-e", "e", "ER")
    now = int(time.time())
    attrs: dict[str, Any] = {
        "Job_Name": name,
        "Job_Owner": f"{user}@{host}",
        "job_state": "Q",
        "queue": queue,
        "server": server_name(),
        "Checkpoint": "u",
        "Error_Path": f"{host}:{err_final}",
        "Hold_Types": "n",
        "Join_Path": join,
        "Keep_Files": keep,
        "Mail_Points": opts.get("-m", "a"),
        "Output_Path": f"{host}:{out_final}",
        "Priority": 0,
        "Rerunable": "True" if rerun == "y" else "False",
        "Resource_List": resources,
        "substate": 10,
        "Variable_List": var_list,
        "comment": QUEUED_COMMENT,
        "euser": user,
        "Submit_arguments": " ".join(shlex.quote(a) for a in argv),
        "project": opts.get("-P", "_pbs_project_default"),
        "Submit_Host": host,
    }
    if opts.get("-A"):
        attrs["Account_Name"] = opts["-A"]
    if opts.get("-W"):
        attrs["depend_or_W"] = opts["-W"]  # recorded, not enforced
    internal = {
        "script_text": script_text,
        "submit_dir": submit_dir,
        "env": env,
        "v_vars": {k: v for k, v in var_list.items() if not k.startswith("PBS_O_")},
        "full_env": "-V" in opts,
        "out_final": out_final,
        "err_final": err_final,
        "walltime_s": walltime_s,
        "nchunks": nchunks,
        "chunk_ncpus": int(chunk.get("ncpus") or 64),
        "chunk_mpiprocs": int(chunk.get("mpiprocs") or 1),
        "ctime": now,
        "qtime": now,
        "mtime": now,
    }
    estimate = os.environ.get("FAKEPBS_ESTIMATED_START")
    if estimate:  # the scheduler calendared the job (strict ordering / backfill): it will say when it expects it
        internal["estimated_start"] = now + int(float(estimate))
    with locked():
        write_json(job_path(seq), {"id": jobid, "seq": seq, "attrs": attrs, "internal": internal})
    subprocess.Popen(  # noqa: S603 - the runner is this very file
        [sys.executable, os.path.abspath(__file__), "run", str(seq)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    if faults.get("slow_qsub"):  # a loaded server: the job exists before qsub prints its id
        time.sleep(float(faults["slow_qsub"]))
    print(jobid)
    return 0


# --------------------------------------------------------------------------- the runner (scheduler + MoM)


def is_vanished(job: dict[str, Any]) -> bool:
    return bool(job["internal"].get("vanished")) or job["id"] in (read_faults().get("vanish") or [])


NODEBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodebin")


def node_tools(env: dict[str, str], job_id: str) -> None:
    """A multi-node job runs on fakenode0 and finds the per-node launchers there (mpiexec, pbsdsh) plus a
    `hostname` that answers for the node. FAKEPBS_MISSING_TOOLS (comma list) leaves some out, like a site
    without them."""
    missing = set(filter(None, env.get("FAKEPBS_MISSING_TOOLS", "").split(",")))
    bindir = os.path.join(home(), "nodebin", job_id)
    os.makedirs(bindir, exist_ok=True)
    for tool in os.listdir(NODEBIN):
        if tool not in missing and not os.path.exists(os.path.join(bindir, tool)):
            os.symlink(os.path.join(NODEBIN, tool), os.path.join(bindir, tool))
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    env["PBSTK_FAKE_HOSTNAME"] = "fakenode0"


def job_env(job: dict[str, Any], tmpdir: str, nodefile: str) -> dict[str, str]:
    sub = job["internal"]["env"]
    attrs = job["attrs"]
    if job["internal"]["full_env"]:
        env = dict(sub)
    else:
        env = {k: sub[k] for k in ("HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG") if k in sub}
        # Test convenience (not PBS behaviour): let tests steer the fake and the toolkit's test hooks.
        env.update({k: v for k, v in sub.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))})
    env.update({k: v for k, v in attrs["Variable_List"].items() if k.startswith("PBS_O_")})
    env.update(job["internal"]["v_vars"])
    env.update(
        {
            "PBS_JOBID": job["id"],
            "PBS_JOBNAME": attrs["Job_Name"],
            "PBS_NODEFILE": nodefile,
            "PBS_QUEUE": attrs["queue"],
            "PBS_ENVIRONMENT": "PBS_BATCH",
            "PBS_JOBDIR": sub.get("HOME", "/"),
            "PBS_TASKNUM": "1",
            "PBS_NODENUM": "0",
            "TMPDIR": tmpdir,
            "ENVIRONMENT": "BATCH",
        }
    )
    return env


def stream_target(job: dict[str, Any], which: str) -> tuple[str, bool]:
    """Where the MoM writes stream ``which`` ('o'/'e') while running, and whether it is final."""
    internal, attrs, seq = job["internal"], job["attrs"], job["seq"]
    keep = attrs["Keep_Files"]
    final = internal["out_final"] if which == "o" else internal["err_final"]
    if which in keep and "d" in keep:
        return final, True
    if which in keep:  # kept in the home directory of the execution host
        home_dir = internal["env"].get("HOME", "/")
        return os.path.join(home_dir, f"{attrs['Job_Name']}.{which}{seq}"), True
    return os.path.join(home(), "spool", f"{job['id']}.{'OU' if which == 'o' else 'ER'}"), False


def sleep_while_queued(seq: int, seconds: float) -> bool:
    """Wait in state Q; False when the job was deleted or vanished meanwhile."""
    deadline = time.time() + seconds
    while True:
        job = load_job(seq)
        if job is None or job["attrs"]["job_state"] != "Q" or is_vanished(job):
            return False
        if time.time() >= deadline:
            return True
        time.sleep(min(POLL, max(0.0, deadline - time.time())))


def run_job(seq: int) -> None:
    job = load_job(seq)
    if job is None:
        return
    if not sleep_while_queued(seq, env_float("FAKEPBS_QUEUE_DELAY", 0.0)):
        return
    internal = job["internal"]
    for path in (internal["out_final"], internal["err_final"]):
        if not os.path.isdir(os.path.dirname(path)):
            if sleep_while_queued(seq, env_float("FAKEPBS_HOLD_DELAY", 0.5)):
                with locked():
                    job = load_job(seq)
                    if job and job["attrs"]["job_state"] == "Q":
                        job["attrs"].update(
                            job_state="H", comment=HELD_COMMENT, Hold_Types="s", substate=20, run_count=21
                        )
                        job["internal"]["mtime"] = int(time.time())
                        write_json(job_path(seq), job)
            return

    ncpus = internal["chunk_ncpus"]
    host = short_host()
    # several chunks: as many distinct hosts (fakenode0..N-1, each with its own loopback address, see nodebin/)
    hosts = [host] if internal["nchunks"] == 1 else [f"fakenode{i}" for i in range(internal["nchunks"])]
    start = time.time()
    with locked():
        job = load_job(seq)
        if job is None or job["attrs"]["job_state"] != "Q":
            return
        run_at = time.strftime("%a %b %d at %H:%M", time.localtime(start))
        job["attrs"].update(
            job_state="R",
            substate=42,
            exec_host="+".join(f"{h}/0*{ncpus}" for h in hosts) if len(hosts) > 1
            else "+".join(f"{host}/{i}*{ncpus}" for i in range(internal["nchunks"])),
            exec_vnode="+".join(f"({hosts[i % len(hosts)]}:ncpus={ncpus})" for i in range(internal["nchunks"])),
            comment=f"Job run at {run_at} on ({hosts[0]}:ncpus={ncpus})",
            run_count=1,
            session_id=0,
            resources_used={"cpupercent": 0, "cput": "00:00:00", "mem": "0kb", "ncpus": ncpus,
                            "vmem": "0kb", "walltime": "00:00:00"},
        )
        job["internal"].update(stime=int(start), mtime=int(start))
        write_json(job_path(seq), job)

    tmpdir = os.path.join(home(), "tmp", job["id"])
    os.makedirs(tmpdir, exist_ok=True)
    nodefile = os.path.join(home(), "aux", job["id"])
    os.makedirs(os.path.dirname(nodefile), exist_ok=True)
    with open(nodefile, "w") as fh:
        if len(hosts) > 1:  # one line per MPI process of each chunk, as PBS writes it
            fh.write("".join(f"{h}\n" * internal.get("chunk_mpiprocs", 1) for h in hosts))
        else:
            fh.write("".join(f"{host}\n" for _ in range(internal["nchunks"])))
    script = os.path.join(home(), "jobs", f"{seq}.SC")
    with open(script, "w") as fh:
        fh.write(internal["script_text"])

    out_path, out_in_place = stream_target(job, "o")
    err_path, err_in_place = stream_target(job, "e")
    join = job["attrs"]["Join_Path"]
    joined = join in ("oe", "eo")
    if join == "eo":  # both streams into the error file; no output file
        out_path, out_in_place, err_path, err_in_place = err_path, err_in_place, out_path, out_in_place
        internal["out_final"], internal["err_final"] = internal["err_final"], internal["out_final"]
    out_fh = open(out_path, "wb")  # noqa: SIM115 - closed after the job ends
    err_fh = out_fh if joined else open(err_path, "wb")  # noqa: SIM115
    env = job_env(job, tmpdir, nodefile)
    if len(hosts) > 1:
        node_tools(env, job["id"])
    cwd = env.get("HOME", "/")
    proc = subprocess.Popen(  # noqa: S603
        ["bash", script], cwd=cwd if os.path.isdir(cwd) else "/", env=env,
        stdin=subprocess.DEVNULL, stdout=out_fh, stderr=err_fh, start_new_session=True,
    )
    update_job(seq, attrs={"session_id": proc.pid})
    kill_delay = env_float("FAKEPBS_KILL_DELAY", 2.0)
    walltime_s = internal["walltime_s"]
    exit_override: int | None = None
    comment_tail = "and finished"
    term_sent_at: float | None = None
    last_usage = start

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    while proc.poll() is None:
        time.sleep(POLL)
        now = time.time()
        job = load_job(seq) or job
        if is_vanished(job):
            signal_group(signal.SIGKILL)
            proc.wait()
            update_job(seq, internal={"vanished": True})
            return
        if term_sent_at is None:
            if job["internal"].get("delete_requested"):
                signal_group(signal.SIGTERM)
                term_sent_at, comment_tail = now, "and terminated"
            elif walltime_s is not None and now - start > walltime_s:
                signal_group(signal.SIGTERM)
                term_sent_at = now
                exit_override = JOB_EXEC_KILL_WALLTIME
                comment_tail = f"job killed: walltime {int(now - start)} exceeded limit {walltime_s}"
        elif now - term_sent_at >= kill_delay:
            signal_group(signal.SIGKILL)
        if now - last_usage >= 1.0:
            last_usage = now
            update_job(seq, attrs={"resources_used": {"walltime": fmt_duration(now - start)}})
    signal_group(signal.SIGKILL)  # orphans of the job die with it, as under a real MoM
    rc = proc.returncode
    if exit_override is not None:
        exit_status = exit_override
    else:
        exit_status = 256 - rc if rc < 0 else rc  # killed by signal N -> 256 + N
    out_fh.close()
    if not joined:
        err_fh.close()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    end = time.time()
    job = update_job(
        seq,
        attrs={
            "job_state": "E",
            "substate": 51,
            "Exit_status": exit_status,
            "comment": comment_tail if comment_tail.startswith("job killed")
            else f"{job['attrs']['comment']} {comment_tail}",
            "resources_used": {
                "cput": fmt_duration(usage.ru_utime + usage.ru_stime),
                "mem": f"{usage.ru_maxrss}kb",
                "walltime": fmt_duration(end - start),
            },
        },
    )
    # Stage out spooled output only now, as the MoM does at job end (-j oe: no error file at all).
    streams = [(out_path, out_in_place, internal["out_final"])]
    if not joined:
        streams.append((err_path, err_in_place, internal["err_final"]))
    for path, written_in_place, dest in streams:
        if not written_in_place and os.path.exists(path):
            with contextlib.suppress(OSError):
                shutil.copyfile(path, dest)
                os.unlink(path)
    time.sleep(env_float("FAKEPBS_EXITING_DELAY", 0.5))
    now = int(time.time())
    update_job(seq, attrs={"job_state": "F", "substate": 92}, internal={"obittime": now, "endtime": now})
    shutil.rmtree(tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------- qstat


def pbs_time(epoch: int) -> str:
    return time.strftime(TIME_FMT, time.localtime(epoch))


def public_view(job: dict[str, Any]) -> dict[str, Any]:
    attrs = dict(job["attrs"])
    internal = job["internal"]
    attrs.pop("depend_or_W", None)
    for key in ("ctime", "qtime", "stime", "mtime", "obittime"):
        if internal.get(key):
            attrs[key] = pbs_time(internal[key])
    attrs["etime"] = attrs["qtime"]
    if attrs.get("job_state") == "Q" and internal.get("estimated_start"):
        # OpenPBS sets ``estimated`` on a queued job the scheduler has calendared: the vnodes and start time
        attrs["estimated"] = {"exec_vnode": f"({short_host()}:ncpus={internal.get('chunk_ncpus', 1)})",
                              "start_time": pbs_time(internal["estimated_start"])}
    return attrs


NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?")


class Raw(str):
    """A string OpenPBS prints without JSON escaping (see README: Variable_List quirk)."""


def pbs_json_value(value: Any, raw_strings: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: pbs_json_value(v, raw_strings) for k, v in value.items()}
    if isinstance(value, str):
        if NUMBER.fullmatch(value):  # OpenPBS prints numeric-looking strings as numbers
            return float(value) if "." in value else int(value)
        return Raw(value) if raw_strings else value
    return value


def dump_json(value: Any, indent: int = 0) -> str:
    pad = "    " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{pad}"{k}":{dump_json(v, indent + 1)}' for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "    " * indent + "}"
    if isinstance(value, Raw):
        return f'"{value}"'
    return json.dumps(value)


def qstat_json(found: dict[str, dict[str, Any]]) -> str:
    doc: dict[str, Any] = {
        "timestamp": int(time.time()),
        "pbs_version": PBS_VERSION,
        "pbs_server": server_name(),
    }
    if found:
        jobs = {}
        for jid, attrs in found.items():
            view = pbs_json_value({k: v for k, v in attrs.items() if k != "Variable_List"})
            # Values are not escaped: a -V environment with quotes or newlines breaks the JSON.
            view["Variable_List"] = pbs_json_value(attrs.get("Variable_List", {}), raw_strings=True)
            jobs[jid] = view
        doc["Jobs"] = jobs
    return dump_json(doc)


def qstat_full_text(jid: str, attrs: dict[str, Any]) -> str:
    lines = [f"Job Id: {jid}"]
    for key, value in attrs.items():
        if key == "Variable_List":
            lines.append(f"    {key} = " + ",".join(f"{k}={v}" for k, v in value.items()))
        elif isinstance(value, dict):
            lines += [f"    {key}.{k} = {v}" for k, v in value.items()]
        else:
            lines.append(f"    {key} = {value}")
    return "\n".join(lines) + "\n"


def qstat_table(found: dict[str, dict[str, Any]]) -> str:
    def cut(text: str, width: int) -> str:
        return text if len(text) <= width else text[: width - 1] + "*"

    lines = [
        "Job id            Name             User              Time Use S Queue",
        "----------------  ---------------- ----------------  -------- - -----",
    ]
    for jid, a in found.items():
        used = a.get("resources_used", {}).get("cput", "0")
        lines.append(
            f"{cut(jid, 16):<16}  {cut(a['Job_Name'], 16):<16} {cut(a['euser'], 16):<16}  "
            f"{used:>8} {a['job_state']} {cut(a['queue'], 16):<16}"
        )
    return "\n".join(lines) + "\n"


def qstat(argv: list[str]) -> int:
    faults = read_faults()
    if faults.get("slow_qstat"):
        time.sleep(float(faults["slow_qstat"]))
    entry = take_script_entry("qstat_script")
    if entry is not None:
        rc = play_script_entry(entry)
        if rc is not None:
            return rc
    if take_fault_count("qstat_unavailable"):
        raise PbsError(f"Connection refused\nqstat: cannot connect to server {server_name()} (errno=15010)",
                       RC_NO_SERVER)
    try:
        opts, ids = getopt.getopt(argv, "xfF:HTwu:1aisnGMJtp")
    except getopt.GetoptError as err:
        raise PbsError(f"qstat: {err}\nusage: qstat [-x] [-f] [-F json] [job_id ...]", 2) from None
    flags = dict(opts)
    history = "-x" in flags or "-H" in flags
    fmt = flags.get("-F")
    if fmt is not None and fmt not in ("json", "dsv"):
        raise PbsError("qstat: invalid -F value", 2)
    history_on = faults.get("history", True) is not False
    found: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    rc = 0

    def visible(job: dict[str, Any] | None) -> bool:
        if job is None or is_vanished(job):
            return False
        return history_on or job["attrs"]["job_state"] != "F"

    if ids:
        for text in ids:
            seq = resolve_id(text)
            job = load_job(seq) if seq is not None else None
            shown = text if seq is None else full_id(seq)
            if job is None or not visible(job):
                errors.append(f"qstat: Unknown Job Id {shown}")
                rc = RC_UNKNOWN_JOB
            elif job["attrs"]["job_state"] == "F" and not history:
                errors.append(
                    f"qstat: {shown} Job has finished, use -x or -H to obtain historical job information"
                )
                rc = RC_HISTORY
            else:
                found[job["id"]] = public_view(job)
    else:
        for number in all_seqs():
            listed = load_job(number)
            if listed is not None and visible(listed) and (history or listed["attrs"]["job_state"] != "F"):
                found[listed["id"]] = public_view(listed)
    if fmt == "json":
        sys.stdout.write(qstat_json(found) + "\n")
    elif "-f" in flags:
        sys.stdout.write("\n".join(qstat_full_text(j, a) for j, a in found.items()))
    elif found:
        sys.stdout.write(qstat_table(found))
    sys.stdout.flush()
    if errors:
        sys.stderr.write("\n".join(errors) + "\n")
    return rc


# --------------------------------------------------------------------------- qdel


QDEL_USAGE = "usage: qdel [-W force|suppress_email=X] [-x] job_identifier..."


def qdel(argv: list[str]) -> int:
    try:
        opts, ids = getopt.getopt(argv, "Wx:")
    except getopt.GetoptError as err:
        raise PbsError(f"qdel: {err}\n{QDEL_USAGE}", 2) from None
    if not ids:
        raise PbsError(QDEL_USAGE, 2)
    entry = take_script_entry("qdel_script")
    if entry is not None:
        scripted = play_script_entry(entry)
        if scripted is not None:
            return scripted
    rc = 0
    history_on = read_faults().get("history", True) is not False
    for text in ids:
        seq = resolve_id(text)
        shown = text if seq is None else full_id(seq)
        with locked():
            job = load_job(seq) if seq is not None else None
            state = job["attrs"]["job_state"] if job else None
            if seq is None or job is None or is_vanished(job) or (state == "F" and not history_on):
                sys.stderr.write(f"qdel: Unknown Job Id {shown}\n")
                rc = RC_UNKNOWN_JOB
                continue
            if state == "F":
                sys.stderr.write(f"qdel: Job has finished {shown}\n")
                rc = RC_HISTORY
                continue
            now = int(time.time())
            if state in ("Q", "H"):
                job["attrs"].update(job_state="F", substate=91, comment="Job deleted")
                job["internal"].update(mtime=now, obittime=now)
            else:  # R or E: the runner signals the session and records Exit_status
                job["internal"].update(delete_requested=True, mtime=now)
            write_json(job_path(seq), job)
    return rc


# --------------------------------------------------------------------------- entry point

TOOLS = {"qsub": qsub, "qstat": qstat, "qdel": qdel}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    tool = os.path.basename(argv[0])
    try:
        if tool == "fakepbs.py" and argv[1:2] == ["run"]:
            home()
            run_job(int(argv[2]))
            return 0
        if tool not in TOOLS:
            raise PbsError(f"fakepbs: unknown tool {tool!r}", 2)
        home()
        log_call(tool, argv[1:])
        return TOOLS[tool](argv[1:])
    except PbsError as err:
        sys.stdout.flush()
        sys.stderr.write(err.message + "\n")
        return err.rc


if __name__ == "__main__":
    sys.exit(main())
