"""Issue 11: nothing lost, nothing foreign. ``pbstk launch`` is a real subprocess killed with SIGTERM, SIGHUP
and SIGKILL at scripted points of a slow fake ``qsub`` (the job exists before qsub prints its id); afterwards
``pbstk jobs`` must know the job and ``pbstk cancel`` must stop it: no job runs that pbstk does not know.
Then races (one name, 12 launches at once; distinct local ids) and PGID reuse by an unrelated process."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import MODEL, fake_jobs, pbstk, set_faults, until

from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schedulers import JobRef
from pbs_toolkit.schedulers.local import LocalScheduler
from pbs_toolkit.transports import LocalRunner

PBS_LAUNCH = ["launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto"]


@pytest.fixture
def pbs(fakepbs: Path, standins: Path) -> Path:
    return fakepbs


def start_launch(*args: str) -> subprocess.Popen[str]:
    """``pbstk launch`` as a separate process with this test's isolated environment."""
    return subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args],  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def qsub_started(home: Path) -> bool:
    """The fake created the job (it sleeps before printing the id with ``slow_qsub``)."""
    return bool(fake_jobs(home))


def assert_no_orphans(home: Path) -> None:
    """Every job the fake PBS still runs is one ``pbstk jobs`` knows, and ``pbstk cancel`` stops it."""
    listed = pbstk("jobs", "--all", "--json")
    assert listed.exit_code == 0, listed.output
    known = {r["job_id"] for r in json.loads(listed.stdout)}
    live = {job for job, state in fake_jobs(home).items() if state != "F"}
    assert live <= known, f"orphans: {live - known}"
    for job in sorted(live):
        assert pbstk("cancel", job).exit_code == 0
    until(lambda: all(s == "F" for s in fake_jobs(home).values()), 10, "every job to end")


@contextmanager
def store_write_locked() -> Iterator[None]:
    """Hold the job store's write lock (another pbstk in a long transaction)."""
    conn = sqlite3.connect(JobStore().path, timeout=5)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.rollback()
        conn.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_during_qsub_are_held_until_recorded(pbs: Path, sig: signal.Signals) -> None:
    set_faults(pbs, slow_qsub=2.0)
    proc = start_launch(*PBS_LAUNCH, "--name", "sig")
    until(lambda: qsub_started(pbs), 60, "qsub to create the job")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err
    assert "was submitted and recorded" in err and "Traceback" not in err
    [job] = fake_jobs(pbs)
    assert JobStore().find("sig").job_id == job  # recorded by the launch itself
    assert_no_orphans(pbs)


def test_sigkill_during_qsub_the_job_is_adopted(pbs: Path) -> None:
    set_faults(pbs, slow_qsub=2.0)
    proc = start_launch(*PBS_LAUNCH, "--name", "k9")
    until(lambda: qsub_started(pbs), 60, "qsub to create the job")
    proc.kill()
    proc.wait(10)
    [job] = fake_jobs(pbs)
    # qsub outlives pbstk and its wrapper leaves RUN_DIR/job_id; the next `jobs` adopts the job. The call that
    # adopts may list it only on the next call: the marker can appear between its records and its intents look
    # (a machine under load showed it), so the warning is looked for in every call's stderr
    said: list[str] = []

    def listed() -> bool:
        r = pbstk("jobs")
        said.append(r.stderr)
        return r.exit_code == 0 and job in r.stdout

    until(listed, 10, "adoption")
    assert sum(f"adopted job {job}" in err for err in said) == 1, said  # adopted once, and said so
    assert_no_orphans(pbs)


def test_sigkill_between_qsub_and_the_store_write(pbs: Path) -> None:
    set_faults(pbs, slow_qsub=1.5)
    proc = start_launch(*PBS_LAUNCH, "--name", "gap")
    until(lambda: qsub_started(pbs), 60, "qsub to create the job")
    runs = Path(os.environ["PBSTK_RUNS_ROOT"])
    with store_write_locked():  # qsub has answered; pbstk now waits to record the id
        until(lambda: list(runs.glob("gap-*/job_id")), 10, "qsub to answer")
        time.sleep(0.2)
        proc.kill()
        proc.wait(10)
    [job] = fake_jobs(pbs)
    assert JobStore().find("gap").job_id == job
    assert_no_orphans(pbs)


