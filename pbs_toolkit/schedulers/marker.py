"""Submission that leaves the job id on disk even when pbstk dies right after the scheduler's submit command.

The submit command runs under a tiny ``bash`` wrapper in its own session (the runners start every command
with ``start_new_session``), so a SIGKILL of pbstk does not stop it. The wrapper writes
``RUN_DIR/.submitting`` first, then, when the command succeeds, its stdout to ``RUN_DIR/job_id`` (temp file +
rename) before printing it; a failure leaves ``RUN_DIR/submit_rc``. The job store adopts a launch whose run
directory holds a job id (see ``JobStore._resolve_intents``).
"""

from __future__ import annotations

from collections.abc import Sequence

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
