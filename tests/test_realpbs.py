"""Against a real OpenPBS (issue 22, item 6): what the fake PBS in tests/fakepbs was written from.

Runs only when asked (``PBSTK_TEST_REALPBS=1``), against an OpenPBS in ``/opt/pbs`` started in the network
namespace ``pbsns`` (a PBS server refuses a host whose only address is loopback): CONTRIBUTING.md "The real-OpenPBS
tier" says how one is built and started. Asked, a server that does not answer fails the tier; not asked, it is
skipped, whatever the machine has (a copy of a machine that once ran one may hold ``/opt/pbs`` and the namespace
with no server), and it needs root (``ip netns exec``). pbstk runs inside the namespace, as a user
on that login node would; jobs get the stand-in ``vllm`` through the profile's ``setup:`` lines, since a real
MoM starts them with PBS's own environment. Two execution hosts: tests/test_realpbs_nodes.py; the fake stays for
injected faults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, wait_for

PBS_EXEC = Path("/opt/pbs")
NETNS = "pbsns"
REPO = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent / "standins"


def _namespace_exists() -> bool:
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.split()[0] == NETNS for line in listed.splitlines() if line.strip())


ASKED = os.environ.get("PBSTK_TEST_REALPBS") == "1"
TIER = [
    pytest.mark.realpbs,
    pytest.mark.skipif(not ASKED, reason="the real-OpenPBS tier runs with PBSTK_TEST_REALPBS=1 (CONTRIBUTING.md)"),
    pytest.mark.skipif(not (PBS_EXEC / "bin" / "qstat").exists(), reason="no OpenPBS in /opt/pbs"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the real-OpenPBS tier needs root (ip netns exec)"),
]
pytestmark = TIER


def in_namespace(*argv: str, timeout: float = 120.0, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    path = f"{PBS_EXEC}/bin:{os.environ['PATH']}"
    command = ["ip", "netns", "exec", NETNS, "env", f"PATH={path}", f"PYTHONPATH={REPO}", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,  # noqa: S603
                          env={**os.environ, **(env or {})})


def pbstk(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return in_namespace(sys.executable, "-m", "pbs_toolkit", *args, timeout=timeout)


def ok(*args: str, timeout: float = 120.0) -> str:
    result = pbstk(*args, timeout=timeout)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def status(*jobs: str) -> list[dict[str, Any]]:
    return list(json.loads(ok("status", *jobs, "--json")))


def qstat_json(*jobs: str) -> dict[str, Any]:
    result = in_namespace("qstat", "-x", "-f", "-F", "json", *jobs)
    assert result.returncode in (0, 153), result.stderr
    return dict(json.loads(result.stdout).get("Jobs") or {})


def poll(check: Any, timeout: float, what: str) -> Any:
    """helpers.wait_for, asking the real server every 2 s (each status is a real qstat)."""
    return wait_for(check, timeout, what, interval=2.0)


PROFILE = """name: {name}
description: the real OpenPBS of tests/test_realpbs.py
scheduler: pbs
pbs:
  queue: workq
  select: "{{nodes}}:ncpus={{cpus_per_node}}:ngpus={{gpus_per_node}}"
  keep_files: doe
walltime: "00:10:00"
nodes: 1
gpus_per_node: 1
cpus_per_node: {cpus}
address: fqdn
runs_root: {runs}
vllm_cache_root: {runs}/cache
setup:
  - export PATH={standins}:$PATH
"""


@pytest.fixture
def realpbs(isolated_user: Path) -> Iterator[None]:
    """Profiles ``realpbs`` (1 CPU, 1 GPU) and ``realpbs-huge`` (128 CPUs: more than the node's 64, so the
    scheduler comments and never runs it) for this test's user; every job left is deleted at the end."""
    assert _namespace_exists(), (f"PBSTK_TEST_REALPBS=1 but no network namespace {NETNS!r}: start the server "
                                 "first (CONTRIBUTING.md, 'The real-OpenPBS tier')")
    answer = in_namespace("qstat", "-B", timeout=30)
    assert answer.returncode == 0, f"the OpenPBS server in {NETNS} does not answer: {answer.stderr.strip()}"
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    for name, cpus in (("realpbs", 1), ("realpbs-huge", 128)):
        (profiles / f"{name}.yaml").write_text(PROFILE.format(name=name, cpus=cpus, runs=isolated_user / "runs",
                                                              standins=STANDINS))
    yield
    from pbs_toolkit.jobs.store import JobStore

    jobs = [r.job_id for r in JobStore().all() if r.scheduler == "pbs"]
    if jobs:
        in_namespace("qdel", "-W", "force", *jobs, timeout=60)


