"""A multi-model job whose other model dies before it is ready fails with that model's root cause in its one line
(issue 28 item 3, issue 31): the stand-in vLLM fails as vLLM 0.22.1 did on an H100 (the engine core's ValueError,
then the API server's "See root cause above" wrapper), local scheduler, the real vllm-router and keeper.

Before: the job's reason was "model b exited before it was ready (see LOG)", which names no cause.
"""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import pbstk
from test_serve_models_run import gpu_svc  # noqa: F401  (fixture)

from pbs_toolkit.jobs.render import OPTIONAL_PARTS, START_DIR
from pbs_toolkit.jobs.spec import LaunchSpec
from pbs_toolkit.jobs.status_types import JobStatus, ServerState
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.services import record as records
from pbs_toolkit.services.keeper.restarts import CAUSE_CHARS, failure_cause
from pbs_toolkit.vllm.logline import LOG_PREFIX_RE
from pbs_toolkit.vllm.startup import EXCEPTION_RE, FATAL_WRAPPER_RE, find_fatal

CAUSE = "ValueError: To serve at least one request with the model's max seq len (40960), (4.38 GiB KV cache is needed"


def test_a_co_model_that_dies_at_start_names_its_cause(gpu_svc: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    alpha, beta = gpu_svc
    monkeypatch.setenv("PBSTK_TEST_STANDIN_KV_SHORT", "b")  # the job's second model, started before the first
    result = pbstk("serve", f"{alpha}:name=a", f"{beta}:name=b", "--name", "short", "--profile", "gpu1",
                   "--max-restarts", "0", "--wait", "--timeout", "90")
    assert result.exit_code == 5, result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("pbstk: error:")]
    assert len(error) == 1, result.output
    assert "model b exited before it was ready: " + CAUSE in error[0], error[0]
    assert "See root cause above" not in error[0] and "(EngineCore pid=" not in error[0], error[0]

    job = records.find(JobStore(), "short").slots[0].current
    assert job is not None
    doc = json.loads(pbstk("status", job, "--json").stdout)
    doc = doc[0] if isinstance(doc, list) else doc
    assert doc["state"] == "FAILED" and "model b exited before it was ready: " + CAUSE in doc["reason"], doc
    assert len(doc["reason"]) < 500, doc["reason"]  # the cause cut short, not vLLM's whole paragraph
    log = Path(JobStore().find(job).run_dir) / "vllm.model2.log"
    assert "See root cause above" in log.read_text()  # the wrapper was there to be skipped
    # vLLM 0.22.1 prints the key in its "non-default args" line (the H100 run's co-model logs held it, 0644):
    # each model's log is as private as the key file, as the first model's is
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE((log.parent / "vllm.log").stat().st_mode) == 0o600


REAL = Path(__file__).parent / "data" / "observe" / "startup-0.22.1-kv-short.log"


def root_cause(log: Path, since: int = 0) -> str:
    """models.sh's pbstk_root_cause on ``log`` from byte ``since``, in bash with the rendered header's settings."""
    body = (START_DIR / OPTIONAL_PARTS[0]).read_text(encoding="utf-8")
    function = body[body.index("pbstk_root_cause() {"):]
    function = function[:function.index("\n}\n") + 3]
    script = (f"set -uo pipefail\nLOG_PREFIX_RE=$1 EXCEPTION_RE=$2 FATAL_WRAPPER_RE=$3\n{function}"
              'pbstk_root_cause cause "$4" "$5"\nprintf "%s" "$cause"\n')
    argv = ["bash", "-c", script, "bash", LOG_PREFIX_RE, EXCEPTION_RE, FATAL_WRAPPER_RE, str(log), str(since)]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout  # noqa: S603


def test_the_start_script_names_the_cause_as_find_fatal_does(tmp_path: Path) -> None:
    """On vLLM 0.22.1's real log (H100) the start script's bash picks the line find_fatal picks, without vLLM's
    prefix, cut to 300 characters; the wrapper when it is alone; nothing before SINCE (an earlier start's)."""
    lines = REAL.read_text().splitlines()
    said = root_cause(REAL)
    assert said.startswith(CAUSE) and said.endswith("...") and len(said) == 300, said
    assert said[:297] == find_fatal(lines)[0][:297]
    alone = tmp_path / "alone.log"
    alone.write_text("\n".join(line for line in lines if "ValueError: To serve" not in line) + "\n")
    assert root_cause(alone) == find_fatal(alone.read_text().splitlines())[0]
    assert root_cause(alone).startswith("RuntimeError: Engine core initialization failed. See root cause above.")
    twice = tmp_path / "twice.log"
    first = "(EngineCore pid=1) ERROR 11-28 00:57:45 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.\n"
    twice.write_text(first + "INFO 11-28 00:58:00 [api_server.py:1] vLLM API server version 0.22.1\n")
    assert root_cause(twice) == "torch.OutOfMemoryError: CUDA out of memory."
    assert root_cause(twice, len(first)) == ""


def test_the_restart_message_cuts_the_cause_at_a_word_and_says_it_once() -> None:
    """The service's one line (``failure_cause``): the reason that the start script's error line gave is not
    repeated as the log's last line, and a cut never leaves half a number ("length is 372" of 37232).
    Before: "...; log: pbstk: 01:30:41 error: model b ..." followed the same reason, cut at 300 characters."""
    record = JobRecord(job_id="1.vm", scheduler="local", profile="p", model="m", served_model_name="m", preset="x",
                       name="j", run_dir="/nonexistent", spec=LaunchSpec())
    reason = ("model b exited before it was ready: " + CAUSE + ", which is larger than the available KV cache "
              "memory (3.98 GiB). Based on the available memory, the estimated maximum model length is 37232. Try "
              "increasing `gpu_memory_utilization` (see /runs/j/vllm.model2.log)")
    st = JobStatus(record=record, state=ServerState.FAILED, reason=reason,
                   log_excerpt=["pbstk: 01:30:41 model b: starting vLLM", f"pbstk: 01:30:41 error: {reason}"])
    said = failure_cause("1.vm", st)
    assert said.startswith("1.vm FAILED: model b exited before it was ready: ValueError: To serve"), said
    assert len(said) <= CAUSE_CHARS and said.endswith("...") and "; log:" not in said, said
    assert said.endswith("estimated maximum model length is...") or "37232" in said, said
    st.reason = "the job script exited with code 1"  # a reason the log line does not hold: both are said
    assert failure_cause("1.vm", st).startswith("1.vm FAILED: the job script exited with code 1; log: pbstk: ")
