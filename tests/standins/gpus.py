"""The stand-in GPUs: what the stand-in ``nvidia-smi`` shows and what the stand-in ``vllm`` takes, kept in one
ledger per test, as a real GPU keeps its memory per process.

``PBSTK_TEST_GPU_DIR``: the ledger's directory (the ``standins`` fixture sets one per test); unset, there are no
stand-in GPUs to book: the stand-in vLLM takes no memory and checks nothing (a CPU machine's stand-in).
``PBSTK_TEST_GPUS``: how many GPUs the machine has (default 4); ``PBSTK_TEST_GPU_MIB``: each one's memory in MiB
(default 81559, an H100 80GB's).

A holder is one process: ``held/<pid>.json`` says how many MiB it holds on which GPU indices and under which
process name. Its memory counts only while that very process lives (not a zombie, the same start time): a
process killed with SIGKILL never cleans up, and its memory is free again the moment it is gone, as the driver
frees a dead process's memory. Taking memory checks and writes under one lock, so two stand-ins starting at
once cannot both see the same free memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os

DIR_ENV = "PBSTK_TEST_GPU_DIR"
MIB = 1 << 20
GIB = 1 << 30
NAME = "NVIDIA H100 80GB HBM3"


def ledger_dir():
    """The ledger's directory, or None: no stand-in GPUs. A node of its own has a ledger of its own: the fake PBS
    gives each job nodes of their own (PBSTK_TEST_GPU_NODE, its job id), and a fake node of a job over several
    (PBSTK_FAKE_HOSTNAME, fakenodeK) has its own GPUs; the local scheduler's jobs share this machine's."""
    base = os.environ.get(DIR_ENV)
    if not base:
        return None
    parts = [p for p in (os.environ.get("PBSTK_TEST_GPU_NODE"), os.environ.get("PBSTK_FAKE_HOSTNAME")) if p]
    return os.path.join(base, *("".join(c if c.isalnum() or c in "._-" else "_" for c in p) for p in parts))


def count():
    return int(os.environ.get("PBSTK_TEST_GPUS") or 4)


def total_mib():
    return int(os.environ.get("PBSTK_TEST_GPU_MIB") or 81559)


def uuid(index):
    """``GPU-aaaaaaaa-0000-0000-0000-000000000000`` for GPU 0, ``GPU-bbbbbbbb-1111-...`` for GPU 1, ..."""
    letter, digit = "abcdefghijklmnop"[index % 16], str(index % 10)
    return f"GPU-{letter * 8}-{digit * 4}-{digit * 4}-{digit * 4}-{digit * 12}"


def _stat(pid):
    """(state, start time) of process ``pid``, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def alive(pid, start=None):
    """Process ``pid`` runs (a zombie does not: it holds no memory any more) and, given ``start``, is the same
    process that started then."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (start is None or stat[1] == start)


def holders(directory=None):
    """The live holders: dicts with pid, name and ``gpus`` ({index as str: MiB})."""
    directory = directory or ledger_dir()
    found = []
    held = os.path.join(directory, "held") if directory else None
    if not held or not os.path.isdir(held):
        return found
    for entry in sorted(os.listdir(held)):
        try:
            with open(os.path.join(held, entry)) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if alive(data.get("pid"), data.get("start")):
            found.append(data)
    return found


def used_mib(directory=None):
    """MiB held on each GPU index by live processes."""
    used = dict.fromkeys(range(count()), 0)
    for holder in holders(directory):
        for index, mib in holder["gpus"].items():
            used[int(index)] = used.get(int(index), 0) + int(mib)
    return used


@contextlib.contextmanager
def locked(directory):
    os.makedirs(os.path.join(directory, "held"), exist_ok=True)
    with open(os.path.join(directory, "lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write(directory, pid, name, gpus):
    stat = _stat(pid)
    path = os.path.join(directory, "held", f"{pid}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"pid": pid, "start": stat[1] if stat else None, "name": name,
                   "gpus": {str(k): int(v) for k, v in gpus.items()}}, fh)
    os.replace(path + ".tmp", path)


def visible():
    """The GPU indices this process sees: CUDA_VISIBLE_DEVICES (indices or UUIDs, as a scheduler may give them;
    an empty value is none), else every GPU."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count()))
    by_uuid = {uuid(i): i for i in range(count())}
    out = []
    for item in (v.strip() for v in value.split(",")):
        if item.isdigit() and int(item) < count():
            out.append(int(item))
        elif item in by_uuid:
            out.append(by_uuid[item])
    return out


def take(pid, name, indices, utilization):
    """Process ``pid`` takes ``utilization`` of each GPU in ``indices`` (vLLM's budget is a share of the whole
    GPU, and it must be free at start). Returns None, or vLLM's own error line when some GPU has less free."""
    directory = ledger_dir()
    if directory is None:
        return None
    total = total_mib()
    want = int(total * utilization)
    with locked(directory):
        used = used_mib(directory)
        for cuda, index in enumerate(indices):
            free = total - used.get(index, 0)
            if free < want:
                return (f"ValueError: Free memory on device cuda:{cuda} ({round(free * MIB / GIB, 2)}/"
                        f"{round(total * MIB / GIB, 2)} GiB) on startup is less than desired GPU memory utilization "
                        f"({utilization}, {round(want * MIB / GIB, 2)} GiB). Decrease GPU memory utilization or "
                        f"reduce GPU memory used by other processes.")
        _write(directory, pid, name, {index: want for index in indices})
    return None


def resize(pid, name, indices, mib):
    """Process ``pid`` now holds ``mib`` on each GPU in ``indices`` (a model asleep keeps its CUDA context)."""
    directory = ledger_dir()
    if directory is None:
        return
    with locked(directory):
        _write(directory, pid, name, {index: mib for index in indices})


def release(pid):
    directory = ledger_dir()
    if directory is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, "held", f"{pid}.json"))
