"""``pbstk serve`` refusals (one ``pbstk: error:`` line, nothing started), the service state rules, the job
store's schema 4 migration, and the local scheduler's ``begin_at`` / ``after`` waits."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from helpers import MODEL, pbstk, wait_for

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.schedulers import JobRef, Outcome, SchedState
from pbs_toolkit.schedulers.local import LocalScheduler
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.state import ServiceState, service_state
from pbs_toolkit.transports import LocalRunner

ROUTER = Path(sys.executable).parent / "vllm-router"


def profile(home: Path, extra: str = "") -> None:
    directory = home / "config" / "pbstk" / "profiles"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "svc.yaml").write_text(
        "name: svc\nscheduler: local\nnodes: 1\ngpus_per_node: 1\ncpus_per_node: 2\nwalltime: '00:10:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nrouter_command: {ROUTER}\n{extra}")


def refused(*args: str) -> str:
    result = pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.output
    assert not JobStore().all() and not JobStore().service_rows()  # nothing started, nothing recorded
    return lines[0]


def test_keep_alive_refused_by_the_queue_limit_and_by_a_long_handover(isolated_user: Path) -> None:
    profile(isolated_user, "max_running_jobs: 1\n")
    line = refused("--replicas", "1", "--keep-alive")
    assert "needs 2 jobs running at once" in line and "max_running_jobs" in line
    profile(isolated_user, "max_running_jobs: 4\n")
    line = refused("--replicas", "3", "--keep-alive")
    assert "needs 6 jobs" in line and "allows 4" in line
    line = refused("--replicas", "2", "--keep-alive", "--walltime", "00:10:00", "--handover", "10m")
    assert "not shorter than the walltime" in line


def test_a_fixed_port_with_several_replicas_on_the_local_scheduler_is_refused(isolated_user: Path) -> None:
    profile(isolated_user)
    line = refused("--replicas", "2", "--port", "8123")
    assert "--port 8123 with --replicas 2 on the local scheduler" in line and "leave --port out" in line
    line = refused("--replicas", "1", "--keep-alive", "--port", "8123")
    assert "--port 8123 with --keep-alive" in line
    # (without --port, or with --port auto, each replica picks a free port: tests/test_service.py serves so)


def test_bad_replicas_router_and_names(isolated_user: Path) -> None:
    profile(isolated_user)
    assert "at least 1 replica" in refused("--replicas", "0")
    assert "at least 1 replica" in refused("--replicas", "-2")
    assert "service name" in refused("--name", "bad name")
    assert "--handover" in refused("--keep-alive", "--handover", "soon")
    profile(isolated_user, "router: job\n")
    line = refused("--replicas", "2", "--keep-alive")
    assert "router inside a job ends at its walltime" in line and "use router: login for --keep-alive" in line
    (isolated_user / "config" / "pbstk" / "profiles" / "svc.yaml").write_text(
        "name: svc\nscheduler: local\ngpus_per_node: 1\naddress: loopback\nrouter_command: /nonexistent/router\n")
    assert "router command '/nonexistent/router' not found" in refused()


def test_unknown_service_and_bad_profile_keys(isolated_user: Path) -> None:
    result = pbstk("service", "resume", "nosuch")
    assert result.exit_code == 7 and result.stderr.strip() == (
        "pbstk: error: unknown service 'nosuch': `pbstk status` lists the services pbstk knows"), result.output
    result = pbstk("cancel", "nosuch")
    assert result.exit_code == 7 and result.stderr.count("\n") == 1, result.output
    profile(isolated_user, "router_policy: fastest\n")
    result = pbstk("serve", MODEL, "--profile", "svc")
    assert result.exit_code == 2 and "router_policy" in result.stderr, result.output


def rec(replicas: int = 3, ever: bool = False) -> ServiceRecord:
    return ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=replicas, request={},
                         slots=[Slot(i, current=f"{i}.x") for i in range(replicas)], ever_ready=ever)


def test_service_states() -> None:
    r = rec()
    assert service_state(r, 0) is ServiceState.STARTING and service_state(r, 2) is ServiceState.STARTING
    assert service_state(r, 3) is ServiceState.READY
    r.ever_ready = True
    assert service_state(r, 2) is ServiceState.DEGRADED and service_state(r, 0) is ServiceState.DOWN
    r.ended, r.state = time.time(), "CANCELLED"  # as the record keeps it: a plain string
    assert service_state(r, 0) is ServiceState.CANCELLED
    assert f"{service_state(r, 0)} 0/3" == "CANCELLED 0/3" and json.dumps(service_state(r, 0)) == '"CANCELLED"'


def test_schema_3_store_gains_the_services_table_and_keeps_its_jobs(isolated_user: Path) -> None:
    path = isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    store = JobStore(path)
    store.service_rows()  # creates nothing when missing
    from pbs_toolkit.jobs.store import JobRecord

    store.add(JobRecord("1.h.local", "local", "local", "m", "m", "single", "old", str(isolated_user)))
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE services")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    again = JobStore(path)
    assert [r.job_id for r in again.all()] == ["1.h.local"]
    again.put_service("s", "", time.time(), "{}", "k")
    assert again.service_rows("s")[0]["api_key"] == "k"
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 4


# -- the local scheduler: begin_at and after ----------------------------------------------------------------


_IDS = iter(range(100, 10**6))


def _submit(run_dir: Path, **kw: object) -> tuple[str, JobRef]:
    run_dir.mkdir()
    script = run_dir / "job.pbs"
    script.write_text("#!/bin/bash\necho started >\"$PBS_O_WORKDIR/started\"\nsleep 300\n")
    job_id = LocalScheduler(id_source=_IDS.__next__, find_job=JobStore().find).submit(
        LocalRunner(), str(script), str(run_dir), "t", walltime_s=600, **kw)  # type: ignore[arg-type]
    return job_id, JobRef(job_id, str(run_dir))


def _query(ref: JobRef) -> object:
    return LocalScheduler().query(LocalRunner(), [ref]).get(ref.job_id)


def test_local_begin_at_waits_queued_then_runs_and_a_cancel_while_waiting_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    begin = time.time() + 2.5
    _, ref = _submit(tmp_path / "a", begin_at=begin)
    wait_for(lambda: (tmp_path / "a" / "started").exists(), 30, "the job to start at its time")
    # not before its time (whole seconds: the local scheduler takes int(begin_at); file times may lag a tick)
    assert (tmp_path / "a" / "started").stat().st_mtime >= int(begin) - 0.1
    job = _query(ref)
    # uptime counts from the start, not from the submission 1.5-2.5 s before it
    assert job.state is SchedState.RUNNING and job.uptime_s <= time.time() - int(begin) + 1  # type: ignore[attr-defined]
    assert LocalScheduler().cancel(LocalRunner(), ref)

    # queued in W with its time as comment (an hour ahead: no machine is slow enough to see it start)
    _, waiting = _submit(tmp_path / "b", begin_at=time.time() + 3600)
    job = _query(waiting)
    assert job.state is SchedState.QUEUED and job.raw_state == "W"  # type: ignore[attr-defined]
    assert job.comment.startswith("eligible at ")  # type: ignore[attr-defined]
    assert not (tmp_path / "b" / "started").exists()
    assert LocalScheduler().cancel(LocalRunner(), waiting)
    job = wait_for(lambda: (j := _query(waiting)).state is SchedState.FINISHED and j, 10, "cancelled")
    assert job.outcome is Outcome.CANCELLED and not (tmp_path / "b" / "started").exists()


def test_local_after_waits_until_that_job_has_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs_toolkit.jobs.store import JobRecord

    monkeypatch.setenv("HOME", str(tmp_path))
    for delay in (2.5, 10, 30):  # the second job must be looked at before the first starts: a loaded machine
        begin = time.time() + delay  # that took longer than the delay tries again with a longer one
        first, ref = _submit(tmp_path / f"a{delay}", begin_at=begin)
        JobStore().add(JobRecord(first, "local", "local", "m", "m", "single", "a", str(tmp_path / f"a{delay}")))
        _, later = _submit(tmp_path / f"b{delay}", after=first)
        job = _query(later)
        if time.time() < begin:
            break
        for r in (ref, later):
            LocalScheduler().cancel(LocalRunner(), r)
    assert job.state is SchedState.QUEUED and job.comment == f"waiting for job {first} to start"  # type: ignore[attr-defined]
    wait_for(lambda: (tmp_path / f"b{delay}" / "started").exists(), 10 + delay,
             "the second job to start after the first")
    assert (tmp_path / f"a{delay}" / "started").exists()
    for r in (ref, later):
        LocalScheduler().cancel(LocalRunner(), r)


def test_the_local_pool_is_the_shells_gpus_else_nvidia_smis_and_serve_refuses_what_never_fits(
        isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local scheduler books GPUs (schedulers/local/gpus.py): its pool is what CUDA_VISIBLE_DEVICES names (an
    index or a UUID, in the user's order), else every GPU nvidia-smi lists; a service whose replicas could never
    all hold theirs at once is refused before anything starts (before: the replicas past the machine's GPUs got
    every GPU, shared)."""
    from pbs_toolkit.schedulers.local.gpus import machine_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [(g.entry, g.memory_mib) for g in machine_gpus(LocalRunner())] == [(str(i), 81559) for i in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [g.entry for g in machine_gpus(LocalRunner())] == ["2", "3"]
    uuids = "GPU-dddddddd-3333-3333-3333-333333333333,GPU-bbbbbbbb-1111-1111-1111-111111111111"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids)
    assert [(g.entry, g.memory_mib) for g in machine_gpus(LocalRunner())] == [(u, 81559) for u in uuids.split(",")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_gpus(LocalRunner()) == []  # the shell hides every GPU: nothing to book
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (isolated_user / "config" / "pbstk" / "profiles").mkdir(parents=True, exist_ok=True)
    (isolated_user / "config" / "pbstk" / "profiles" / "svc2.yaml").write_text(
        "name: svc2\nscheduler: local\ngpus_per_node: 2\naddress: loopback\nrouter_command: /bin/true\n")
    result = pbstk("serve", MODEL, "--profile", "svc2", "--preset", "dp2", "--replicas", "3", "--name", "three")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "pbstk: error: the service needs 6 GPU(s) of this machine at once (3 job(s) of 2 GPU(s)), but it has 4 "
        "(CUDA_VISIBLE_DEVICES, else nvidia-smi): the rest would wait for ever; serve fewer replicas or models")
    assert not JobStore().service_rows("three") and not JobStore().all()