def launch(*extra: str) -> str:
    out = ok("launch", MODEL, "--preset", "single", "--port", "auto", *extra)
    return out.split()[1]  # "submitted 12.vm (...)"


def test_launch_ready_logs_update_endpoint_cancel(realpbs: None, tmp_path: Path) -> None:
    job = launch("--profile", "realpbs", "--name", "real", "--wait", "--timeout", "120")
    st = status(job)[0]
    assert st["state"] == "READY" and st["scheduler_state"] == "R", st
    assert st["walltime_s"] == 600 and st["uptime_s"] is not None and st["node"], st
    assert "Starting vLLM server" in ok("logs", job, "-n", "50")
    registry = tmp_path / "endpoints.py"
    ok("update-endpoint", job, "--registry", str(registry))
    entry = registry.read_text()
    assert '"real"' in entry and st["url"] in entry
    exports = dict(line.removeprefix("export ").split("=", 1) for line in ok("env", job).splitlines())
    ask = ("import json,os,urllib.request as u; r=u.Request(os.environ['U'] + '/models', headers={'Authorization':"
           " 'Bearer ' + os.environ['K']}); print(json.load(u.urlopen(r, timeout=10))['data'][0]['id'])")
    served = in_namespace(sys.executable, "-c", ask, env={"U": exports["OPENAI_BASE_URL"].strip("'"),
                                                          "K": exports["OPENAI_API_KEY"].strip("'")})
    assert served.stdout.strip() == MODEL, served
    ok("cancel", job)
    # CANCELLED already while PBS says E (its end-of-job work, hooks included, takes a moment): wait for F
    final = poll(lambda: (s := status(job)[0])["state"] == "CANCELLED" and s["scheduler_state"] == "F" and s, 60,
                 f"{job} to be CANCELLED and F")
    assert "terminated by" in final["comment"], final  # qdel's, in PBS's own words
    assert '"real"' not in registry.read_text()  # the job's registry entry went with it


def test_a_walltime_kill_is_failed_naming_the_walltime(realpbs: None) -> None:
    job = launch("--profile", "realpbs", "--name", "short", "--walltime", "00:00:10")
    st = poll(lambda: (s := status(job)[0])["state"] == "FAILED" and s, 240, f"{job} to be killed at its walltime")
    assert st["exit_status"] == -29 and "walltime" in st["reason"], st  # PBS's JOB_EXEC_KILL_WALLTIME
    assert qstat_json(job)[job]["Exit_status"] == -29


