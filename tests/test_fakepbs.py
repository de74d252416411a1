"""Tests for the fake OpenPBS in tests/fakepbs: it must behave like the real tools, quirks included."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

BIN = Path(__file__).parent / "fakepbs" / "bin"


class FakePbs:
    """A fake PBS server in a temp directory, with helpers that poll with a deadline."""

    def __init__(self, root: Path) -> None:
        self.home = root / "pbshome"
        self.user_home = root / "userhome"
        self.submit_dir = root / "submit"
        for d in (self.home, self.user_home, self.submit_dir):
            d.mkdir()
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "FAKEPBS_HOME": str(self.home),
            "HOME": str(self.user_home),
            "FAKEPBS_EXITING_DELAY": "0.1",
            "FAKEPBS_KILL_DELAY": "0.5",
            "FAKEPBS_HOLD_DELAY": "0.1",
        }
        self.env.pop("FAKEPBS_SERVER", None)

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # noqa: S603 - fixed argv of the fake tools
            list(argv), cwd=self.submit_dir, env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=60, check=False,  # bounded; 20 s was seen run out under CI load
        )

    def script(self, body: str, name: str = "job.sh") -> Path:
        path = self.submit_dir / name
        path.write_text("#!/bin/bash\n" + body)
        return path

    def submit(self, body: str, *opts: str, env: dict[str, str] | None = None) -> str:
        path = self.script(body)
        res = self.run("qsub", *opts, path.name, env=env)
        assert res.returncode == 0, res.stderr
        assert res.stderr == ""
        return res.stdout.strip()

    def status(self, *ids: str) -> tuple[int, dict[str, Any], str]:
        res = self.run("qstat", "-x", "-f", "-F", "json", *ids)
        return res.returncode, json.loads(res.stdout), res.stderr

    def job(self, jobid: str) -> dict[str, Any]:
        rc, doc, err = self.status(jobid)
        assert rc == 0, err
        return doc["Jobs"][jobid]

    def wait_for(self, check: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError("condition not met before the deadline")
            time.sleep(0.05)

    def wait_state(self, jobid: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
        self.wait_for(lambda: self.job(jobid)["job_state"] == state, timeout)
        return self.job(jobid)

    def faults(self, **faults: Any) -> None:
        (self.home / "faults.json").write_text(json.dumps(faults))

    def calls(self, tool: str) -> list[list[str]]:
        lines = (self.home / "calls.log").read_text().splitlines()
        return [rec["argv"] for rec in map(json.loads, lines) if rec["tool"] == tool]


@pytest.fixture
def pbs(tmp_path: Path) -> Iterator[FakePbs]:
    fake = FakePbs(tmp_path)
    yield fake
    (fake.home / "faults.json").unlink(missing_ok=True)
    seqs = [path.stem for path in (fake.home / "jobs").glob("*.json")]
    if seqs:
        fake.run("qdel", *seqs)  # stop leftover jobs; errors for finished ones are fine


def test_requires_fakepbs_home(pbs: FakePbs) -> None:
    env = {k: v for k, v in pbs.env.items() if k != "FAKEPBS_HOME"}
    res = subprocess.run(["qstat"], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 1 and "FAKEPBS_HOME" in res.stderr


def test_qsub_prints_only_the_id_and_job_runs(pbs: FakePbs) -> None:
    first = pbs.submit("true\n")
    second = pbs.submit("true\n")
    assert re.fullmatch(r"\d+\.fakepbs", first)
    assert int(second.split(".")[0]) == int(first.split(".")[0]) + 1
    job = pbs.wait_state(second, "F")
    assert job["Exit_status"] == 0
    assert pbs.calls("qsub")[0] == ["job.sh"]


def test_server_name_and_short_id(pbs: FakePbs) -> None:
    long_server = "polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"
    pbs.env["FAKEPBS_SERVER"] = long_server
    jobid = pbs.submit("true\n")
    assert jobid == f"1.{long_server}"
    pbs.wait_state(jobid, "F")
    rc, doc, _ = pbs.status("1")  # PBS appends the default server
    assert rc == 0 and list(doc["Jobs"]) == [jobid] and doc["pbs_server"] == long_server
    table = pbs.run("qstat", "-x").stdout
    assert "1.polaris-pbs-0*" in table  # the plain listing truncates ids


def test_json_shape(pbs: FakePbs) -> None:
    jobid = pbs.submit(
        "#PBS -N fromdirective\n#PBS -l walltime=00:05:00\n#PBS -A ignored\necho hi\n",
        "-A", "proj", "-q", "debug", "-l", "select=2:ncpus=8:ngpus=4,filesystems=home:eagle",
        "-l", "place=scatter", "-r", "n", "-k", "doe", "-j", "oe", "-v", "FOO=bar",
    )
    job = pbs.wait_state(jobid, "F")
    rc, doc, _ = pbs.status(jobid)
    assert set(doc) == {"timestamp", "pbs_version", "pbs_server", "Jobs"}
    assert isinstance(doc["timestamp"], int)
    assert job["Job_Name"] == "fromdirective"
    assert job["Account_Name"] == "proj"  # command line wins over #PBS
    assert job["queue"] == "debug"
    assert re.fullmatch(r".+@.+", job["Job_Owner"])
    assert job["Output_Path"].endswith(f":{pbs.submit_dir}/fromdirective.o1")
    assert job["Error_Path"].startswith(job["Output_Path"].split(":")[0] + ":/")
    res = job["Resource_List"]
    assert res["walltime"] == "00:05:00" and res["select"] == "2:ncpus=8:ngpus=4"
    assert res["nodect"] == 2 and res["ncpus"] == 16 and res["ngpus"] == 8
    assert res["place"] == "scatter" and res["filesystems"] == "home:eagle"
    assert job["exec_host"].split("+")[0].endswith("/0*8") and job["exec_host"].count("+") == 1
    assert job["Rerunable"] == "False" and job["Keep_Files"] == "doe" and job["Join_Path"] == "oe"
    assert job["Variable_List"]["FOO"] == "bar"
    assert job["Variable_List"]["PBS_O_WORKDIR"] == str(pbs.submit_dir)
    assert re.fullmatch(r"\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}", job["qtime"])
    assert "stime" in job and "walltime" in job["resources_used"]
    assert job["Exit_status"] == 0


def test_jobs_absent_when_nothing_matches(pbs: FakePbs) -> None:
    rc, doc, err = pbs.status("42")
    assert rc == 153 and "Jobs" not in doc
    assert err.strip() == "qstat: Unknown Job Id 42.fakepbs"


def test_unknown_id_keeps_partial_output(pbs: FakePbs) -> None:
    jobid = pbs.submit("sleep 30\n")
    rc, doc, err = pbs.status(jobid, "999.fakepbs")
    assert rc == 153 and list(doc["Jobs"]) == [jobid]
    assert "Unknown Job Id 999.fakepbs" in err


def test_finished_job_needs_x(pbs: FakePbs) -> None:
    jobid = pbs.submit("exit 3\n")
    assert pbs.wait_state(jobid, "F")["Exit_status"] == 3
    res = pbs.run("qstat", "-f", "-F", "json", jobid)
    assert res.returncode == 35 and "Jobs" not in json.loads(res.stdout)
    assert res.stderr.strip() == (
        f"qstat: {jobid} Job has finished, use -x or -H to obtain historical job information"
    )


def test_job_environment_and_cwd(pbs: FakePbs) -> None:
    out = pbs.submit_dir / "env.txt"
    jobid = pbs.submit(
        f"pwd > {out}\nenv >> {out}\n", "-N", "envjob", "-l", "select=3",
        env={"SECRET_LOGIN_VAR": "x", "PBSTK_TEST_HOOK": "1"},
    )
    pbs.wait_state(jobid, "F")
    lines = out.read_text().splitlines()
    assert lines[0] == str(pbs.user_home)  # jobs start in $HOME, not the submit dir
    env = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert env["PBS_JOBID"] == jobid and env["PBS_JOBNAME"] == "envjob"
    assert env["PBS_O_WORKDIR"] == str(pbs.submit_dir)
    assert env["PBS_ENVIRONMENT"] == "PBS_BATCH" and env["PBS_QUEUE"] == "workq"
    assert "PBS_O_HOST" in env and "TMPDIR" in env and "PBS_O_PATH" in env
    assert "SECRET_LOGIN_VAR" not in env  # no -V
    assert env["PBSTK_TEST_HOOK"] == "1"


def test_nodefile_has_one_line_per_chunk(pbs: FakePbs) -> None:
    out = pbs.submit_dir / "nodes.txt"
    jobid = pbs.submit(f'cp "$PBS_NODEFILE" {out}\n', "-l", "select=3:ncpus=4")
    pbs.wait_state(jobid, "F")
    assert len(out.read_text().splitlines()) == 3


def test_spooled_output_appears_only_at_end(pbs: FakePbs) -> None:
    flag = pbs.submit_dir / "go"
    body = f"echo started\nwhile [ ! -e {flag} ]; do sleep 0.05; done\necho bye >&2\n"
    jobid = pbs.submit(body, "-N", "sp")
    pbs.wait_state(jobid, "R")
    time.sleep(0.3)
    assert not (pbs.submit_dir / "sp.o1").exists()
    flag.touch()
    pbs.wait_state(jobid, "F")
    assert (pbs.submit_dir / "sp.o1").read_text() == "started\n"
    assert (pbs.submit_dir / "sp.e1").read_text() == "bye\n"


def test_keep_doe_writes_in_place(pbs: FakePbs) -> None:
    logs = pbs.submit_dir / "logs"
    logs.mkdir()
    flag = pbs.submit_dir / "go"
    jobid = pbs.submit(
        f"echo started\nwhile [ ! -e {flag} ]; do sleep 0.05; done\n",
        "-k", "doe", "-j", "oe", "-o", "logs/out.log",
    )
    pbs.wait_for(lambda: (logs / "out.log").exists() and (logs / "out.log").read_text() == "started\n")
    assert pbs.job(jobid)["job_state"] == "R"
    flag.touch()
    pbs.wait_state(jobid, "F")
    assert sorted(p.name for p in logs.iterdir()) == ["out.log"]  # -j oe: no error file


def test_missing_output_dir_holds_the_job(pbs: FakePbs) -> None:
    marker = pbs.submit_dir / "ran"
    jobid = pbs.submit(f"touch {marker}\n", "-o", "nope/out.log")
    job = pbs.wait_state(jobid, "H")
    assert job["comment"] == "job held, too many failed attempts to run"
    assert "Exit_status" not in job and not marker.exists()
    assert pbs.run("qdel", jobid).returncode == 0
    assert pbs.wait_state(jobid, "F")["comment"] == "Job deleted"


def test_queue_delay_and_comment(pbs: FakePbs) -> None:
    release = pbs.submit_dir / "release"  # held in Q until the test has looked (a 1 s delay alone races a load)
    submitted = time.time()
    jobid = pbs.submit("true\n", env={"FAKEPBS_QUEUE_DELAY": "1", "FAKEPBS_RELEASE": str(release)})
    job = pbs.job(jobid)
    assert job["job_state"] == "Q" and job["comment"] == "Not Running: Not enough free nodes available"
    assert "exec_host" not in job and "Exit_status" not in job
    release.touch()
    job = pbs.wait_state(jobid, "F")
    assert job["comment"].startswith("Job run at")
    stime = json.loads((pbs.home / "jobs" / f"{jobid.split('.')[0]}.json").read_text())["internal"]["stime"]
    assert stime >= int(submitted) + 1  # the queue delay was served too (stime: whole seconds)


def test_estimated_start_while_queued_and_walltime_used_while_running(pbs: FakePbs) -> None:
    before = int(time.time())
    release = pbs.submit_dir / "release"
    jobid = pbs.submit("sleep 30\n", "-l", "walltime=00:10:30",
                       env={"FAKEPBS_RELEASE": str(release), "FAKEPBS_ESTIMATED_START": "900"})
    job = pbs.job(jobid)
    est = job["estimated"]  # OpenPBS: set on a queued job the scheduler has calendared
    assert set(est) == {"exec_vnode", "start_time"} and re.fullmatch(r"\(\S+:ncpus=\d+\)", est["exec_vnode"])
    start = time.mktime(time.strptime(est["start_time"], "%a %b %d %H:%M:%S %Y"))
    assert before + 900 <= start <= time.time() + 900
    assert job["Resource_List"]["walltime"] == "00:10:30"
    release.touch()
    job = pbs.wait_state(jobid, "R")
    assert "estimated" not in job and job["stime"]
    pbs.wait_for(lambda: pbs.job(jobid)["resources_used"]["walltime"] >= "00:00:01", timeout=30)
    assert pbs.run("qdel", jobid).returncode == 0


def test_walltime_kill(pbs: FakePbs) -> None:
    jobid = pbs.submit("trap '' TERM\nsleep 30\n", "-l", "walltime=1")
    job = pbs.wait_state(jobid, "F", timeout=30)
    assert job["Exit_status"] == -29
    assert re.fullmatch(r"job killed: walltime \d+ exceeded limit 1", job["comment"])


def test_qdel_running_and_finished(pbs: FakePbs) -> None:
    jobid = pbs.submit("sleep 30\n")
    pbs.wait_state(jobid, "R")
    res = pbs.run("qdel", jobid)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
    assert pbs.wait_state(jobid, "F")["Exit_status"] == 271
    res = pbs.run("qdel", jobid)
    assert res.returncode == 35 and res.stderr.strip() == f"qdel: Job has finished {jobid}"
    res = pbs.run("qdel", "77")
    assert res.returncode == 153 and res.stderr.strip() == "qdel: Unknown Job Id 77.fakepbs"


def test_qdel_queued_job(pbs: FakePbs) -> None:
    marker, release = pbs.submit_dir / "ran", pbs.submit_dir / "release"
    jobid = pbs.submit(f"touch {marker}\n", env={"FAKEPBS_RELEASE": str(release)})  # queued until released
    assert pbs.run("qdel", jobid).returncode == 0
    job = pbs.wait_state(jobid, "F")
    assert "Exit_status" not in job and job["comment"] == "Job deleted"
    release.touch()  # what would start it now: a deleted job must not run
    time.sleep(0.5)
    assert not marker.exists()


def test_qdel_escalates_to_sigkill(pbs: FakePbs) -> None:
    jobid = pbs.submit("trap '' TERM\nsleep 30 & wait; sleep 30\n")
    pbs.wait_state(jobid, "R")
    pbs.run("qdel", jobid)
    assert pbs.wait_state(jobid, "F")["Exit_status"] == 265


@pytest.mark.parametrize(
    ("env", "opts", "message"),
    [
        ({"FAKEPBS_REQUIRE_ACCOUNT": "1"}, [], "qsub: Account_Name is required to be set."),
        ({"FAKEPBS_REQUIRE_FILESYSTEMS": "1"}, [], "qsub: Resource: filesystems is required to be set."),
        ({}, ["-l", "walltime=1:xx"], "qsub: illegal -l value"),
        ({"FAKEPBS_MAX_WALLTIME": "3600"}, ["-l", "walltime=02:00:00"],
         "qsub: Job violates queue and/or server resource limits"),
        ({"FAKEPBS_QUEUES": "debug,prod"}, ["-q", "nope"], "qsub: Unknown queue"),
        ({}, ["-k", "x"], "qsub: illegal -k value"),
    ],
)
def test_qsub_validation(pbs: FakePbs, env: dict[str, str], opts: list[str], message: str) -> None:
    path = pbs.script("true\n")
    res = pbs.run("qsub", *opts, path.name, env=env)
    assert res.returncode != 0 and res.stdout == "" and res.stderr.strip() == message
    assert not list((pbs.home / "jobs").glob("*.json"))


def test_qsub_refuses_stdin(pbs: FakePbs) -> None:
    res = subprocess.run(["qsub"], input="true\n", env=pbs.env, capture_output=True, text=True, check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == "qsub: script from standard input is not allowed at this site"


def test_fault_qstat_unavailable(pbs: FakePbs) -> None:
    jobid = pbs.submit("true\n")
    pbs.faults(qstat_unavailable=2)
    for _ in range(2):
        res = pbs.run("qstat", "-x", "-f", "-F", "json", jobid)
        assert res.returncode == 255 and "cannot connect to server fakepbs" in res.stderr
        assert res.stdout == ""
    assert pbs.status(jobid)[0] == 0
    assert len(pbs.calls("qstat")) == 3


def test_fault_vanish_kills_and_hides(pbs: FakePbs) -> None:
    jobid = pbs.submit("sleep 30\n")
    pid = pbs.wait_state(jobid, "R")["session_id"]
    pbs.faults(vanish=[jobid])
    rc, doc, err = pbs.status(jobid)
    assert rc == 153 and "Jobs" not in doc
    pbs.wait_for(lambda: not Path(f"/proc/{pid}").exists())
    assert pbs.run("qdel", jobid).returncode == 153


def test_fault_reject_after_submit(pbs: FakePbs) -> None:
    pbs.faults(reject_after_submit=True)
    jobid = pbs.submit(f"touch {pbs.submit_dir / 'ran'}\n")
    assert re.fullmatch(r"\d+\.fakepbs", jobid)
    rc, doc, _ = pbs.status(jobid)
    assert rc == 153 and "Jobs" not in doc
    time.sleep(0.3)
    assert not (pbs.submit_dir / "ran").exists()


def test_fault_qsub_reject(pbs: FakePbs) -> None:
    pbs.faults(qsub_reject="qsub: Job rejected by all possible destinations")
    path = pbs.script("true\n")
    res = pbs.run("qsub", path.name)
    assert res.returncode == 1 and res.stderr.strip() == "qsub: Job rejected by all possible destinations"


def test_fault_history_off(pbs: FakePbs) -> None:
    jobid = pbs.submit("true\n")
    pbs.wait_state(jobid, "F")
    pbs.faults(history=False)
    rc, doc, err = pbs.status(jobid)
    assert rc == 153 and "Jobs" not in doc and "Unknown Job Id" in err


def test_fault_slow_qstat(pbs: FakePbs) -> None:
    pbs.faults(slow_qstat=0.5)
    start = time.monotonic()
    pbs.status("1")
    assert time.monotonic() - start >= 0.5


def test_numeric_looking_values_are_numbers(pbs: FakePbs) -> None:
    jobid = pbs.submit("true\n", "-N", "12345", "-v", "N=7")
    job = pbs.wait_state(jobid, "F")
    assert job["Job_Name"] == 12345 and job["Variable_List"]["N"] == 7


def test_full_env_with_quotes_breaks_json(pbs: FakePbs) -> None:
    jobid = pbs.submit("true\n", "-V", env={"NASTY": 'say "hi"'})
    res = pbs.run("qstat", "-x", "-f", "-F", "json", jobid)
    with pytest.raises(json.JSONDecodeError):
        json.loads(res.stdout)


def test_text_formats(pbs: FakePbs) -> None:
    jobid = pbs.submit("sleep 300\n", "-N", "textjob")  # still R when qstat lists it, however loaded the machine
    pbs.wait_state(jobid, "R")
    table = pbs.run("qstat").stdout.splitlines()
    assert table[0].startswith("Job id") and any(" R " in line and "textjob" in line for line in table[2:])
    full = pbs.run("qstat", "-f", jobid).stdout
    assert full.startswith(f"Job Id: {jobid}\n") and "    job_state = R" in full


def test_fault_qstat_script_plays_one_entry_per_call(pbs: FakePbs) -> None:
    jobid = pbs.submit("true\n")
    pbs.faults(qstat_script=[
        {"rc": 153, "stdout": "", "stderr": f"qstat: Unknown Job Id {jobid}\n"},
        {"stdout": "{garbage"},
        {"signal": 9},
        {"hang": 0.4},
        {},
    ])
    first = pbs.run("qstat", "-x", "-f", "-F", "json", jobid)
    assert (first.returncode, first.stdout, first.stderr) == (153, "", f"qstat: Unknown Job Id {jobid}\n")
    second = pbs.run("qstat", "-x", "-f", "-F", "json", jobid)
    assert (second.returncode, second.stdout) == (0, "{garbage")
    assert pbs.run("qstat", "-x", "-f", "-F", "json", jobid).returncode == -9  # killed, no answer
    start = time.monotonic()
    assert pbs.status(jobid)[0] == 0  # a bare hang, then the real answer
    assert time.monotonic() - start >= 0.4
    assert pbs.status(jobid)[0] == 0  # {} is the real qstat too
    assert json.loads((pbs.home / "faults.json").read_text())["qstat_script"] == []
    assert pbs.status(jobid)[0] == 0  # and so is an empty script
    assert len(pbs.calls("qstat")) == 6


# --------------------------------------------------------------------------- -a, -W depend, -J, run limits


def load_fake_module() -> Any:
    """tests/fakepbs/fakepbs.py as a module, for its date parser (a port of OpenPBS cvtdate)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fakepbs_mod", BIN.parent / "fakepbs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a_time(epoch: float) -> str:
    """``qsub -a`` in its longest form, this host's local time (as pbstk formats it on the login node)."""
    return time.strftime("%Y%m%d%H%M.%S", time.localtime(epoch))


