"""``classify`` (with the PBS backend's exit mapping) and ``combine``: the state decision, pure (no processes,
files or sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from pbs_toolkit.jobs.rundir import parse_marker
from pbs_toolkit.jobs.status import Absence, ServerState, classify, combine, current_attempt
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.schedulers import Outcome, SchedulerJob, pbs
from pbs_toolkit.transports.http import Identity

S = ServerState
OURS = Identity(True)
#: the scheduler has not listed the job in 3 answers over 61 s (with the default PBSTK_LOST_AFTER_S=60)
SETTLED = Absence(3, 61.0)

OOM_LOG = [
    "pbstk: 02:38:27 attempt 1: starting vLLM on 127.0.0.1:8000: vllm serve m",
    "INFO 11-22 02:38:28 [api_server.py:1] vLLM API server version 0.0.0",
    "INFO 11-22 02:38:29 [default_loader.py:1] Loading weights took 0.05 seconds",
    "ERROR 11-22 02:38:30 [core.py:1] EngineCore failed to start.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: Engine core initialization failed. See root cause above.",
]


def record() -> JobRecord:
    return JobRecord(job_id="7.pbs01", scheduler="pbs", profile="generic-pbspro", model="org/m",
                     served_model_name="org/m", preset="dp4", name="m", run_dir="/runs/m")


def sched(raw: str, exit_status: int | None = None, comment: str | None = None) -> SchedulerJob:
    """What the PBS backend makes of a ``qstat -f -F json`` entry (its outcome mapping included)."""
    info: dict[str, Any] = {"job_state": raw, "exec_host": "x3001c0s1b0n0/0*64" if raw != "Q" else None}
    if exit_status is not None:
        info["Exit_status"] = exit_status
    if comment is not None:
        info["comment"] = comment
    return pbs._job("7.pbs01", info)


def marker(phase: str, exit_code: int | None = None, port: int = 8000) -> dict[str, Any]:
    return {"phase": phase, "job_id": "7.pbs01", "host": "x3001c0s1b0n0", "address": "x3001.site.gov",
            "port": port, "pid": 4242, "attempt": 1, "eager_fallback": False, "exit_code": exit_code}


# -- classify(pbs.outcome(Exit_status)) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit_status", "state", "words"),
    [
        (0, S.FINISHED, "exited normally"),
        (1, S.FAILED, "exited with code 1"),
        (143, S.FAILED, "exited with code 143"),  # the script's own code, below 256
        (255, S.FAILED, "exited with code 255"),
        (271, S.CANCELLED, "signal 15 (SIGTERM)"),  # qdel of a running job
        (265, S.CANCELLED, "signal 9 (SIGKILL)"),
        (258, S.CANCELLED, "signal 2 (SIGINT)"),
        (-29, S.FAILED, "walltime exceeded"),
        (-1, S.FAILED, "execution code -1"),
        (None, S.CANCELLED, "deleted before it ran"),  # qdel of a queued job leaves no Exit_status
    ],
)
def test_classify_exit(exit_status: int | None, state: ServerState, words: str) -> None:
    got_state, reason = classify(*pbs.outcome(exit_status))
    assert got_state is state
    assert words in reason


@pytest.mark.parametrize(
    ("outcome", "code", "state", "words"),
    [
        (Outcome.CANCELLED, 143, S.CANCELLED, "stopped by a signal"),
        (Outcome.WALLTIME, None, S.FAILED, "walltime exceeded"),
        (Outcome.KILLED, 9, S.CANCELLED, "signal 9 (SIGKILL)"),
        (Outcome.NEVER_RAN, None, S.CANCELLED, "deleted before it ran"),
    ],
)
def test_classify_outcomes_without_scheduler_codes(outcome: Outcome, code: int | None, state: ServerState,
                                                   words: str) -> None:
    got_state, reason = classify(outcome, code)
    assert got_state is state and words in reason


# -- combine: scheduler says queued / running -------------------------------------------------------


def test_queued_is_pending_with_the_schedulers_comment() -> None:
    st = combine(record(), sched("Q", comment="Not Running: Not enough free nodes available"), None, [], None)
    assert st.state is S.PENDING
    assert st.comment == "Not Running: Not enough free nodes available"
    assert st.scheduler_state == "Q"
    assert not st.state.final


def test_held_is_pending_with_a_reason() -> None:
    st = combine(record(), sched("H", comment="job held, too many failed attempts to run"), None, [], None)
    assert st.state is S.PENDING
    assert st.reason == "held by the scheduler"
    assert st.comment == "job held, too many failed attempts to run"


def test_running_before_the_marker_is_starting() -> None:
    st = combine(record(), sched("R"), None, [], None)
    assert st.state is S.STARTING
    assert st.phase == "job started"
    assert st.node == "x3001c0s1b0n0"


def test_running_and_loading_reports_the_log_phase() -> None:
    st = combine(record(), sched("R"), marker("starting"), OOM_LOG[:3], None)
    assert st.state is S.STARTING
    assert st.phase == "initializing engine"  # read from the log: "Loading weights took" is its last line
    assert st.url == "http://x3001.site.gov:8000/v1"


def test_health_200_is_ready_once_the_server_proved_it_is_ours() -> None:
    st = combine(record(), sched("R"), marker("ready"), OOM_LOG[:3], 200, OURS)
    assert st.state is S.READY
    assert st.url == "http://x3001.site.gov:8000/v1"


def test_a_multi_model_jobs_first_model_answering_while_others_start_is_starting() -> None:
    """models.sh starts the job's own model beside others on other GPUs: it answers first, the job is not READY."""
    st = combine(record(), sched("R"), {**marker("starting"), "models_starting": "yes"}, OOM_LOG[:3], 200, OURS)
    assert st.state is S.STARTING and "other models" in st.phase
    ready = {**marker("ready"), "models": "b@8001 c@8002"}
    assert combine(record(), sched("R"), ready, OOM_LOG[:3], 200, OURS).state is S.READY


