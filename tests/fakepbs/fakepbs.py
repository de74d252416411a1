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
import json
import os
import re
import resource
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

# qstat and qdel start hundreds of times a test run: what only qsub or a job's runner needs (subprocess, shutil,
# getpass) is imported where it is used

PBS_VERSION = "23.06.06"
# PBS error numbers, as the client tools exit with them (mod 256).
RC_UNKNOWN_JOB = 153  # PBSE_UNKJOBID 15001
RC_HISTORY = 35  # PBSE_HISTJOBID 15139
RC_BADSTATE = 15016 % 256  # PBSE_BADSTATE "Request invalid for state of job": qdel of a job already ending
RC_NO_SERVER = 255
JOB_EXEC_KILL_WALLTIME = -29
HELD_COMMENT = "job held, too many failed attempts to run"
QUEUED_COMMENT = "Not Running: Not enough free nodes available"
# OpenPBS scheduler, src/scheduler/job_info.cpp (QUEUE_USER_LIMIT_REACHED) with the "Not Running: " prefix
# (NOT_RUN_PREFIX): what a queue's per-user running-job limit (max_user_run) leaves on the jobs it holds back.
USER_LIMIT_COMMENT = "Not Running: User has reached queue {queue} running job limit."
# src/cmds/qsub_sup.c ``usage[]``: printed after every "qsub: illegal -X value" (exit 2), as qsub.c does
QSUB_USAGE = (
    "usage: qsub [-a date_time] [-A account_string] [-c interval]\n"
    "\t[-C directive_prefix] [-e path] [-f ] [-h ] [-I [-X]] [-j oe|eo] [-J X-Y[:Z]]\n"
    "\t[-k keep] [-l resource_list] [-m mail_options] [-M user_list]\n"
    "\t[-N jobname] [-o path] [-p priority] [-P project] [-q queue] [-r y|n]\n"
    "\t[-R o|e|oe] [-S path] [-u user_list] [-W otherattributes=value...]\n"
    "\t[-v variable_list] [-V ] [-z] [script | -- command [arg1 ...]]\n"
    "       qsub --version"
)
RC_BADATVAL = 15014 % 256  # PBSE_BADATVAL "Illegal attribute or resource value"
RC_MAX_ARRAY = 15107 % 256  # PBSE_MaxArraySize
# job substates (src/include/job.h) for the states this fake adds
SUBSTATE = {"Q": 10, "H": 22, "W": 30}  # H: JOB_SUBSTATE_DEPNHOLD, W: JOB_SUBSTATE_WAITING
DEPEND_TYPES = ("after", "afterok", "afternotok", "afterany")
TIME_FMT = "%a %b %d %H:%M:%S %Y"
POLL = 0.05
WAIT_POLL = 0.2  # while held, waiting for an -a time or a run slot: such jobs may wait minutes, on shared CPUs