@pytest.mark.parametrize("value", ["99", "1260", "2400", "12.5", "abc", "202613011200", "1200.60", "12345"])
def test_qsub_a_refuses_bad_times_like_openpbs(pbs: FakePbs, value: str) -> None:
    path = pbs.script("true\n")
    res = pbs.run("qsub", "-a", value, path.name)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("qsub: illegal -a value\nusage: qsub [-a date_time]")
    directive = pbs.script(f"#PBS -a {value}\ntrue\n", name="d.sh")
    assert pbs.run("qsub", directive.name).returncode == 2
    assert not list((pbs.home / "jobs").glob("*.json"))


def test_cvtdate_rolls_forward_like_openpbs() -> None:
    fake = load_fake_module()
    now = time.mktime((2026, 11, 23, 12, 30, 0, 0, 0, -1))
    at = lambda text: time.localtime(fake.cvtdate(text, now))[:6]  # noqa: E731
    assert at("1300") == (2026, 11, 23, 13, 0, 0)
    assert at("1230") == (2026, 11, 24, 12, 30, 0)  # not later than now: tomorrow
    assert at("221300") == (2026, 12, 22, 13, 0, 0)  # a past day: next month
    assert at("10011300") == (2027, 10, 1, 13, 0, 0)  # a past month: next year
    assert at("2611221300.15") == (2026, 11, 22, 13, 0, 15)  # a full date may be in the past
    assert at("202611231245") == (2026, 11, 23, 12, 45, 0)