def test_store_locked_after_submit_names_the_job_and_how_to_stop_it(pbs: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_STORE_TIMEOUT", "0.5")
    set_faults(pbs, slow_qsub=1.5)
    proc = start_launch(*PBS_LAUNCH, "--name", "locked")
    until(lambda: qsub_started(pbs), 60, "qsub to create the job")
    with store_write_locked():
        _, err = proc.communicate(timeout=20)
    [job] = fake_jobs(pbs)
    assert proc.returncode == 10, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), err
    assert job in err and f"qdel {job}" in err and f"pbstk cancel {job}" in err and "jobs.sqlite3" in err
    assert_no_orphans(pbs)


def test_a_failed_qsub_leaves_nothing(pbs: Path) -> None:
    set_faults(pbs, qsub_reject="qsub: Unknown queue")
    result = pbstk(*PBS_LAUNCH, "--name", "nope")
    assert result.exit_code == 3
    assert JobStore().all() == [] and JobStore().intents() == []
    assert not list(Path(os.environ["PBSTK_RUNS_ROOT"]).iterdir())


# -- races and reuse ----------------------------------------------------------------------------------


def test_one_name_launched_12_times_at_once_gives_one_job(pbs: Path) -> None:
    procs = [start_launch(*PBS_LAUNCH, "--name", "same") for _ in range(12)]
    results = [(p.wait(60), p.stderr.read() if p.stderr else "") for p in procs]
    for p in procs:
        for stream in (p.stdout, p.stderr):
            if stream:
                stream.close()
    codes = sorted(rc for rc, _ in results)
    assert codes == [0] + [2] * 11, results
    assert all("already active" in err for rc, err in results if rc == 2)
    assert len(fake_jobs(pbs)) == 1
    assert [r.name for r in JobStore().all()] == ["same"]
    assert_no_orphans(pbs)


LOCAL_LAUNCH = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single",
                "--port", "auto"]


def test_parallel_local_launches_get_distinct_ids(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")  # each job ends at once: no 12 servers
    procs = [start_launch(*LOCAL_LAUNCH, "--name", f"par{i}") for i in range(12)]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    records = JobStore().all()
    ids = [r.job_id for r in records]
    assert len(records) == 12 and len(set(ids)) == 12
    assert all(Path(r.run_dir, "job_id").read_text().strip() == r.job_id for r in records)


def _take_ids(path: str, count: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = JobStore(Path(path))
    out.put([store.next_id("local") for _ in range(count)])


def test_90_concurrent_local_ids_are_distinct_and_never_replace(tmp_path: Path) -> None:
    path = tmp_path / "ids" / "jobs.sqlite3"
    JobStore(path).all()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_take_ids, args=(str(path), 3, queue)) for _ in range(30)]
    for proc in procs:
        proc.start()
    ids = [i for _ in procs for i in queue.get(timeout=60)]
    for proc in procs:
        proc.join(30)
    assert len(ids) == 90 and len(set(ids)) == 90

    store = JobStore(path)
    record = JobRecord(job_id="1.host.local", scheduler="local", profile="local", model="m", served_model_name="m",
                       preset="single", name="a", run_dir="/r/a")
    store.add(record)
    with pytest.raises(Exception, match="already recorded"):
        store.add(JobRecord(**{**record.__dict__, "name": "b"}))
    assert [r.name for r in store.all()] == ["a"]  # a duplicate never replaces


def test_cancel_never_signals_a_reused_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = run_dir / "job.pbs"
    script.write_text("#!/bin/bash\n#PBS -l walltime=00:10:00\nsleep 300\n")
    job_id = LocalScheduler(id_source=lambda: 1).submit(LocalRunner(), str(script), str(run_dir), "t")
    pid_file = run_dir / ".local-job" / "pid"
    os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # died uncleanly: no exit status
    stranger = subprocess.Popen(["setsid", "sleep", "300"])  # noqa: S603,S607
    try:
        until(lambda: os.getpgid(stranger.pid) == stranger.pid, 5, "the stranger's own group")
        pid_file.write_text(f"{stranger.pid}\n")  # its PGID now equals the recorded one
        ref = JobRef(job_id, str(run_dir))
        job = LocalScheduler().query(LocalRunner(), [ref])[job_id]
        assert job.raw_state == "F"  # not "running": that group is not the job's
        assert LocalScheduler().cancel(LocalRunner(), ref) is False
        time.sleep(0.2)
        assert stranger.poll() is None, "cancel killed an unrelated process"

        # recorded final: `pbstk cancel` does not touch it at all
        JobStore().add(JobRecord(job_id=job_id, scheduler="local", profile="local", model="m",
                                 served_model_name="m", preset="single", name="dead", run_dir=str(run_dir),
                                 final_state="CANCELLED"))
        (run_dir / ".local-job" / "token").unlink()  # even a job from an older pbstk (no token)
        result = pbstk("cancel", job_id)
        assert result.exit_code == 0 and result.stdout.strip() == f"{job_id}: already ended"
        time.sleep(0.2)
        assert stranger.poll() is None, "cancel killed an unrelated process"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("damage", ["empty", "garbage", "deleted"])
