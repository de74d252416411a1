#!/usr/bin/env python3
"""Run a command and print its wall time and the CPU time of its whole process tree, detached servers included.

    python benchmarks/cpu/tree_time.py COMMAND [ARGS...]

A job's vLLM is started in a session of its own and outlives the ``pbstk`` that launched it, so ``time`` does
not count it. Here this process is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): every orphan of the
tree is re-parented to it and reaped by it, so ``RUSAGE_CHILDREN`` adds up all of them once the last one exits.
On a shared machine the CPU seconds compare better than the wall time. Exits with COMMAND's status.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("tree_time: cannot become a child subreaper (Linux only)", file=sys.stderr)
        return 2
    start = time.monotonic()
    proc = subprocess.Popen(argv)  # noqa: S603 - the caller's own command
    rc, wall = 1, 0.0
    while True:  # reap the command and every orphan it leaves, until none is left
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == proc.pid:
            rc, wall = os.waitstatus_to_exitcode(status), time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"tree_time: wall {wall:.1f} s (last process {time.monotonic() - start:.1f} s), CPU "
          f"{usage.ru_utime + usage.ru_stime:.1f} s (user {usage.ru_utime:.1f}, system {usage.ru_stime:.1f})",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