class PbsError(Exception):
    """A client-visible error: message for stderr and the exit code."""

    def __init__(self, message: str, rc: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.rc = rc


# --------------------------------------------------------------------------- state on disk


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (field 6 of /proc/PID/stat); a zombie is gone."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and fields[3] == str(sid):
            found.append(int(entry))
    return found


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
    return os.uname().nodename.split(".")[0]  # socket.gethostname(), without importing socket


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


def job_path(seq: int | str) -> str:
    """``seq`` is a job's key: its sequence number, or ``N[i]`` for subjob i of array job N."""
    return os.path.join(home(), "jobs", f"{seq}.json")


def load_job(seq: int | str) -> dict[str, Any] | None:
    try:
        with open(job_path(seq)) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def update_job(seq: int | str, **changes: Any) -> dict[str, Any]:
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


_ID_RE = re.compile(r"(\d+)(\[(\d*)\])?(?:\.(.+))?")


def lookup(text: str) -> tuple[str | None, str, dict[str, Any] | None]:
    """A job id as a user types it -> (key, the full id to print, the job or None when unknown).

    Forms: ``12``, ``12.server``; an array job only as ``12[]`` (OpenPBS knows no ``12`` for it, and
    ``12[]`` of a plain job is unknown too); subjob i as ``12[i]``.
    """
    m = _ID_RE.fullmatch(text)
    if not m or (m.group(4) and m.group(4) != server_name()):
        return None, text, None
    seq, brackets, index = m.group(1), m.group(2), m.group(3)
    shown = f"{seq}{brackets or ''}.{server_name()}"
    key = f"{seq}[{index}]" if index else seq
    job = load_job(key)
    if job is not None and index is None and bool(brackets) != bool(job["internal"].get("array")):
        job = None
    return key, shown, job


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
    """Fold options; command line wins. ``-l`` merges per resource, ``-W`` per attribute, ``-v`` accumulates."""
    opts: dict[str, Any] = {"-l": {}, "-v": [], "-W": {}}
    for source in (directives, cmd):  # later source overrides
        for flag, value in source:
            if flag == "-W":
                # qsub.c: -W attr=value[,attr=value]; a value may hold commas (depend=afterok:1,after:2)
                for item in re.split(r",(?=\s*[A-Za-z_]+=)", value.strip()):
                    key, eq, val = item.partition("=")
                    if not eq or not key.strip() or not val:
                        raise PbsError("qsub: illegal -W value\n" + QSUB_USAGE, 2)
                    opts["-W"][key.strip()] = val
            elif flag == "-l":
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


def cvtdate(text: str, now: float | None = None) -> float:
    """``qsub -a [[[[CC]YY]MM]DD]hhmm[.SS]`` -> epoch seconds, in this host's local time.

    A port of OpenPBS src/lib/Libcmds/cvtdate.c: a time of day without a day that is not later than now means
    tomorrow, a day before today (no month given) means next month, a month before this one (no year given) means
    next year; a full date in the past is accepted (the job is eligible at once). ValueError where cvtdate returns
    -1 (qsub then says "illegal -a value").
    """
    date, dot, secs = text.partition(".")
    sec = 0
    if dot:
        if not re.fullmatch(r"[0-9]{2}", secs) or int(secs) > 59:
            raise ValueError(text)
        sec = int(secs)
    if not re.fullmatch(r"[0-9]+", date) or len(date) not in (4, 6, 8, 10, 12):
        raise ValueError(text)
    lt = time.localtime(now)
    year, mon, mday = lt.tm_year, lt.tm_mon, lt.tm_mday
    year_given = month_given = day_given = False
    if len(date) == 12:
        year, date, year_given = int(date[:4]), date[4:], True
    elif len(date) == 10:
        yy = int(date[:2])
        year, date, year_given = (1900 + yy if yy > 68 else 2000 + yy), date[2:], True
    if len(date) == 8:
        mon, date, month_given = int(date[:2]), date[2:], True
        if not 1 <= mon <= 12:
            raise ValueError(text)
        if not year_given and mon < lt.tm_mon:
            year += 1
    if len(date) == 6:
        mday, date, day_given = int(date[:2]), date[2:], True
        if not 1 <= mday <= 31:
            raise ValueError(text)
        if not month_given and mday < lt.tm_mday:
            mon += 1
    hour, minute = int(date[:2]), int(date[2:])
    if hour > 23 or minute > 59:
        raise ValueError(text)
    if not day_given and (hour, minute) <= (lt.tm_hour, lt.tm_min):
        mday += 1
    # mktime normalises a 13th month or a day past the month's end, as C's mktime does for cvtdate
    return time.mktime((year, mon, mday, hour, minute, sec, 0, 0, -1))


def parse_depend(value: str) -> list[tuple[str, str]]:
    """``type:id[:id...][,type:id...]`` -> [(type, id), ...]; a malformed list is qsub's own "illegal -W value"
    (client side, as for the empty id of openpbs PR #1769)."""
    deps: list[tuple[str, str]] = []
    for item in value.split(","):
        dtype, _, ids = item.strip().partition(":")
        if dtype in ("before", "beforeok", "beforenotok", "beforeany", "on", "runone"):
            raise PbsError(f"fakepbs: -W depend={dtype} is not modelled", 2)
        parts = ids.split(":")
        if dtype not in DEPEND_TYPES or not all(parts):
            raise PbsError("qsub: illegal -W value\n" + QSUB_USAGE, 2)
        deps += [(dtype, part) for part in parts]
    return deps


def parse_array(spec: str) -> list[int]:
    """``-J X-Y[:Z]`` -> the subjob indices. The server checks the range (src/lib/Libutil/range.c
    parse_subjob_index: X < Y, Z >= 1, else PBSE_BADATVAL) and the size (max_array_size, PBSE_MaxArraySize;
    this fake's limit is FAKEPBS_MAX_ARRAY_SIZE, default 100, as every subjob is a real process here)."""
    if "%" in spec:
        raise PbsError("fakepbs: -J X-Y%N (max_run_subjobs) is not modelled", 2)
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?", spec)
    start, end, step = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)) if m else (0, 0, 0)
    if not m or start >= end or step < 1:
        raise PbsError("qsub: Illegal attribute or resource value", RC_BADATVAL)
    indices = list(range(start, end + 1, step))
    if len(indices) > int(os.environ.get("FAKEPBS_MAX_ARRAY_SIZE", "100")):
        raise PbsError("qsub: Array job exceeds server or queue size limit", RC_MAX_ARRAY)
    return indices