def test_qsub_a_waits_in_w_then_runs(pbs: FakePbs) -> None:
    when = int(time.time()) + 6
    marker = pbs.submit_dir / "ran"
    jobid = pbs.submit(f"date +%s > {marker}\n", "-a", a_time(when))
    job = pbs.job(jobid)
    assert job["job_state"] == "W" and job["substate"] == 30
    assert job["Execution_Time"] == time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(when))
    assert "comment" not in job and "Exit_status" not in job  # the scheduler has not looked at it yet
    assert not marker.exists()
    pbs.wait_state(jobid, "F", timeout=30)
    assert int(marker.read_text()) >= when


def test_qsub_a_in_the_past_runs_at_once_and_directive_form(pbs: FakePbs) -> None:
    past = pbs.submit("true\n", "-a", a_time(time.time() - 86400 * 3).split(".")[0])
    future = pbs.submit(f"#PBS -a {a_time(time.time() + 600)}\ntrue\n")
    assert pbs.wait_state(past, "F")["Exit_status"] == 0
    assert pbs.job(future)["job_state"] == "W"
    pbs.run("qdel", future)
    job = pbs.wait_state(future, "F")
    assert job["comment"] == "Job deleted" and "Exit_status" not in job


def test_depend_after_waits_for_the_start_only(pbs: FakePbs) -> None:
    release = pbs.submit_dir / "release"
    parent = pbs.submit("sleep 30\n", env={"FAKEPBS_RELEASE": str(release)})
    child = pbs.submit("true\n", "-W", f"depend=after:{parent}")
    _, doc, _ = pbs.status(parent, child)
    job = doc["Jobs"][child]
    assert doc["Jobs"][parent]["job_state"] == "Q"  # one answer: the parent is still queued, so...
    assert (job["job_state"], job["Hold_Types"], job["substate"]) == ("H", "s", 22)  # ...the child is held
    assert job["depend"] == f"after:{parent}@fakepbs" and "comment" not in job
    release.touch()
    pbs.wait_state(parent, "R")
    assert pbs.wait_state(child, "F")["Exit_status"] == 0  # ran while the parent still runs
    assert pbs.job(parent)["job_state"] == "R"