def test_queued_held_and_waiting_jobs_say_why(realpbs: None) -> None:
    """What keep-alive relies on: ``qsub -a`` (a successor eligible later) and ``-W depend=after:`` (one that
    starts after its predecessor), and the scheduler's comment on a job that cannot run; the raw attributes are
    what the fake PBS models (tests/fakepbs/README.md)."""
    never = launch("--profile", "realpbs-huge", "--name", "never")
    code = ("import sys, time; from pbs_toolkit.client import Client\n"
            "with Client() as c:\n"
            "    req = lambda name: c.request(sys.argv[1], 'single', 'realpbs', name=name, port='auto')\n"
            "    later = c.launch_request(req('later'), begin_at=time.time() + 3600).record.job_id\n"
            "    after = c.launch_request(req('after'), after=sys.argv[2]).record.job_id\n"
            "    print(later, after)\n")
    made = in_namespace(sys.executable, "-c", code, MODEL, never)
    assert made.returncode == 0, made.stderr
    later, after = made.stdout.split()
    answer = poll(lambda: (s := status(never, later, after))[0]["comment"] and s, 60, "the scheduler's comment")
    shown = {s["job_id"]: s for s in answer}
    assert shown[never]["state"] == "PENDING" and shown[never]["scheduler_state"] == "Q"
    assert "Insufficient amount of resource: ncpus" in shown[never]["comment"], shown[never]
    assert shown[later]["scheduler_state"] == "W" and shown[later]["comment"].startswith("eligible at ")
    assert shown[after]["scheduler_state"] == "H"
    assert shown[after]["comment"] == f"held until its dependency is met: after:{never}"
    raw = {job: qstat_json(job)[job] for job in (later, after)}
    assert raw[later]["substate"] == 30 and "comment" not in raw[later] and raw[later]["Execution_Time"]
    assert raw[after]["substate"] == 22 and raw[after]["Hold_Types"] == "s" and "comment" not in raw[after]
    assert raw[after]["depend"].startswith(f"after:{never}@")
    ok("cancel", never, later, after)

    def all_cancelled() -> list[dict[str, Any]] | None:
        seen = status(never, later, after)
        return seen if all(x["state"] == "CANCELLED" for x in seen) else None

    ended = poll(all_cancelled, 60, "the three jobs to end")
    assert all("Exit_status" not in qstat_json(x["job_id"])[x["job_id"]] for x in ended)  # deleted before running


def test_a_batched_json_status_lists_every_job_on_this_server(realpbs: None, isolated_user: Path) -> None:
    """openpbs #2672 (the fake's ``FAKEPBS_JSON_FIRST_ONLY``): where the real server lists only the first job of
    a batched ``-F json``, pbstk still shows each job and remembers to ask this server in text."""
    jobs = [launch("--profile", "realpbs-huge", "--name", f"q{i}") for i in range(3)]
    listed = qstat_json(*jobs)
    quirk = len(listed) < len(jobs)
    if quirk:  # exactly what FAKEPBS_JSON_FIRST_ONLY=1 plays: the first job found, an unknown id before it too
        assert list(listed) == jobs[:1], listed
        assert list(qstat_json("999999", *jobs[1:])) == jobs[1:2]
    for _ in range(2):  # the second poll goes by the remembered quirk
        shown = status(*jobs)
        assert [s["state"] for s in shown] == ["PENDING"] * 3, shown
        assert all(s["scheduler_state"] == "Q" and s["walltime_s"] == 600 for s in shown), shown
    remembered = isolated_user / "state" / "pbstk" / "pbs-json-batching.json"
    assert remembered.exists() == quirk
    ok("cancel", *jobs)


STUBBORN = """  - '(trap "" TERM; exec -a pbstk-stubborn sleep 600) & echo $! >"$RUN_DIR/stubborn.pid"'
env:
  PBSTK_TEST_STANDIN_MODE: exit-after-ready
  PBSTK_TEST_STANDIN_SECONDS: "5"
"""


def test_a_child_that_ignores_sigterm_is_gone_once_its_job_ends(realpbs: None, isolated_user: Path) -> None:
    """Issue 41: a PBS MoM ends every process of a job's session when the job script exits, one that ignores
    SIGTERM too (pbstk's `local` scheduler does the same for its jobs since then). The job's setup starts such a
    child, vLLM (the stand-in) exits on its own 5 s after READY, and the child must be gone with the job."""
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    text = PROFILE.format(name="realpbs-stubborn", cpus=1, runs=isolated_user / "runs", standins=STANDINS)
    (profiles / "realpbs-stubborn.yaml").write_text(text + STUBBORN)
    job = launch("--profile", "realpbs-stubborn", "--name", "stubborn", "--wait", "--timeout", "120")
    from pbs_toolkit.jobs.store import JobStore

    pid = int(poll(lambda: (f := Path(JobStore().find(job).run_dir, "stubborn.pid")).exists() and f.read_text(), 30,
                   "the child's pid"))
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"pbstk-stubborn"), "the child is not running"
    poll(lambda: (s := status(job)[0])["scheduler_state"] == "F" and s, 120, f"{job} to end by itself")

    def gone() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    assert gone(), f"pid {pid} (it ignores SIGTERM) outlived its job"
