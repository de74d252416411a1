"""Start-up phases (docs/coldstart.md): the timeline the start script writes, placed next to vLLM's own log times
and the store's submit time, in ``status --json``'s ``startup`` object and the human status while STARTING."""

from __future__ import annotations

import calendar
import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launched_id, pbstk, status_of, wait_for

from pbs_toolkit.jobs.startup_phases import (
    PHASES,
    STARTUP_KEY,
    breakdown,
    parse_timeline,
    ready_seconds,
    startup_text,
)
from pbs_toolkit.jobs.store import JobStore

T0 = 1_790_000_000  # an epoch second; the node's clock below runs 2 h ahead of UTC (a zone, as vLLM prints it)
ZONE = 7200


def local(epoch: float) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.gmtime(epoch + ZONE))


def mark(event: str, at: float) -> str:
    return f"{event} {int(at)} {local(at)}"


def vllm_line(at: float, message: str) -> str:
    return f"INFO {local(at)} [x.py:1] {message}"


def timeline(*marks: tuple[str, float], lines: tuple[tuple[float, str], ...] = ()) -> str:
    return "\n".join([mark(e, t) for e, t in marks] + ["log " + vllm_line(t, m) for t, m in lines]) + "\n"


VLLM_LINES = (
    (T0 + 20, "Starting to load model Qwen/Qwen3-1.7B..."),
    (T0 + 61, "Loading weights took 40.12 seconds"),
    (T0 + 62, "Model loading took 3.2 GiB and 41.0 seconds"),
    (T0 + 92, "torch.compile takes 29.5 s in total"),
    (T0 + 100, "Graph capturing finished in 6 secs, took 0.5 GiB"),
    (T0 + 102, "init engine (profile, create kv cache, warmup model) took 39.8 seconds"),
)


def test_a_finished_start_splits_into_its_phases() -> None:
    text = timeline(("job", T0), ("setup", T0 + 3), ("stage", T0 + 3), ("staged", T0 + 8), ("vllm", T0 + 10),
                    ("api", T0 + 110), lines=VLLM_LINES)
    got = breakdown(T0 - 30, parse_timeline(text), verified_at=T0 + 112, now=T0 + 500)
    assert list(got["phases"]) == list(PHASES)
    assert got["phases"] == {"queued": 30, "setup": 5, "stage_copy": 5, "compile_wait": None, "imports": 10,
                             "weights": 42, "compile": 30, "graphs": 10, "api_up": 8, "verified_ready": 2}
    assert (got["current"], got["current_s"]) == (None, None)
    assert (got["longest"], got["longest_s"], got["total_s"]) == ("weights", 42, 142)
    assert ready_seconds(got) == 112  # tune's ready-s: the start without the queue


def test_a_start_under_way_names_its_phase_and_the_longest_one() -> None:
    text = timeline(("job", T0), ("compile-wait", T0 + 2), ("compile-wait-end", T0 + 70), ("vllm", T0 + 71))
    lines = [vllm_line(T0 + 80, "Starting to load model X"), vllm_line(T0 + 81, "Loading safetensors checkpoint")]
    got = breakdown(T0, parse_timeline(text), lines, now=T0 + 121)
    assert got["phases"]["compile_wait"] == 68 and got["phases"]["setup"] == 3 and got["phases"]["imports"] == 9
    assert (got["current"], got["current_s"], got["longest"]) == ("weights", 41, "compile_wait")
    assert startup_text(got) == "weights 41 s so far; longest: compile wait 68 s"
    assert ready_seconds(got) is None
    # waiting on another engine's compile, and queued
    waiting = breakdown(T0 - 5, parse_timeline(timeline(("job", T0), ("compile-wait", T0 + 2))), now=T0 + 12)
    assert (waiting["current"], waiting["current_s"]) == ("compile_wait", 10)
    assert startup_text(breakdown(T0, parse_timeline(""), now=T0 + 7, pending=True)) == "queued 7 s so far"


def test_weights_loaded_then_compile_or_graphs_by_eager() -> None:
    text = timeline(("job", T0), ("vllm", T0 + 1))
    lines = [vllm_line(T0 + 5, "Starting to load model X"), vllm_line(T0 + 9, "Loading weights took 4 seconds")]
    assert breakdown(T0, parse_timeline(text), lines, now=T0 + 20)["current"] == "compile"
    assert breakdown(T0, parse_timeline(text), lines, now=T0 + 20, eager=True)["current"] == "graphs"
    # an eager start that finished: no compile line, so the time after the weights is "graphs"
    done = timeline(("job", T0), ("vllm", T0 + 1), ("api", T0 + 30))
    lines.append(vllm_line(T0 + 25, "init engine (profile, create kv cache, warmup model) took 16 seconds"))
    got = breakdown(T0, parse_timeline(done), lines, verified_at=T0 + 30, eager=True)
    assert got["phases"]["compile"] is None and got["phases"]["graphs"] == 16 and got["phases"]["api_up"] == 5


def test_log_times_of_another_clock_are_not_believed() -> None:
    # a stand-in or a node whose log times are far from its own marks: the vLLM start is not split
    text = timeline(("job", T0), ("vllm", T0 + 10), ("api", T0 + 70))
    lines = ["INFO 11-22 02:38:29 [x.py:1] Starting to load model",
             "INFO 11-22 02:38:30 [x.py:1] Loading weights took 1 s"]
    got = breakdown(T0, parse_timeline(text), lines, verified_at=T0 + 71)
    assert got["phases"]["imports"] is None and got["phases"]["weights"] is None and got["phases"]["api_up"] == 60
    # garbage in the file (it is the job's) is skipped, not an error
    assert parse_timeline("nonsense\njob notanumber 1 2\n\x00\n").marks == {}