@pytest.mark.parametrize("identity", [None, Identity(False, detail="answered /v1/models with 404")])
def test_health_200_alone_is_not_ready(identity: Identity | None) -> None:
    st = combine(record(), sched("R"), marker("ready"), OOM_LOG[:3], 200, identity)
    assert st.state is S.STARTING and st.foreign is None


def test_another_server_on_the_port_is_not_ready() -> None:
    foreign = Identity(False, foreign=True, detail="rejected the API key (401)")
    st = combine(record(), sched("R"), marker("ready"), OOM_LOG[:3], 200, foreign)
    assert st.state is S.STARTING
    assert st.phase == "port 8000 answered by another server (it rejected the API key (401))"
    assert st.foreign == "rejected the API key (401)"


def test_health_503_is_not_ready() -> None:
    st = combine(record(), sched("R"), marker("ready"), OOM_LOG[:3], 503)
    assert st.state is S.STARTING


def test_fatal_line_while_running_is_unconfirmed_failure() -> None:
    st = combine(record(), sched("R"), marker("starting"), OOM_LOG, None)
    assert st.state is S.FAILED
    assert st.confirmed is False  # the start script may still restart it (eager fallback)
    assert "CUDA out of memory" in (st.reason or "")
    assert any("CUDA out of memory" in line for line in st.log_excerpt)


def test_exiting_uses_the_exit_status_already_set() -> None:
    # PBS sets Exit_status on entering E; status() still waits for F before recording it
    st = combine(record(), sched("E", exit_status=0), marker("exited", 0), OOM_LOG[:3], None)
    assert st.state is S.FINISHED
    st = combine(record(), sched("E", exit_status=-29), marker("cancelled", 143), OOM_LOG[:3], None)
    assert st.state is S.FAILED and "walltime" in (st.reason or "")


def test_running_but_the_server_ended_follows_the_marker() -> None:
    st = combine(record(), sched("R"), marker("exited", 0), OOM_LOG[:3], None)
    assert st.state is S.FINISHED  # not "FAILED: the vLLM server exited"
    st = combine(record(), sched("R"), marker("exited", 1), OOM_LOG[:3], None)
    assert st.state is S.FAILED and "code 1" in (st.reason or "")
    st = combine(record(), sched("R"), marker("failed", 1), OOM_LOG, None)
    assert st.state is S.FAILED and "CUDA out of memory" in (st.reason or "")


# -- combine: scheduler says finished ---------------------------------------------------------------


def test_finished_exit_0_is_finished() -> None:
    st = combine(record(), sched("F", 0), marker("exited", 0), OOM_LOG[:3], None)
    assert (st.state, st.exit_status) == (S.FINISHED, 0)