def test_depend_afterok_and_afternotok(pbs: FakePbs) -> None:
    marker = pbs.submit_dir / "go"
    parent = pbs.submit(f"while [ ! -e {marker} ]; do sleep 0.1; done; exit 3\n")
    ok = pbs.submit("true\n", "-W", f"depend=afterok:{parent}")
    notok = pbs.submit("true\n", "-W", f"depend=afternotok:{parent.split('.')[0]}")
    anyway = pbs.submit("#PBS -W depend=afterany:" + parent + "\ntrue\n")
    time.sleep(0.5)
    assert {pbs.job(j)["job_state"] for j in (ok, notok, anyway)} == {"H"}
    marker.touch()  # the parent ends now, with exit 3
    pbs.wait_state(parent, "F")
    assert pbs.wait_state(notok, "F")["Exit_status"] == 0
    assert pbs.wait_state(anyway, "F")["Exit_status"] == 0
    deleted = pbs.wait_state(ok, "F")  # the dependency can never be met: deleted, never ran
    assert "Exit_status" not in deleted and "stime" not in deleted


def test_depend_on_unknown_or_unsatisfiable_parent_aborts_after_qsub_printed_an_id(pbs: FakePbs) -> None:
    # OpenPBS queues the job, then the parent's registration fails (req_register.c): qsub said rc 0
    ghost = pbs.submit("true\n", "-W", "depend=after:4242.fakepbs")
    other_server = pbs.submit("true\n", "-W", "depend=afterok:1.elsewhere")
    done = pbs.submit("true\n")
    pbs.wait_state(done, "F")
    unmet = pbs.submit("true\n", "-W", f"depend=afternotok:{done}")
    met = pbs.submit("true\n", "-W", f"depend=afterok:{done}")
    for jobid in (ghost, other_server, unmet):
        job = pbs.wait_state(jobid, "F")
        assert "Exit_status" not in job and "stime" not in job
    assert pbs.wait_state(met, "F")["Exit_status"] == 0