def test_a_lost_store_readopts_jobs_from_their_run_directories(pbs: Path, damage: str) -> None:
    result = pbstk(*PBS_LAUNCH, "--name", "kept")
    assert result.exit_code == 0, result.output
    before = JobStore().find("kept")
    path = JobStore().path
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"" if damage == "empty" else b"\x13garbage" * 100)
        os.utime(path, (time.time() - 60, time.time() - 60))
    listed = pbstk("jobs")
    assert listed.exit_code == 0 and before.job_id in listed.stdout, listed.output
    assert f"re-adopted 1 job(s) from their run directories: {before.job_id}" in listed.stderr
    after = JobStore().find("kept")
    assert (after.run_dir, after.api_key, after.name) == (before.run_dir, before.api_key, before.name)
    assert_no_orphans(pbs)


def test_a_full_disk_refuses_the_launch_before_anything_is_submitted(pbs: Path) -> None:
    store = JobStore()
    store.add(JobRecord(job_id="0.old", scheduler="pbs", profile="p", model="m", served_model_name="m",
                        preset="dp4", name="old", run_dir="/r/old", final_state="FINISHED"))
    size = 1024  # smaller than one page of the store or its journal: every write fails

    def full_disk() -> None:  # no byte more for the store: what a full file system gives sqlite
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    proc = subprocess.run([sys.executable, "-m", "pbs_toolkit", *PBS_LAUNCH, "--name", "full"],  # noqa: S603
                          capture_output=True, text=True, timeout=60, preexec_fn=full_disk)  # noqa: PLW1509
    assert proc.returncode == 10, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: ") and str(store.path) in lines[0], proc.stderr
    assert fake_jobs(pbs) == {}  # refused before qsub
    assert [r.name for r in JobStore().all()] == ["old"]


@pytest.mark.ssh
def test_an_interrupted_ssh_launch_is_adopted_by_the_next_launch_through_that_host(
        pbs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a login node the run directory is remote: the next launch through it reads the marker."""
    from sshd import start_sshd

    from pbs_toolkit.schedulers.pbs import PBSScheduler

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    passed = {k: v for k, v in os.environ.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))}
    with start_sshd(tmp_path / "login", passed) as info:
        monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
        monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
        original = PBSScheduler.submit

        def submit_then_raise(self: PBSScheduler, *args: object, **kw: object) -> str:
            original(self, *args, **kw)  # type: ignore[arg-type]
            raise KeyboardInterrupt

        monkeypatch.setattr(PBSScheduler, "submit", submit_then_raise)
        ssh_launch = [*PBS_LAUNCH, "--ssh", "pbstk-test", "--name", "remote"]
        assert pbstk(*ssh_launch).exit_code == 130
        monkeypatch.setattr(PBSScheduler, "submit", original)
        [job] = fake_jobs(pbs)
        assert "the launch of 'remote' via pbstk-test is not recorded yet" in pbstk("jobs").stderr
        gone = subprocess.Popen(["sleep", "0"])  # noqa: S603,S607
        gone.wait()
        with sqlite3.connect(JobStore().path) as conn:  # as if that launch had been a process that is gone now
            conn.execute("UPDATE intents SET launcher = ?", (f"{os.uname().nodename}:{gone.pid}:1",))
        conn.close()

        again = pbstk(*ssh_launch)
        assert again.exit_code == 2 and f"already active ({job}" in again.stderr, again.output
        assert f"adopted job {job}" in again.stderr
        assert JobStore().find("remote").transport == "pbstk-test"
        assert JobStore().intents() == []
        assert_no_orphans(pbs)
