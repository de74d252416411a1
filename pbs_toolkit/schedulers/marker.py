"""Submission that leaves the job id on disk even when pbstk dies right after the scheduler's submit command.

The submit command runs under a tiny ``bash`` wrapper in its own session (the runners start every command
with ``start_new_session``), so a SIGKILL of pbstk does not stop it. The wrapper writes
``RUN_DIR/.submitting`` first, then, when the command succeeds, its stdout to ``RUN_DIR/job_id`` (temp file +
rename) before printing it; a failure leaves ``RUN_DIR/submit_rc``. The job store adopts a launch whose run
directory holds a job id (see ``JobStore._resolve_intents``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pbs_toolkit.transports.base import Result, Runner, WrappingRunner

# Constant text; the run directory and the command arrive as positional parameters.
_WRAPPER = r"""
d=$1; shift
trap '' HUP PIPE
echo "$$" >"$d/.submitting"
out=$("$@" 2>"$d/.submit.err"); rc=$?
if [ "$rc" = 0 ]; then
  printf '%s\n' "$out" >"$d/.job_id.tmp.$$" && mv -f "$d/.job_id.tmp.$$" "$d/job_id"
else
  echo "$rc" >"$d/submit_rc"
fi
cat "$d/.submit.err" >&2 2>/dev/null
rm -f "$d/.submit.err"
printf '%s\n' "$out"
exit "$rc"
"""


def marked(argv: Sequence[str], run_dir: str) -> list[str]:
    """``argv`` wrapped so that its output (the job id) also lands in ``run_dir/job_id``."""
    return ["bash", "-c", _WRAPPER, "pbstk-submit", run_dir, *argv]


class MarkingRunner(WrappingRunner):
    """``inner``, except that every command runs under the wrapper that leaves ``run_dir/job_id``, with ``env``
    added to its environment (through ``env=``: an ``env`` prefix would hide the program from the wrapper's
    messages). ``Scheduler.submit`` runs its submit command, and only that, through one."""

    def __init__(self, inner: Runner, run_dir: str, env: Mapping[str, str] | None = None) -> None:
        super().__init__(inner)
        self.run_dir, self.env = run_dir, dict(env or {})

    def run(self, argv: Sequence[str], **kw: Any) -> Result:
        if self.env:
            kw = {**kw, "env": {**(kw.get("env") or {}), **self.env}}
        return self.inner.run(marked(argv, self.run_dir), **kw)