def test_finished_with_fatal_log_is_failed_with_the_error_lines() -> None:
    st = combine(record(), sched("F", 1), marker("failed", 1), OOM_LOG, None)
    assert st.state is S.FAILED
    assert st.reason == "vLLM failed before it was ready: torch.OutOfMemoryError: CUDA out of memory. " \
                        "Tried to allocate 2.00 GiB"
    assert st.log_excerpt[0].startswith("torch.OutOfMemoryError")
    assert any("Engine core initialization failed" in line for line in st.log_excerpt)


def test_failed_marker_with_exit_0_is_still_failed() -> None:
    st = combine(record(), sched("F", 0), marker("failed", 0), OOM_LOG, None)
    assert st.state is S.FAILED


def test_qdel_of_running_job_is_cancelled() -> None:
    st = combine(record(), sched("F", 271), marker("ready"), OOM_LOG[:3], None)
    assert st.state is S.CANCELLED


def test_trapped_stop_signal_is_cancelled_not_failed() -> None:
    # the start script traps SIGTERM and exits 143 itself: PBS records 143, the marker says why
    st = combine(record(), sched("F", 143), marker("cancelled", 143), OOM_LOG[:3], None)
    assert st.state is S.CANCELLED


def test_walltime_wins_over_the_cancelled_marker() -> None:
    st = combine(record(), sched("F", -29), marker("cancelled", 143), OOM_LOG[:3], None)
    assert st.state is S.FAILED
    assert "walltime exceeded" in (st.reason or "")
    assert st.exit_status == -29


def test_deleted_while_queued_is_cancelled() -> None:
    st = combine(record(), sched("F", None, comment="Job deleted"), None, [], None)
    assert st.state is S.CANCELLED


# -- combine: the scheduler forgot the job ----------------------------------------------------------


def test_forgotten_and_unexplained_is_lost_once_the_absence_is_settled() -> None:
    st = combine(record(), None, None, [], None, absence=SETTLED)
    assert st.state is S.LOST
    st = combine(record(), None, marker("ready"), OOM_LOG[:3], None, absence=SETTLED)  # killed hard
    assert st.state is S.LOST


@pytest.mark.parametrize("absence", [None, Absence(1, 0.0), Absence(2, 120.0), Absence(5, 59.0)])
def test_forgotten_briefly_is_unknown(absence: Absence | None) -> None:
    st = combine(record(), None, marker("starting"), OOM_LOG[:3], None, absence=absence)
    assert st.state is S.UNKNOWN and not st.state.final
    assert "LOST after 3 over 60 s without a sign of life" in (st.reason or "")


def test_lost_window_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_LOST_AFTER_S", "0")
    assert combine(record(), None, None, [], None, absence=Absence(3, 0.0)).state is S.LOST
    assert combine(record(), None, None, [], None, absence=Absence(2, 0.0)).state is S.UNKNOWN


@pytest.mark.parametrize(
    ("mark", "state"),
    [(marker("exited", 0), S.FINISHED), (marker("exited", 3), S.FAILED), (marker("failed", 1), S.FAILED),
     (marker("cancelled", 143), S.CANCELLED)],
)
def test_forgotten_but_the_marker_explains_it(mark: dict[str, Any], state: ServerState) -> None:
    st = combine(record(), None, mark, OOM_LOG if mark["phase"] == "failed" else OOM_LOG[:3], None)
    assert st.state is state
    assert st.exit_status == mark["exit_code"]


def test_forgotten_but_answering_is_unknown_never_ready_nor_lost() -> None:
    st = combine(record(), None, marker("ready"), OOM_LOG[:3], 200, OURS, absence=SETTLED)
    assert st.state is S.UNKNOWN
    assert "no longer knows this job, but its server still answers" in (st.reason or "")


def test_scheduler_silent_but_server_ours_is_ready() -> None:
    st = combine(record(), None, marker("ready"), OOM_LOG[:3], 200, OURS, answered=False)
    assert st.state is S.READY
    st = combine(record(), None, marker("ready"), OOM_LOG[:3], None, answered=False, absence=SETTLED)
    assert st.state is S.UNKNOWN  # a scheduler that did not answer settles nothing