def test_status_json_has_the_startup_breakdown(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_PHASE_S", "1")
    job = launched_id(pbstk("launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single",
                            "--port", "auto"))
    # while it starts, the human status names the phase under way and its seconds so far
    seen: list[str] = []

    def starting_detail() -> Any:
        out = pbstk("status", job).stdout
        seen.append(out)
        return "s so far" in out and "STARTING" in out

    wait_for(starting_detail, 20, "a STARTING line with the phase's seconds so far", interval=0.2)
    result = pbstk("wait", job, "--timeout", "30")
    assert result.exit_code == 0, result.output
    startup = status_of(job)["startup"]
    phases = startup["phases"]
    assert startup["current"] is None and startup["total_s"] is not None
    for name in ("imports", "weights", "compile", "graphs"):  # 1 s each in the stand-in, whole-second marks
        assert phases[name] is not None and 0 <= phases[name] <= 3, (name, startup)
    assert phases["queued"] is not None and phases["setup"] is not None and phases["verified_ready"] is not None
    assert phases["stage_copy"] is None and phases["compile_wait"] is None
    # frozen in the record once READY was verified: later calls show the same numbers without reading the file
    assert JobStore().find(job).extra[STARTUP_KEY] == startup
    (Path(JobStore().find(job).run_dir) / "startup.log").unlink()
    assert status_of(job)["startup"] == startup
    pbstk("cancel", job)


def test_pending_jobs_count_their_queue_time(tmp_path: Path) -> None:
    from pbs_toolkit.jobs.startup_phases import job_startup
    from pbs_toolkit.jobs.status_types import ServerState

    class Record:
        created = time.time() - 42
        extra: dict[str, Any] = {}

    got = job_startup(Record(), ServerState.PENDING, None, [])
    assert got is not None and got["current"] == "queued" and 41 <= got["current_s"] <= 44
    assert job_startup(Record(), ServerState.STARTING, None, []) is None  # a script without a timeline: nothing to tell
    assert json.dumps(got)  # JSON-ready


def test_doctor_names_the_longest_phase_of_a_slow_start_and_shows_the_container_command() -> None:
    from pbs_toolkit.perf.doctor import DoctorContext, diagnose

    text = timeline(("job", T0), ("vllm", T0 + 10), ("api", T0 + 110), lines=VLLM_LINES)
    slow = breakdown(T0 - 30, parse_timeline(text), verified_at=T0 + 112)
    command = "apptainer exec --nv --bind /runs/r1 /images/vllm.sif vllm serve /models/m --port 8000"
    lines = [f"pbstk: 01:02:03 {'vLLM runs in a container: '}{command}"]
    found = {f.code: f for f in diagnose(DoctorContext(startup=slow, log_lines=lines))}
    assert found["slow-start"].title == "Start-up took 112 s; the longest phase was weights (42 s)"
    assert "stage_to" in found["slow-start"].fix and "queued 30 s" in found["slow-start"].evidence
    assert found["container"].evidence == f"log: {command}" and found["container"].severity == "info"
    quick = breakdown(T0, parse_timeline(timeline(("job", T0), ("vllm", T0 + 1), ("api", T0 + 40))),
                      verified_at=T0 + 41)
    assert not {"slow-start", "container"} & {f.code for f in diagnose(DoctorContext(startup=quick))}


def test_a_recorded_vllm_start_splits_at_its_own_lines() -> None:
    # a real vLLM 0.11 start with CUDA graphs (tests/data/observe); its node's marks put on the same clock as its log
    lines = (Path(__file__).parent / "data" / "observe" / "startup-graphs.log").read_text().splitlines()
    start = calendar.timegm(time.strptime("2025-11-20 14:02:11", "%Y-%m-%d %H:%M:%S"))  # its first line, as UTC
    text = f"job {start - 5} 11-20 14:02:06\nvllm {start} 11-20 14:02:11\napi {start + 103} 11-20 14:03:54\n"
    got = breakdown(start - 10, parse_timeline(text), lines, verified_at=start + 104)
    assert got["phases"] == {"queued": 5, "setup": 5, "stage_copy": None, "compile_wait": None, "imports": 19,
                             "weights": 6, "compile": 44, "graphs": 17, "api_up": 17, "verified_ready": 1}
    assert (got["longest"], got["total_s"]) == ("compile", 114)


def test_a_recorded_vllm_0_22_start_has_its_compile_phase() -> None:
    # a real vLLM 0.22.1 start on an H200 (benchmarks/gpu/results/h200x2-coldstart-b, cold): 0.22 says
    # "torch.compile took N s in total", where 0.11 said "takes"; the timeline is that job's own startup.log
    lines = (Path(__file__).parent / "data" / "observe" / "startup-0.22.1-graphs.log").read_text().splitlines()
    text = ("job 1795660430.072848 11-26 02:33:50\nsetup 1795660430.075633 11-26 02:33:50\n"
            "vllm 1795660430.169899 11-26 02:33:50\napi 1795660531.478855 11-26 02:35:31\n")
    got = breakdown(1795660430.0, parse_timeline(text), lines, verified_at=1795660531.5)
    phases = got["phases"]
    assert phases["compile"] is not None and 19 <= phases["compile"] <= 23, phases  # 02:34:48 -> 02:35:09
    assert phases["graphs"] is not None and 18 <= phases["graphs"] <= 22, phases  # -> engine ready 02:35:29
    assert got["longest"] == "imports"
