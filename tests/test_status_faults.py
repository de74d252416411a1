"""Status under a flaky scheduler and foreign servers: what ``status``, ``wait`` and ``env`` may claim.

Jobs run for real under the fake PBS (``qstat_script``/``qdel_script`` faults script its answers) with the
stand-in vLLM. A flaky answer is UNKNOWN for that poll and never final; LOST needs several answers over a
window without a sign of life; READY needs the key-authenticated ``/v1/models`` to list the served name.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, launch, marker, pbstk, set_faults, status_of, until

from pbs_toolkit.jobs.store import JobRecord, JobStore

HEADER = '{"timestamp":1795400000,"pbs_version":"23.06.06","pbs_server":"fakepbs"}'


def unknown(job: str, stdout: str = "") -> dict[str, Any]:
    """A scripted ``qstat: Unknown Job Id`` (rc 153), by default with nothing on stdout."""
    return {"rc": 153, "stdout": stdout, "stderr": f"qstat: Unknown Job Id {job}\n"}


def running_job(monkeypatch: pytest.MonkeyPatch) -> JobRecord:
    """A job whose stand-in logs its startup and never listens: STARTING for as long as the test likes."""
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")
    record = launch()
    until(lambda: marker(record).get("phase") == "starting", 20, "the start script to run")
    return record


# -- flaky answers: UNKNOWN for that poll, nothing recorded -------------------------------------------------


def test_unknown_job_burst_then_running_is_never_lost(fakepbs: Path, standins: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    record = running_job(monkeypatch)
    job = record.job_id
    set_faults(fakepbs, qstat_script=[unknown(job), unknown(job), unknown(job, HEADER), unknown(job, HEADER)])
    for _ in range(4):
        st = status_of(job)
        assert st["state"] == "UNKNOWN", st
        assert JobStore().find(job).final_state is None
    st = status_of(job)  # the real qstat again: R
    assert st["state"] == "STARTING" and st["scheduler_state"] == "R"
    assert JobStore().find(job).extra.get("sched_absence") is None  # seen again: the count starts over
    result = pbstk("wait", job, "--timeout", "1")  # wait agrees: still starting, not ended
    assert result.exit_code == 6 and "(state STARTING" in result.stderr, result.output
    pbstk("cancel", job)


def test_every_garbled_answer_is_unknown_for_that_poll(fakepbs: Path, standins: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    job = launch().job_id
    answers = [
        (unknown(job), "qstat printed nothing (exit 153)"),
        ({"rc": 0, "stdout": ""}, "qstat printed nothing (exit 0)"),
        ({"rc": 0, "stdout": HEADER}, f"qstat exited 0 without listing {job}"),
        ({"stdout": "{garbage"}, "invalid JSON"),
        ({"stdout": '{"Jobs": [1, 2]}'}, "unexpected shape"),
        ({"rc": 137, "stderr": "Killed\n"}, "qstat was killed (exit 137)"),
        ({"signal": 9}, "qstat was killed (exit -9)"),
    ]
    set_faults(fakepbs, qstat_script=[entry for entry, _ in answers])
    for entry, words in answers:
        result = pbstk("status", job, "--json")
        assert result.exit_code == 0, (entry, result.output)
        st = json.loads(result.stdout)[0]
        assert st["state"] == "UNKNOWN" and words in st["reason"], (entry, st)
        assert st["scheduler_state"] == "?"
        assert JobStore().find(job).final_state is None
    assert status_of(job)["state"] == "PENDING"


def test_hung_qstat_is_unknown_within_its_own_timeout(fakepbs: Path, standins: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    job = launch().job_id
    monkeypatch.setenv("PBSTK_SCHEDULER_TIMEOUT_S", "2")
    set_faults(fakepbs, qstat_script=[{"hang": 60}])
    begin = time.monotonic()
    result = pbstk("status", job, "--json")
    took = time.monotonic() - begin
    assert result.exit_code == 0, result.output
    st = json.loads(result.stdout)[0]
    assert st["state"] == "UNKNOWN" and "qstat did not answer within 2 s" in st["reason"], st
    assert 2 <= took < 10, took  # not the transport's 60 s, not 4 retries
    assert JobStore().find(job).final_state is None


def test_hung_qdel_exits_9(fakepbs: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    job = launch().job_id
    monkeypatch.setenv("PBSTK_SCHEDULER_TIMEOUT_S", "2")
    set_faults(fakepbs, qdel_script=[{"hang": 60}, {"signal": 9}])
    begin = time.monotonic()
    result = pbstk("cancel", job)
    assert result.exit_code == 9, result.output  # the scheduler did not answer: not exit 4, the SSH code
    assert result.stderr.strip() == "pbstk: error: qdel did not answer within 2 s"
    assert time.monotonic() - begin < 10
    result = pbstk("cancel", job)
    assert result.exit_code == 9 and "was killed" in result.stderr, result.output
    assert pbstk("cancel", job).exit_code == 0


# -- LOST: only after several answers over a window, never while the run directory is alive ------------------


def test_lost_only_after_three_answers_over_the_window(fakepbs: Path, standins: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    window = 1.5
    monkeypatch.setenv("PBSTK_LOST_AFTER_S", str(window))
    record = running_job(monkeypatch)
    job = record.job_id
    set_faults(fakepbs, vanish=[job])  # unknown to qstat from now on; its processes are killed
    seen: list[tuple[float, str]] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = status_of(job)
        seen.append((time.monotonic(), st["state"]))
        if st["state"] != "UNKNOWN":
            break
        time.sleep(0.2)
    states = [state for _, state in seen]
    assert states[-1] == "LOST" and set(states[:-1]) == {"UNKNOWN"}, states
    # the count restarts while the run directory still changes (the kill): count from the last streak
    absence = JobStore().find(job).extra["sched_absence"]
    assert absence["polls"] >= 3
    assert seen[-1][0] - seen[-absence["polls"]][0] >= window - 0.3, seen
    assert JobStore().find(job).final_state == "LOST"


def test_forgotten_but_answering_is_never_lost_nor_ready(fakepbs: Path, standins: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_LOST_AFTER_S", "0")
    record = launch("--wait")
    job = record.job_id
    set_faults(fakepbs, qstat_script=[unknown(job, HEADER)] * 5)
    for _ in range(4):
        st = status_of(job)
        assert st["state"] == "UNKNOWN" and "its server still answers" in st["reason"], st
    result = pbstk("env", job)  # no export of a URL the scheduler does not vouch for
    assert result.exit_code == 5 and "is UNKNOWN, not READY" in result.stderr, result.output
    assert JobStore().find(job).final_state is None
    assert status_of(job)["state"] == "READY"
    pbstk("cancel", job)


# -- READY means the server proved it is ours -----------------------------------------------------------------


class _Foreign(BaseHTTPRequestHandler):
    """Another job's server: /health for anyone, /v1/models only with its own key."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        code, body = (200, b"") if self.path == "/health" else (401, b'{"error": "Unauthorized"}')
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def foreign_server() -> Iterator[list[ThreadingHTTPServer]]:
    """Start with ``servers.append(ThreadingHTTPServer(...))``; every one is shut down at the end."""
    servers: list[ThreadingHTTPServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def test_another_server_on_the_jobs_port_is_not_ready(fakepbs: Path, standins: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      foreign_server: list[ThreadingHTTPServer]) -> None:
    record = running_job(monkeypatch)  # our server never listens ...
    port = int(marker(record)["port"])
    server = ThreadingHTTPServer(("127.0.0.1", port), _Foreign)  # ... and another one takes its port
    foreign_server.append(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    until(lambda: marker(record).get("phase") == "ready", 10, "the start script to take the port for ours")
    st = status_of(record.job_id)
    assert st["state"] == "STARTING", st
    assert st["phase"] == f"port {port} answered by another server (it rejected the API key (401))"
    assert "verified_endpoint" not in JobStore().find(record.job_id).extra
    result = pbstk("env", record.job_id)
    assert result.exit_code == 5 and "is STARTING, not READY" in result.stderr, result.output
    assert "OPENAI_BASE_URL" not in result.stdout
    pbstk("cancel", record.job_id)


def test_ready_is_verified_once_per_address(fakepbs: Path, standins: Path) -> None:
    record = launch("--wait")
    m = marker(record)
    assert JobStore().find(record.job_id).extra["verified_endpoint"] == f"{m['address']}:{m['port']}"
    assert status_of(record.job_id)["state"] == "READY"
    result = pbstk("env", record.job_id)
    assert result.exit_code == 0 and f"http://{m['address']}:{m['port']}/v1" in result.stdout, result.output
    pbstk("cancel", record.job_id)


# -- scale and isolation ---------------------------------------------------------------------------------------


def fabricated(tmp_path: Path, index: int, marker_bytes: bytes) -> JobRecord:
    """A record of job ``index``.fakepbs whose run directory holds ``marker_bytes`` as server.json."""
    run_dir = tmp_path / f"run{index}"
    run_dir.mkdir()
    (run_dir / "server.json").write_bytes(marker_bytes)
    record = JobRecord(job_id=f"{index}.fakepbs", scheduler="pbs", profile="generic-pbspro", model=MODEL,
                       served_model_name=MODEL, preset="dp4", name=f"job{index}", run_dir=str(run_dir),
                       api_key="k")
    JobStore().add(record)
    return record


def running_answer(ids: list[str]) -> str:
    jobs = {job: {"job_state": "R", "exec_host": "localhost/0"} for job in ids}
    return json.dumps({"timestamp": 1, "pbs_version": "23.06.06", "pbs_server": "fakepbs", "Jobs": jobs})


def test_hung_servers_are_probed_concurrently(fakepbs: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs_toolkit.jobs.status import status

    timeout = 2.0
    monkeypatch.setenv("PBSTK_PROBE_TIMEOUT_S", str(timeout))
    hung = []
    try:
        for _ in range(10):  # the kernel completes the handshake; nobody ever reads or answers
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(4)
            hung.append(sock)
        records = [fabricated(tmp_path, i + 1, json.dumps(
            {"phase": "ready", "address": "127.0.0.1", "port": sock.getsockname()[1]}).encode())
            for i, sock in enumerate(hung)]
        set_faults(fakepbs, qstat_script=[{"stdout": running_answer([r.job_id for r in records])}])
        begin = time.monotonic()
        results = status(records, JobStore())
        took = time.monotonic() - begin
    finally:
        for sock in hung:
            sock.close()
    assert [st.state.value for st in results] == ["STARTING"] * 10
    assert timeout <= took < 4 * timeout, took  # one after another: 10 x 2 s


def test_one_bad_marker_spoils_only_its_own_row(fakepbs: Path, tmp_path: Path) -> None:
    bad = {1: b'{"phase": "ready", "address": "127.0.0.1", "port": "abc"}', 2: b'["phase", "ready"]',
           3: b'\xff\xfe{"phase": "ready"}', 4: b'{"phase": "ready", "port": 1, "address": ["x"]}'}
    records = [fabricated(tmp_path, index, raw) for index, raw in bad.items()]
    good = fabricated(tmp_path, 5, b'{"phase": "starting", "address": "127.0.0.1", "port": 1}')
    set_faults(fakepbs, qstat_script=[{"stdout": running_answer([r.job_id for r in [*records, good]])}])
    result = pbstk("status", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["job_id"]: row for row in json.loads(result.stdout)}
    assert rows[good.job_id]["state"] == "STARTING" and rows[good.job_id]["reason"] is None
    assert "port 'abc' is not a port number" in rows["1.fakepbs"]["reason"]
    assert "not a JSON object" in rows["2.fakepbs"]["reason"]
    assert "not valid JSON" in rows["3.fakepbs"]["reason"]
    assert "address ['x'] is not a string" in rows["4.fakepbs"]["reason"]
    assert all(rows[r.job_id]["state"] == "STARTING" for r in records)