@pytest.mark.parametrize("value", ["depend=afterok:", "depend=afterok", "depend=later:1", "depend"])
def test_depend_syntax_errors_are_illegal_w(pbs: FakePbs, value: str) -> None:
    path = pbs.script("true\n")
    res = pbs.run("qsub", "-W", value, path.name)
    assert res.returncode == 2 and res.stderr.startswith("qsub: illegal -W value\nusage: qsub")


def test_array_job_ids_states_and_environment(pbs: FakePbs) -> None:
    out = pbs.submit_dir / "out"
    out.mkdir()
    go = pbs.submit_dir / "go"  # the subjobs run until the test has seen the array in B (bounded: 60 s)
    jobid = pbs.submit(f"#PBS -J 1-5:2\necho $PBS_ARRAY_INDEX $PBS_ARRAY_ID $PBS_JOBID > {out}/$PBS_ARRAY_INDEX\n"
                       f"for _ in $(seq 600); do [ -e {go} ] && break; sleep 0.1; done\n")
    seq = jobid.split("[")[0]
    assert jobid == f"{seq}[].fakepbs"
    subs = [f"{seq}[{i}].fakepbs" for i in (1, 3, 5)]
    parent = pbs.wait_state(jobid, "B")
    assert parent["array"] == "True" and parent["array_indices_submitted"] == "1-5:2"
    assert parent["comment"].startswith("Job Array Began at ")
    rc, doc, _ = pbs.status(jobid)
    assert rc == 0 and list(doc["Jobs"]) == [jobid]  # subjobs only with -t
    res = pbs.run("qstat", "-t", "-x", "-f", "-F", "json", jobid)
    listed = json.loads(res.stdout)["Jobs"]
    assert list(listed) == [jobid, *subs]
    assert listed[subs[1]]["array_id"] == jobid and listed[subs[1]]["array_index"] == 3
    assert pbs.run("qstat", seq).returncode == 153  # an array job is N[], never N
    go.touch()
    pbs.wait_for(lambda: all(pbs.job(s)["job_state"] == "X" for s in subs), timeout=30)
    done = pbs.wait_state(jobid, "F")
    assert done["Exit_status"] == 0 and done["array_state_count"] == "Queued:0 Running:0 Exiting:0 Expired:3"
    assert sorted(p.name for p in out.iterdir()) == ["1", "3", "5"]
    assert (out / "3").read_text().split() == ["3", jobid, subs[1]]
    assert (pbs.submit_dir / f"job.sh.o{seq}.5").exists()  # per-subjob output files