def test_a_job_with_exactly_that_name_wins_over_a_service(isolated_user: Path) -> None:
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.store import JobRecord

    store = JobStore()
    store.put_service("twin", "", time.time(), rec(1).data().replace('"name": "s"', '"name": "twin"'), "k")
    store.put_service("solo", "", time.time(), rec(1).data().replace('"name": "s"', '"name": "solo"'), "k")
    store.add(JobRecord("5.h.local", "local", "local", "m", "m", "single", "twin", str(isolated_user)))
    with Client(store) as c:
        assert c.service("twin") is None  # the job named twin wins
        assert c.service("solo") is not None and c.service("solo").name == "solo"  # type: ignore[union-attr]
        assert c.service("5.h.local") is None
    with pytest.raises(Exception, match="already active"):
        store.put_service("solo", "", time.time(), "{}", "k")


def test_a_replica_launch_that_fails_stops_the_router_and_ends_the_service(isolated_user: Path) -> None:
    import json

    profile(isolated_user)
    # a --vllm-arg only a replica's own render refuses (pbstk sets the port itself): after the router started
    result = pbstk("serve", MODEL, "--profile", "svc", "--preset", "single", "--vllm-arg=--port=9", "--name", "half")
    assert result.exit_code == 2 and result.stderr.startswith("pbstk: error: "), result.output
    rows = JobStore().service_rows("half")
    assert rows and rows[0]["ended"] is not None and json.loads(rows[0]["data"])["state"] == "ENDED"
    router = json.loads(rows[0]["data"])["router"]
    if router:  # started before the replica failed: stopped again
        stat = Path(f"/proc/{router['pid']}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", stat.read_text()
    assert not JobStore().all()


def test_ready_counts_replicas_the_router_routes_and_a_normal_start_is_starting() -> None:
    """READY n/N counts a replica only when its job is READY *and* the router lists its server; a start with one
    of two replicas up is STARTING 1/2 (DEGRADED only after the service was READY N/N once, or when the other
    replica ended for good)."""
    from pbs_toolkit.jobs.status import JobStatus, ServerState
    from pbs_toolkit.jobs.store import JobRecord
    from pbs_toolkit.services.ready import routable_count, still_starting

    def st(job: str, state: str, port: int) -> JobStatus:
        record = JobRecord(job_id=job, scheduler="local", profile="p", model="m", served_model_name="m",
                           preset="x", name=job, run_dir="/tmp/x")
        return JobStatus(record=record, state=ServerState(state), address="127.0.0.1", port=port)

    r = rec(replicas=2)
    statuses = {"0.x": st("0.x", "READY", 8001), "1.x": st("1.x", "STARTING", 8002)}
    assert routable_count(r.slots, statuses, []) == 0  # READY jobs, empty router: nothing is routable
    one = ["http://127.0.0.1:8001"]
    assert routable_count(r.slots, statuses, one) == 1
    assert still_starting(r.slots, statuses, one)
    assert service_state(r, 1, still_starting(r.slots, statuses, one)) == "STARTING"
    statuses["1.x"] = st("1.x", "FAILED", 8002)  # nothing more is coming: DEGRADED
    assert not still_starting(r.slots, statuses, one)
    assert service_state(r, 1, still_starting(r.slots, statuses, one)) == "DEGRADED"
    both = [*one, "http://127.0.0.1:8002"]
    statuses["1.x"] = st("1.x", "READY", 8002)
    assert routable_count(r.slots, statuses, both) == 2 and service_state(r, 2, False) is ServiceState.READY
    # a successor routable while its predecessor is not: the slot serves
    r.slots[1].successor = "9.x"
    statuses.update({"1.x": st("1.x", "FAILED", 8002), "9.x": st("9.x", "READY", 8003)})
    assert routable_count(r.slots, statuses, [*both, "http://127.0.0.1:8003"]) == 2
