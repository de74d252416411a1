"""A server that says it is ready but cannot be reached from here (DNS, route, refused) is named as such.

Before: the job stayed STARTING "ready" forever, and `wait` ran to its timeout pointing at the log.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from helpers import MODEL, launch, marker, pbstk, status_of, until

from pbs_toolkit.jobs.judge import judge
from pbs_toolkit.jobs.rundir import look
from pbs_toolkit.jobs.status import ServerState
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.schedulers import SchedState, SchedulerJob
from pbs_toolkit.transports.local import LocalRunner


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_refused_address_is_named_in_the_status(tmp_path: Path) -> None:
    port = _closed_port()
    (tmp_path / "server.json").write_text(json.dumps({"phase": "ready", "address": "127.0.0.1", "port": port}))
    record = JobRecord(job_id="1.fakepbs", scheduler="pbs", profile="generic-pbspro", model=MODEL,
                       served_model_name=MODEL, preset="dp4", name="job", run_dir=str(tmp_path), api_key="k")
    sched = SchedulerJob("1.fakepbs", SchedState.RUNNING, "R")
    st, _ = judge(record, sched, look(LocalRunner(), record, sched))
    assert st.state is ServerState.STARTING
    assert st.phase == st.unreachable
    assert st.unreachable is not None and st.unreachable.startswith(
        f"server reports ready, but http://127.0.0.1:{port} cannot be reached from here: ")
    assert "refused" in st.unreachable.lower(), st.unreachable


def test_unresolvable_address_in_status_and_wait(fakepbs: Path, standins: Path, isolated_user: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's name as the profile makes it does not resolve here: status says so, wait fails with it."""
    (isolated_user / "config" / "pbstk").mkdir(parents=True)
    (isolated_user / "config" / "pbstk" / "config.yaml").write_text("address_suffix: .pbstk-test.invalid\n")
    monkeypatch.setenv("PBSTK_UNREACHABLE_GRACE_S", "1")
    record = launch()
    until(lambda: marker(record).get("phase") == "ready", 30, "the start script to report ready")
    address = marker(record)["address"]
    assert address.endswith(".pbstk-test.invalid")
    st = status_of(record.job_id)
    assert st["state"] == "STARTING", st
    expected = f"server reports ready, but http://{address}:{st['port']} cannot be reached from here: "
    assert st["unreachable"].startswith(expected) and st["phase"] == st["unreachable"], st
    table = pbstk("status", record.job_id)
    assert expected in table.stdout, table.output
    start = time.monotonic()
    result = pbstk("wait", record.job_id, "--timeout", "60")
    assert result.exit_code == 5, result.output
    assert expected in result.stderr and "vllm.log" not in result.stderr, result.stderr
    assert time.monotonic() - start < 20
    pbstk("cancel", record.job_id)