def test_array_qdel_stops_every_subjob(pbs: FakePbs) -> None:
    jobid = pbs.submit("sleep 30\n", "-J", "0-2")
    pbs.wait_state(jobid, "B")
    assert pbs.run("qdel", jobid).returncode == 0
    done = pbs.wait_state(jobid, "F", timeout=30)
    assert done["Exit_status"] == 1  # the last subjob to end was killed by qdel (271 > 0: array_func.c says 1)
    seq = jobid.split("[")[0]
    for i in range(3):
        assert pbs.job(f"{seq}[{i}].fakepbs")["job_state"] == "X"
    assert pbs.run("qdel", jobid).returncode == 35


@pytest.mark.parametrize(("opts", "rc", "message"), [
    (["-J", "3-1"], 166, "qsub: Illegal attribute or resource value"),
    (["-J", "1-3:0"], 166, "qsub: Illegal attribute or resource value"),
    (["-J", "5"], 166, "qsub: Illegal attribute or resource value"),
    (["-J", "1-500"], 3, "qsub: Array job exceeds server or queue size limit"),
    (["-r", "n", "-J", "1-3"], 2, "qsub:  cannot submit non-rerunable Array Job"),
])
def test_array_refusals(pbs: FakePbs, opts: list[str], rc: int, message: str) -> None:
    path = pbs.script("true\n")
    res = pbs.run("qsub", *opts, path.name)
    assert res.returncode == rc and res.stderr.splitlines()[0] == message