# -- server.json as the start script (or something else) left it ----------------------------------------


@pytest.mark.parametrize(
    ("raw", "problem"),
    [(b'{"phase": "ready", "port": "abc"}', "port 'abc' is not a port number"),
     (b'{"phase": "ready", "port": 70000}', "port 70000 is not a port number"),
     (b'{"phase": ["ready"]}', "phase ['ready'] is not a string"),
     (b'{"phase": "starting", "exit_code": "0"}', "exit_code '0' is not a number"),
     (b'[1, 2]', "not a JSON object"), (b'{"phase": "ready"', "not valid JSON"),
     (b'\xff\xfe{"port": 1}', "not valid JSON")],
)
def test_bad_marker_fields_are_dropped_and_named(raw: bytes, problem: str) -> None:
    mark, why = parse_marker(raw)
    assert problem in (why or "")
    st = combine(record(), sched("R"), mark, [], None)
    assert st.state is S.STARTING and st.port is None


def test_port_zero_means_not_chosen_yet_not_a_broken_marker() -> None:
    """The start script writes port 0 until it has picked one: no problem to report while it starts."""
    mark, why = parse_marker(b'{"phase": "setup", "port": 0}')
    assert why is None and mark is not None and mark["port"] is None


def test_port_as_digits_is_accepted() -> None:
    mark, why = parse_marker(b'{"phase": "ready", "port": "8001", "address": "n1"}')
    assert why is None and mark is not None and mark["port"] == 8001


# -- attempts ---------------------------------------------------------------------------------------


def test_only_the_newest_attempt_counts() -> None:
    retry = ["pbstk: 02:39:00 vLLM failed ...; restarting once with --enforce-eager",
             "pbstk: 02:39:00 attempt 2: starting vLLM on 127.0.0.1:8000: vllm serve m --enforce-eager",
             "INFO 11-22 02:39:01 [default_loader.py:1] Loading weights took 0.05 seconds"]
    lines = OOM_LOG + retry
    assert current_attempt(lines) == retry[1:]
    mark = {**marker("starting"), "eager_fallback": True}
    st = combine(record(), sched("R"), mark, lines, None)
    assert st.state is S.STARTING  # the first attempt's OOM no longer counts
    assert st.eager_fallback and "(eager fallback)" in (st.phase or "")


def test_unknown_is_not_final() -> None:
    assert not S.UNKNOWN.final
    assert all(s.final for s in (S.FAILED, S.FINISHED, S.CANCELLED, S.LOST))


# -- the absence count (record.extra only: no store) -----------------------------------------------------


def test_absence_counts_fresh_answers_and_restarts_on_a_sign_of_life() -> None:
    from pbs_toolkit.jobs.status import note_absence

    rec = record()
    assert note_absence(None, rec, [10, 1], counted=True).polls == 1
    assert note_absence(None, rec, [10, 1], counted=False).polls == 1  # the last answer reused: no count
    assert note_absence(None, rec, [10, 1], counted=True).polls == 2
    assert note_absence(None, rec, [11, 1], counted=True).polls == 1  # the log grew: alive, start over
    rec.extra["sched_absence"] = "garbage"
    assert note_absence(None, rec, [11, 1], counted=True).polls == 1


def test_judge_writes_nothing_and_hands_back_what_the_record_keeps() -> None:
    """jobs/judge.py is pure: the absence count and the verified address come back as values; remember.py writes."""
    import copy

    from pbs_toolkit.jobs.judge import judge
    from pbs_toolkit.jobs.rundir import VERIFIED_KEY, RunDirView
    from pbs_toolkit.jobs.status_types import ABSENCE_KEY
    from pbs_toolkit.transports.http import Identity

    rec = record()
    before = copy.deepcopy(rec.extra)
    _, keep = judge(rec, None, RunDirView(fingerprint=[10, 1]), answered=True, counted=True)
    assert rec.extra == before  # nothing written into the record
    assert keep[ABSENCE_KEY]["polls"] == 1
    view = RunDirView(marker={"phase": "ready", "address": "10.0.0.5", "port": 8000}, health=200,
                      identity=Identity(ours=True))
    st, keep = judge(rec, sched("R"), view)
    assert st.state is S.READY and rec.extra == before
    assert keep[VERIFIED_KEY] == "10.0.0.5:8000"