def fmt_indices(indices: list[int], step: int) -> str:
    """Subjob indices as OpenPBS prints ranges (``1-4``, ``1-9:2``, ``1,3-4``); ``-`` for none."""
    if not indices:
        return "-"
    runs: list[list[int]] = [[indices[0]]]
    for i in indices[1:]:
        if i - runs[-1][-1] == step:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = []
    for run in runs:
        if len(run) == 1:
            parts.append(str(run[0]))
        else:
            parts.append(f"{run[0]}-{run[-1]}" + (f":{step}" if step != 1 else ""))
    return ",".join(parts)


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
    import getpass
    import subprocess

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
    # client-side checks of qsub.c (process_opts): message, the usage text, exit 2
    exec_at: float | None = None
    if "-a" in opts:
        try:
            exec_at = cvtdate(opts["-a"])
        except ValueError:
            raise PbsError("qsub: illegal -a value\n" + QSUB_USAGE, 2) from None
    depend = parse_depend(opts["-W"]["depend"]) if "depend" in opts["-W"] else []
    if "-J" in opts and opts.get("-r", "y") != "y":
        raise PbsError("qsub:  cannot submit non-rerunable Array Job\n" + QSUB_USAGE, 2)  # NO_RERUN_ARRAY, sic

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
    indices = parse_array(opts["-J"]) if "-J" in opts else None

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
    host = os.uname().nodename
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
    jobid = f"{seq}[].{server_name()}" if indices else full_id(seq)
    if faults.get("reject_after_submit"):
        print(jobid)  # a routing queue will drop it: never runs, never seen by qstat
        return 0

    def out_path(flag: str, suffix: str, ext: str, index: int | None = None) -> str:
        """Subjob i: ``name.o<seq>.<i>`` by default (OpenPBS), ``^array_index^`` replaced in a given path."""
        given = opts.get(flag)
        tail = "" if index is None else f".{index}"
        if not given:
            return os.path.join(submit_dir, f"{name}.{suffix}{seq}{tail}")
        given = given.split(":", 1)[1] if re.match(r"^[\w.\-]+:/", given) else given
        path = os.path.join(submit_dir, given.replace("^array_index^", "" if index is None else str(index)))
        if given.endswith("/") or os.path.isdir(path):
            sub_id = jobid if index is None else f"{seq}[{index}].{server_name()}"
            path = os.path.join(path, f"{sub_id}.{ext}")
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
    if depend:
        attrs["depend"] = fmt_depend(depend)
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
    if exec_at is not None:
        internal["exec_at"] = exec_at
    if depend:
        internal["depend"], internal["dep_rejected"] = register_depend(depend)
    first_state(attrs, internal, now)
    records = [{"id": jobid, "seq": seq, "key": str(seq), "attrs": attrs, "internal": internal}]
    if indices:
        step = indices[1] - indices[0] if len(indices) > 1 else 1
        attrs.update(array="True", array_indices_submitted=fmt_indices(indices, step))
        internal["array"] = {"indices": indices, "step": step}
        for index in indices:
            out_i, err_i = out_path("-o", "o", "OU", index), out_path("-e", "e", "ER", index)
            sub_attrs = json.loads(json.dumps(attrs))
            for key in ("array", "array_indices_submitted"):
                sub_attrs.pop(key)
            sub_attrs.update(array_id=jobid, array_index=index, Output_Path=f"{host}:{out_i}",
                             Error_Path=f"{host}:{err_i}")
            sub_internal = {**internal, "array": None, "array_index": index, "parent": str(seq),
                            "out_final": out_i, "err_final": err_i}
            records.append({"id": f"{seq}[{index}].{server_name()}", "seq": seq, "key": f"{seq}[{index}]",
                            "attrs": sub_attrs, "internal": sub_internal})
    with locked():
        for record in records:
            write_json(job_path(record["key"]), record)
    for record in records[1:] if indices else records:  # an array's parent has no runner: its subjobs run
        subprocess.Popen(  # noqa: S603 - the runner is this very file
            [sys.executable, os.path.abspath(__file__), "run", record["key"]],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    if faults.get("slow_qsub"):  # a loaded server: the job exists before qsub prints its id
        time.sleep(float(faults["slow_qsub"]))
    if faults.get("qsub_block_until"):  # the same, for as long as a test needs (an event, not a guessed delay)
        deadline = time.monotonic() + 120
        while not os.path.exists(faults["qsub_block_until"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    print(jobid)
    return 0


def fmt_depend(depend: list[tuple[str, str]]) -> str:
    """The ``depend`` attribute as qstat -f shows it: ``afterok:12.server@server:13.server@server,after:...``."""
    by_type: dict[str, list[str]] = {}
    for dtype, text in depend:
        _, shown, _ = lookup(text)
        by_type.setdefault(dtype, []).append(f"{shown}@{server_name()}")
    return ",".join(f"{dtype}:" + ":".join(ids) for dtype, ids in by_type.items())


def register_depend(depend: list[tuple[str, str]]) -> tuple[list[list[str]], bool]:
    """What the server registers for each dependency, and whether a registration was rejected.

    OpenPBS (src/server/req_register.c): the new job is queued first, then each parent is asked to register the
    dependency; an unknown parent (PBSE_UNKJOBID: never existed, or gone from history), a subjob as parent, or a
    finished parent whose end does not satisfy the type (PBSE_HISTDEPEND) makes post_doq() abort the new job:
    qsub has printed its id, and the job is finished without ever running (no Exit_status).
    """
    history_on = read_faults().get("history", True) is not False
    registered: list[list[str]] = []
    rejected = False
    for dtype, text in depend:
        key, _, job = lookup(text)
        gone = job is None or is_vanished(job) or (job["attrs"]["job_state"] == "F" and not history_on)
        if gone or key is None or job.get("key", "").endswith("]"):
            rejected = True
            continue
        registered.append([dtype, key])
        if depend_verdict(dtype, key) == "fail":
            rejected = True
    return registered, rejected


def first_state(attrs: dict[str, Any], internal: dict[str, Any], now: float) -> None:
    """State at submission: dependencies hold the job (H, system hold), a future -a time makes it wait (W); the
    scheduler has not looked at either, so they carry no comment yet (OpenPBS sets none on them)."""
    if internal.get("depend") or internal.get("dep_rejected"):
        attrs.update(job_state="H", substate=SUBSTATE["H"], Hold_Types="s")
        attrs.pop("comment", None)
    elif internal.get("exec_at", 0) > now:
        attrs.update(job_state="W", substate=SUBSTATE["W"])
        attrs.pop("comment", None)
    else:
        internal["etime"] = int(now)  # eligible at once: ``etime`` is its queue time


def released(job: dict[str, Any], previous: str) -> None:
    """A held or waiting job becomes eligible (OpenPBS: job_wait_over, depend release): ``etime`` is now, an
    ``after:`` dependency met leaves no ``depend`` attribute, and leaving W clears ``Execution_Time``."""
    job["internal"]["etime"] = int(time.time())
    job["attrs"].pop("depend", None)
    if previous == "W":
        job["internal"]["exec_cleared"] = True


# --------------------------------------------------------------------------- the runner (scheduler + MoM)


def is_vanished(job: dict[str, Any]) -> bool:
    return bool(job["internal"].get("vanished")) or job["id"] in (read_faults().get("vanish") or [])


NODEBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodebin")


def node_tools(env: dict[str, str], job_id: str, host: str = "fakenode0") -> None:
    """A job of several chunks runs on its first host (fakenode0, or this one where they share it) and finds
    the per-node launchers there (mpiexec, pbsdsh) plus a `hostname` that answers for the node.
    FAKEPBS_MISSING_TOOLS (comma list) leaves some out, like a site without them."""
    missing = set(filter(None, env.get("FAKEPBS_MISSING_TOOLS", "").split(",")))
    bindir = os.path.join(home(), "nodebin", job_id)
    os.makedirs(bindir, exist_ok=True)
    for tool in os.listdir(NODEBIN):
        if tool not in missing and not os.path.exists(os.path.join(bindir, tool)):
            os.symlink(os.path.join(NODEBIN, tool), os.path.join(bindir, tool))
    # missing means missing: also where this machine has the tool (a real OpenPBS's /opt/pbs/bin/mpiexec)
    path = [d for d in env.get("PATH", "").split(":")
            if d and not any(os.path.exists(os.path.join(d, tool)) for tool in missing)]
    env["PATH"] = ":".join([bindir, *path])
    env["PBSTK_FAKE_HOSTNAME"] = host


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
    if job["internal"].get("array_index") is not None:  # src/resmom/start_exec.c: the subjob's index, parent id
        env["PBS_ARRAY_INDEX"] = str(job["internal"]["array_index"])
        env["PBS_ARRAY_ID"] = attrs["array_id"]
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
    if internal.get("array_index") is not None:
        seq = f"{seq}.{internal['array_index']}"
    keep = attrs["Keep_Files"]
    final = internal["out_final"] if which == "o" else internal["err_final"]
    if which in keep and "d" in keep:
        return final, True
    if which in keep:  # kept in the home directory of the execution host
        home_dir = internal["env"].get("HOME", "/")
        return os.path.join(home_dir, f"{attrs['Job_Name']}.{which}{seq}"), True
    return os.path.join(home(), "spool", f"{job['id']}.{'OU' if which == 'o' else 'ER'}"), False


def job_summary(job: dict[str, Any] | None) -> tuple[bool, bool, int | None]:
    """(has started, has ended, Exit_status) of a job or of an array job (all its subjobs)."""
    if job is None:
        return False, True, None
    if job["internal"].get("array"):
        subs = [load_job(f"{job['seq']}[{i}]") for i in job["internal"]["array"]["indices"]]
        ended = all(sub is None or sub["attrs"]["job_state"] == "X" for sub in subs)
        started = any(sub is not None and sub["internal"].get("stime") for sub in subs)
        return started, ended, array_exit_status(subs) if ended else None
    state = job["attrs"]["job_state"]
    return bool(job["internal"].get("stime")), state in ("F", "X"), job["attrs"].get("Exit_status")


def array_exit_status(subs: list[dict[str, Any] | None]) -> int | None:
    """An array job's Exit_status, as OpenPBS's src/server/array_func.c sets it each time a subjob ends: from that
    subjob alone (the last one to end wins): 0 if it exited 0, 1 above 0 (a qdel'd one: 271), 2 below 0 (walltime,
    other PBS codes). None while no subjob has an Exit_status (all deleted before they ran)."""
    ended = [sub for sub in subs if sub is not None and sub["attrs"].get("Exit_status") is not None]
    if not ended:
        return None
    last = max(ended, key=lambda sub: (sub["internal"].get("obittime") or 0, sub["internal"].get("mtime") or 0))
    code = int(last["attrs"]["Exit_status"])
    return 1 if code > 0 else (2 if code < 0 else 0)


def depend_verdict(dtype: str, parent_key: str) -> str:
    """``ok``, ``wait`` or ``fail`` for one dependency (OpenPBS: ``after`` is released when the parent starts;
    afterok/afternotok/afterany when it ends, by its exit status; a dependency that can no longer be met
    deletes the dependent job, "Job deleted as result of dependency on job X" in the server log)."""
    started, ended, code = job_summary(load_job(parent_key))
    if dtype == "after":
        return "ok" if started else ("fail" if ended else "wait")
    if not ended:
        return "wait"
    if dtype == "afterany":
        return "ok"
    good = code == 0 and started
    return "ok" if good == (dtype == "afterok") else "fail"


def wait_eligible(seq: str) -> bool:
    """Hold the job (H) while a dependency waits, then (W) until its -a time, then make it Q.
    False when it ended meanwhile (qdel, vanished, or a dependency that can no longer be met)."""
    while True:
        with locked():
            job = load_job(seq)
            if job is None or is_vanished(job) or job["attrs"]["job_state"] not in ("Q", "W", "H"):
                return False
            verdicts = [depend_verdict(dtype, parent) for dtype, parent in job["internal"].get("depend") or []]
            if job["internal"].get("dep_rejected") or "fail" in verdicts:
                now = int(time.time())
                job["attrs"].update(job_state="X" if job["internal"].get("array_index") is not None else "F",
                                    substate=91, Hold_Types="n")
                job["attrs"].pop("comment", None)
                job["internal"].update(mtime=now, obittime=now)
                write_json(job_path(seq), job)
                return False
            if "wait" in verdicts:
                state = "H"
            elif job["internal"].get("exec_at", 0) > time.time():
                state = "W"
            else:
                state = "Q"
            if job["attrs"]["job_state"] != state:
                if state == "Q":
                    released(job, job["attrs"]["job_state"])
                job["attrs"].update(job_state=state, substate=SUBSTATE[state], Hold_Types="s" if state == "H" else "n")
                if state == "Q":
                    job["attrs"]["comment"] = QUEUED_COMMENT
                job["internal"]["mtime"] = int(time.time())
                write_json(job_path(seq), job)
        if state == "Q":
            return True
        time.sleep(WAIT_POLL)


def scattered(place: object) -> bool:
    """``-l place=scatter`` or ``vscatter`` (with or without ``:excl``...): one host per chunk."""
    return any(part in ("scatter", "vscatter") for part in str(place or "free").split(":"))


def running_jobs_of(user: str) -> int:
    """Jobs and subjobs of ``user`` that hold a run slot (R or E); an array's parent is not one."""
    count = 0
    for name in os.listdir(os.path.join(home(), "jobs")):
        if name.endswith(".json"):
            other = load_job(name[:-5])
            if other and other["attrs"].get("euser") == user and other["attrs"]["job_state"] in ("R", "E"):
                count += 1
    return count


def over_run_limit(job: dict[str, Any]) -> bool:
    """FAKEPBS_MAX_RUN_PER_USER=N plays a queue's ``max_user_run``: the scheduler leaves extra jobs queued with
    OpenPBS's comment (call under the lock)."""
    limit = os.environ.get("FAKEPBS_MAX_RUN_PER_USER")
    if not limit or running_jobs_of(job["attrs"]["euser"]) < int(limit):
        return False
    comment = USER_LIMIT_COMMENT.format(queue=job["attrs"]["queue"])
    if job["attrs"].get("comment") != comment:
        job["attrs"]["comment"] = comment
        write_json(job_path(job["key"]), job)
    return True


def sleep_while_queued(seq: int | str, seconds: float) -> bool:
    """Wait in state Q; False when the job was deleted or vanished meanwhile."""
    deadline = time.time() + seconds
    while True:
        job = load_job(seq)
        if job is None or job["attrs"]["job_state"] != "Q" or is_vanished(job):
            return False
        if time.time() >= deadline:
            return True
        time.sleep(min(POLL, max(0.0, deadline - time.time())))


def queued_until_released(seq: int | str, path: str) -> bool:
    """``FAKEPBS_RELEASE=PATH``: stay in Q until PATH exists, so a test looks at a queued job and then lets it run
    (an event; a queue delay is a race against a loaded machine). False when the job was deleted meanwhile."""
    while path and not os.path.exists(path):
        job = load_job(seq)
        if job is None or job["attrs"]["job_state"] != "Q" or is_vanished(job):
            return False
        time.sleep(POLL)
    return True


def run_job(key: str) -> None:
    import shutil
    import subprocess

    seq = key
    job = load_job(seq)
    if job is None or not wait_eligible(seq):
        return
    if not sleep_while_queued(seq, env_float("FAKEPBS_QUEUE_DELAY", 0.0)):
        return
    if not queued_until_released(seq, os.environ.get("FAKEPBS_RELEASE", "")):
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
    # several chunks with place=scatter: as many distinct hosts (fakenode0..N-1, each with its own loopback
    # address, see nodebin/); with PBS's default place=free (or pack) they share this host, as a real
    # scheduler packs chunks that fit on one node
    scatter = internal["nchunks"] > 1 and scattered(job["attrs"]["Resource_List"].get("place"))
    hosts = [f"fakenode{i}" for i in range(internal["nchunks"])] if scatter else [host]
    while True:
        with locked():
            job = load_job(seq)
            if job is None or job["attrs"]["job_state"] != "Q" or is_vanished(job):
                return
            if not over_run_limit(job):
                break
        time.sleep(WAIT_POLL)
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
            resources_used={"cpupercent": 0, "cput": "00:00:00", "mem": "0kb", "ncpus": ncpus * internal["nchunks"],
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
    if env.get("PBSTK_TEST_GPU_DIR"):  # the stand-in GPUs: each job's nodes are its own, as where jobs take whole
        env["PBSTK_TEST_GPU_NODE"] = job["id"]  # nodes (tests/standins/gpus.py): no two jobs share a GPU
    if internal["nchunks"] > 1:  # pbsdsh and mpiexec are there however the chunks were placed
        node_tools(env, job["id"], hosts[0])
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
        """The MoM signals every process of the job's session (OpenPBS kill_session), not one process group: a
        process the job put in a group of its own (a vLLM the start script started so) is reached too."""
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

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
            used = {**job["attrs"]["resources_used"], "walltime": fmt_duration(now - start)}  # the MoM's report
            update_job(seq, attrs={"resources_used": used})
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
            "resources_used": {  # the MoM's last report: every key of the running job's, final values
                **job["attrs"].get("resources_used", {}),
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
    final = "X" if internal.get("array_index") is not None else "F"  # an ended subjob is X (expired)
    update_job(seq, attrs={"job_state": final, "substate": 92}, internal={"obittime": now, "endtime": now})
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
    if internal.get("etime"):  # set when the job became eligible: none while it is held or waits for its -a time
        attrs["etime"] = pbs_time(internal["etime"])
    if internal.get("exec_at") and not internal.get("exec_cleared"):
        # qsub -a: ATTR_a "Execution_Time", a ctime string (src/cmds/qstat.c, as stime), gone once the time came
        attrs["Execution_Time"] = pbs_time(int(internal["exec_at"]))
    if internal.get("array"):
        array_view(job, attrs)
    if attrs.get("job_state") == "Q" and internal.get("estimated_start"):
        # OpenPBS sets ``estimated`` on a queued job the scheduler has calendared: the vnodes and start time
        attrs["estimated"] = {"exec_vnode": f"({short_host()}:ncpus={internal.get('chunk_ncpus', 1)})",
                              "start_time": pbs_time(internal["estimated_start"])}
    return attrs


def array_view(job: dict[str, Any], attrs: dict[str, Any]) -> None:
    """An array job's own attributes follow its subjobs: Q/W/H as they are, ``B`` (begun) once one has started,
    ``F`` when all have ended (X); ``array_state_count`` and ``array_indices_remaining`` as OpenPBS shows them."""
    info = job["internal"]["array"]
    subs = [(i, load_job(f"{job['seq']}[{i}]")) for i in info["indices"]]
    states = [sub["attrs"]["job_state"] if sub else "X" for _, sub in subs]
    queued = [i for (i, _), state in zip(subs, states) if state in ("Q", "W", "H")]
    attrs["array_state_count"] = (f"Queued:{len(queued)} Running:{states.count('R')} Exiting:{states.count('E')} "
                                  f"Expired:{states.count('X')}")
    attrs["array_indices_remaining"] = fmt_indices(queued, info["step"])
    stimes = [sub["internal"]["stime"] for _, sub in subs if sub and sub["internal"].get("stime")]
    if stimes:
        attrs["stime"] = pbs_time(min(stimes))
        began = time.strftime("%a %b %d at %H:%M", time.localtime(min(stimes)))
        attrs["comment"] = f"Job Array Began at {began}"  # openpbs test pbs_job_array_comment.py
    if all(state == "X" for state in states):
        attrs.update(job_state="F", substate=92)
        code = array_exit_status([sub for _, sub in subs])
        if code is not None:
            attrs["Exit_status"] = code
    elif stimes:
        attrs.update(job_state="B", substate=41)
    else:
        state = next((s for s in ("H", "W", "Q") if s in states), "Q")
        attrs.update(job_state=state, substate=SUBSTATE[state])


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

    def visible(job: dict[str, Any] | None, view: dict[str, Any]) -> bool:
        if job is None or is_vanished(job):
            return False
        return history_on or view.get("job_state") != "F"

    def add(job: dict[str, Any], view: dict[str, Any]) -> None:
        """The job, then with -t the subjobs of an array job (OpenPBS lists them only with -t)."""
        found[job["id"]] = view
        if "-t" in flags and job["internal"].get("array"):
            for index in job["internal"]["array"]["indices"]:
                sub = load_job(f"{job['seq']}[{index}]")
                if sub is not None:
                    found[sub["id"]] = public_view(sub)

    # OpenPBS main (openpbs #2672): qstat stats one id at a time and the JSON "Jobs" object is made with the first
    # answer only, so a batched -F json lists the first job found and drops the rest (rc 0, nothing on stderr)
    first_only = fmt == "json" and os.environ.get("FAKEPBS_JSON_FIRST_ONLY") == "1"
    if ids:
        for text in ids:
            _, shown, job = lookup(text)
            view = public_view(job) if job is not None else {}
            if job is None or not visible(job, view):
                errors.append(f"qstat: Unknown Job Id {shown}")
                rc = RC_UNKNOWN_JOB
            elif view["job_state"] == "F" and not history:
                errors.append(
                    f"qstat: {shown} Job has finished, use -x or -H to obtain historical job information"
                )
                rc = RC_HISTORY
            elif not (first_only and found):  # with the quirk, a later job is found and then dropped
                add(job, view)
    else:
        for number in all_seqs():
            listed = load_job(number)
            view = public_view(listed) if listed is not None else {}
            if listed is not None and visible(listed, view) and (history or view["job_state"] != "F"):
                add(listed, view)
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
        key, shown, job = lookup(text)
        state = public_view(job)["job_state"] if job is not None else None  # an array job's follows its subjobs
        if key is None or job is None or is_vanished(job) or (state == "F" and not history_on):
            sys.stderr.write(f"qdel: Unknown Job Id {shown}\n")
            rc = RC_UNKNOWN_JOB
            continue
        if state in ("F", "X"):
            sys.stderr.write(f"qdel: Job has finished {shown}\n")
            rc = RC_HISTORY
            continue
        if state == "E" or (state == "R" and job["internal"].get("delete_requested")):
            # already ending (its obit in, or a qdel before this one): OpenPBS refuses a plain qdel
            sys.stderr.write(f"qdel: Request invalid for state of job {shown}\n")
            rc = RC_BADSTATE
            continue
        array = job["internal"].get("array")
        # qdel N[] deletes every subjob: queued ones at once, running ones through their runner
        targets = [f"{job['seq']}[{i}]" for i in array["indices"]] if array else [key]
        with locked():
            for target in targets:
                delete_one(target)
    return rc


def delete_one(key: str) -> None:
    """Delete one job or subjob (call under the lock): a queued/held/waiting one ends at once without an
    Exit_status; a running one is signalled by its runner, which records the Exit_status."""
    job = load_job(key)
    if job is None:
        return
    state = job["attrs"]["job_state"]
    now = int(time.time())
    if state in ("Q", "H", "W"):
        final = "X" if job["internal"].get("array_index") is not None else "F"
        job["attrs"].update(job_state=final, substate=91, comment="Job deleted")
        job["internal"].update(mtime=now, obittime=now)
    elif state in ("R", "E"):  # the runner signals the session and records Exit_status
        job["internal"].update(delete_requested=True, mtime=now)
    else:
        return
    write_json(job_path(key), job)


# --------------------------------------------------------------------------- entry point

TOOLS = {"qsub": qsub, "qstat": qstat, "qdel": qdel}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    tool = os.path.basename(argv[0])
    try:
        if tool == "fakepbs.py" and argv[1:2] == ["run"]:
            home()
            run_job(argv[2])
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