def test_user_run_limit_keeps_extra_jobs_queued_with_the_openpbs_comment(pbs: FakePbs) -> None:
    limit = {"FAKEPBS_MAX_RUN_PER_USER": "1"}
    first = pbs.submit("sleep 30\n", env=limit)
    pbs.wait_state(first, "R")
    second = pbs.submit("true\n", env=limit)
    pbs.wait_for(lambda: pbs.job(second).get("comment", "").startswith("Not Running: User"))
    time.sleep(0.5)
    job = pbs.job(second)
    assert job["job_state"] == "Q"
    assert job["comment"] == "Not Running: User has reached queue workq running job limit."
    pbs.run("qdel", first)
    assert pbs.wait_state(second, "F", timeout=30)["Exit_status"] == 0


# --- what a real OpenPBS showed (tests/test_realpbs_nodes.py): the fake plays the same -------------------------


def test_chunks_share_a_host_by_default_and_scatter_over_hosts_with_place_scatter(pbs: FakePbs) -> None:
    """OpenPBS's default ``place=free`` packed ``select=2`` onto one host that had room for both chunks; only
    ``place=scatter`` gave one host per chunk."""
    packed_out, spread_out = pbs.submit_dir / "packed.txt", pbs.submit_dir / "spread.txt"
    packed = pbs.submit(f'cp "$PBS_NODEFILE" {packed_out}\n', "-l", "select=2:ncpus=1")
    spread = pbs.submit(f'cp "$PBS_NODEFILE" {spread_out}\n', "-l", "select=2:ncpus=1", "-l", "place=scatter")
    first, second = pbs.wait_state(packed, "F"), pbs.wait_state(spread, "F")
    hosts = packed_out.read_text().splitlines()
    assert len(hosts) == 2 and hosts[0] == hosts[1] and not hosts[0].startswith("fakenode"), hosts
    assert first["Resource_List"]["place"] == "free"
    assert len({part.split("/")[0] for part in first["exec_host"].split("+")}) == 1
    assert spread_out.read_text().splitlines() == ["fakenode0", "fakenode1"]
    assert second["exec_host"].startswith("fakenode0/0") and "+fakenode1/0" in second["exec_host"]
    assert second["resources_used"]["ncpus"] == 2  # the job's total, kept in the final report


def test_qdel_of_a_job_already_ending_is_refused_as_openpbs_does(pbs: FakePbs) -> None:
    """A job in E (or one a first qdel is ending) answers a plain qdel with PBSE_BADSTATE, exit 168."""
    ending = pbs.submit("true\n", env={"FAKEPBS_EXITING_DELAY": "30"})
    pbs.wait_state(ending, "E")
    res = pbs.run("qdel", ending)
    assert (res.returncode, res.stdout) == (168, "")
    assert res.stderr.strip() == f"qdel: Request invalid for state of job {ending}"
    stubborn = pbs.submit("trap '' TERM\nsleep 30\n", env={"FAKEPBS_KILL_DELAY": "20"})
    pbs.wait_state(stubborn, "R")
    assert pbs.run("qdel", stubborn).returncode == 0
    again = pbs.run("qdel", stubborn)  # its MoM is killing it already
    assert again.returncode == 168 and "Request invalid for state of job" in again.stderr


def test_a_released_job_loses_its_execution_time_and_depend_and_gets_its_etime(pbs: FakePbs) -> None:
    """As OpenPBS shows them: ``etime`` only once eligible; ``Execution_Time`` gone when the -a time came
    (job_wait_over); a met ``after:`` dependency leaves no ``depend`` on the child."""
    when = int(time.time()) + 4
    parent = pbs.submit("sleep 30\n", "-a", a_time(when))
    child = pbs.submit("sleep 30\n", "-W", f"depend=after:{parent}")
    _, doc, _ = pbs.status(parent, child)
    waiting, held = doc["Jobs"][parent], doc["Jobs"][child]
    assert waiting["job_state"] == "W" and waiting["Execution_Time"] and "etime" not in waiting
    assert held["job_state"] == "H" and held["depend"] == f"after:{parent}@fakepbs" and "etime" not in held
    running, started = pbs.wait_state(parent, "R"), pbs.wait_state(child, "R")
    assert "Execution_Time" not in running and running["etime"]
    assert "depend" not in started and started["etime"]
    pbs.run("qdel", parent, child)
