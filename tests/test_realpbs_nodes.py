"""Against a real OpenPBS with two execution hosts (issue 30, item 4): several nodes, a service, keep-alive's
``qsub -a`` / ``-W depend=after:``, ``pbstk usage`` from ``resources_used``, and ``qdel`` of a job in state E.

The same tier as tests/test_realpbs.py (marker ``realpbs``, run only with ``PBSTK_TEST_REALPBS=1``, as root),
plus a second MoM: ``tests/realpbs/two_nodes.sh`` starts one on this machine in a network namespace ``pbsns2``
and a UTS namespace of its own, host ``<short name>-n2`` at 10.231.1.2 (a veth pair to the server's namespace
``pbsns``), registers it with the server (``qmgr create node``) and installs an execjob_end hook that
keeps jobs named ``*slowexit*`` in state E for 20 s. Run it (as root) after the shared ``realpbs/up.sh``; these
tests are skipped with that hint while the second node is not ``free``. ``two_nodes.sh down`` removes it all.

Every job gets the stand-in ``vllm`` through its profile's ``setup:`` lines: a real MoM (and ``pbsdsh``'s tasks
on the second host) start it with PBS's own environment, never the submitting shell's.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL
from test_realpbs import (  # noqa: F401  (realpbs: the fixture, used by name)
    STANDINS,
    TIER,
    in_namespace,
    ok,
    pbstk,
    poll,
    qstat_json,
    realpbs,
    status,
)

pytestmark = TIER

HEAD = socket.gethostname().split(".")[0]
NODE2 = f"{HEAD}-n2"
TWO_NODES = Path(__file__).resolve().parent / "realpbs" / "two_nodes.sh"
ROUTER = Path(sys.executable).with_name("vllm-router")
TIME_FORMAT = "%a %b %d %H:%M:%S %Y"  # how PBS prints times (server-local)

PROFILE = """name: {name}
description: the two-host OpenPBS of tests/test_realpbs_nodes.py
scheduler: pbs
pbs:
  queue: workq
  select: "{{nodes}}:ncpus={{cpus_per_node}}:ngpus={{gpus_per_node}}"
  keep_files: doe
walltime: "00:10:00"
nodes: 1
gpus_per_node: {gpus}
cpus_per_node: 1
address: fqdn
node_launcher: pbsdsh
runs_root: {runs}
vllm_cache_root: {runs}/cache
router: local
router_command: {router}
setup:
  - export PATH={standins}:$PATH
{extra}"""


def _node2_free() -> str | None:
    """Why the second host is not usable, or None."""
    answer = in_namespace("pbsnodes", NODE2, timeout=30)
    if answer.returncode != 0:
        return f"no node {NODE2}: {answer.stderr.strip()}"
    state = next((line.split("=", 1)[1].strip() for line in answer.stdout.splitlines()
                  if line.strip().startswith("state =")), "?")
    return None if state == "free" else f"node {NODE2} is {state}"


@pytest.fixture
def two_nodes(realpbs: None, isolated_user: Path) -> Iterator[None]:  # noqa: F811
    """The profiles of this module (``realpbs`` has checked the server and deletes every job at the end):
    ``realpbs-2n`` (4 ``ngpus`` a node, for ``dp8`` over two nodes), ``realpbs-1g`` (one GPU: replicas and
    successors) and ``realpbs-exit`` (its server exits 3 s after it is ready)."""
    why = _node2_free()
    if why:
        pytest.skip(f"{why}: run {TWO_NODES} (as root) after realpbs/up.sh (CONTRIBUTING.md)")
    hook = in_namespace("qmgr", "-c", "list hook pbstk_slow_end", timeout=30)
    if hook.returncode != 0:
        pytest.skip(f"no hook pbstk_slow_end: run {TWO_NODES} again")
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    exit_soon = "  - export PBSTK_TEST_STANDIN_MODE=exit-after-ready PBSTK_TEST_STANDIN_SECONDS=3\n"
    for name, gpus, extra in (("realpbs-2n", 4, ""), ("realpbs-1g", 1, ""), ("realpbs-exit", 1, exit_soon)):
        (profiles / f"{name}.yaml").write_text(PROFILE.format(name=name, gpus=gpus, runs=isolated_user / "runs",
                                                              router=ROUTER, standins=STANDINS, extra=extra))
    yield


def pbs_time(text: str) -> float:
    return time.mktime(time.strptime(text, TIME_FORMAT))


def ask_models(url: str, key: str) -> str:
    """GET URL/models with the key, from inside the server's namespace (where a user of pbstk sits)."""
    ask = ("import json,os,urllib.request as u; r=u.Request(os.environ['U'] + '/models', headers={'Authorization':"
           " 'Bearer ' + os.environ['K']}); print(json.load(u.urlopen(r, timeout=10))['data'][0]['id'])")
    answer = in_namespace(sys.executable, "-c", ask, env={"U": url, "K": key})
    assert answer.returncode == 0, answer.stderr
    return answer.stdout.strip()


def job_env(ref: str) -> dict[str, str]:
    lines = ok("env", ref).splitlines()
    return {k: v.strip("'") for k, v in (line.removeprefix("export ").split("=", 1) for line in lines)}


def test_native_dp_over_two_real_hosts_through_pbsdsh_then_usage(two_nodes: None) -> None:
    """``--nodes 2`` (dp8: 4 ranks a node): the real server gives one host per chunk (pbstk asks for
    ``place=scatter``), node 1's copy starts through the real ``pbsdsh`` on the other host and its headless
    engine reaches the head across the two namespaces; READY, a request, cancel; then ``pbstk usage`` reads the
    real ``resources_used``."""
    out = ok("launch", MODEL, "--profile", "realpbs-2n", "--preset", "dp8", "--nodes", "2", "--port", "auto",
             "--name", "dp2n", "--wait", "--timeout", "180", timeout=240)
    job = out.split()[1]
    st = poll(lambda: (s := status(job)[0])["nodes_ready"] == 2 and s, 60, "both nodes to report ready")
    assert st["state"] == "READY" and st["nnodes"] == 2 and st["scheduler_state"] == "R", st
    assert [n["host"] for n in st["nodes"]] == [HEAD, NODE2], st["nodes"]
    raw = qstat_json(job)[job]
    # one chunk on each host (the slot index on a host depends on what else runs there: vm/2 beside another job)
    assert [chunk.split("/")[0] for chunk in raw["exec_host"].split("+")] == [HEAD, NODE2], raw["exec_host"]
    assert raw["Resource_List"]["place"] == "scatter" and raw["Resource_List"]["nodect"] == 2
    run_dir = Path(st["run_dir"])
    assert f"starting node 1 on {NODE2}: pbsdsh -n 1" in (run_dir / "vllm.log").read_text()
    worker = poll(lambda: (w := json.loads((run_dir / "nodes" / "1.json").read_text()))["phase"] == "ready" and w,
                  60, "node 1 to mark itself ready")  # within a poll of the head's READY
    assert worker["host"] == worker["address"] == NODE2, worker  # its own host name: the UTS namespace
    env = job_env(job)
    assert ask_models(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]) == MODEL

    ok("cancel", job)
    poll(lambda: status(job)[0]["state"] == "CANCELLED", 90, f"{job} to be CANCELLED")
    final = poll(lambda: (j := qstat_json(job)[job])["job_state"] == "F" and j, 60, "PBS to finish the job")
    assert final["resources_used"]["ncpus"] == 2 and final["Resource_List"]["ngpus"] == 8, final
    doc = json.loads(ok("usage", job, "--json"))
    (row,) = doc["jobs"]
    used = final["resources_used"]["walltime"]
    h, m, s = (int(x) for x in used.split(":"))
    assert row["ended"] and row["nodes"] == 2 and row["gpus"] == 8, row
    assert row["walltime_s"] == h * 3600 + m * 60 + s and row["walltime_source"] == "qstat resources_used.walltime"
    assert row["gpu_hours"] == pytest.approx(8 * row["walltime_s"] / 3600, abs=1e-3)


def test_a_two_replica_service_answers_through_its_router_then_cancel(two_nodes: None) -> None:
    out = ok("serve", MODEL, "--profile", "realpbs-1g", "--preset", "single", "--replicas", "2", "--name", "svc2",
             "--wait", "--timeout", "180", timeout=240)
    assert "ready: http://" in out, out
    doc = poll(lambda: (d := json.loads(ok("status", "svc2", "--json"))[0])["ready"] == 2 and d, 60,
               "both replicas READY")
    assert doc["state"] == "READY" and [j["state"] for j in doc["jobs"]] == ["READY", "READY"], doc
    assert all(j["scheduler_state"] == "R" for j in doc["jobs"]), doc["jobs"]
    env = job_env("svc2")
    assert env["OPENAI_BASE_URL"] == doc["url"]
    for _ in range(4):  # round robin or not, every answer comes through the router from a real PBS job
        assert ask_models(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]) == MODEL
    jobs = [j["job_id"] for j in doc["jobs"]]
    assert pbstk("cancel", "svc2").returncode == 0

    poll(lambda: all(qstat_json(j)[j]["job_state"] == "F" for j in jobs), 90, "both replica jobs to finish in PBS")


def test_keep_alive_submissions_start_when_they_should(two_nodes: None) -> None:
    """What a keep-alive successor is submitted with, on the real server: ``qsub -a`` waits in W with its
    ``Execution_Time`` and runs at that time, not before; ``-W depend=after:`` holds the child until its parent
    runs. Then PBS drops ``Execution_Time`` and the child's ``depend`` and gives the parent ``before:CHILD``."""
    code = ("import sys, time; from pbs_toolkit.client import Client\n"
            "with Client() as c:\n"
            "    req = lambda name: c.request(sys.argv[1], 'single', 'realpbs-1g', name=name, port='auto')\n"
            "    first = c.launch_request(req('ka-first'), begin_at=time.time() + 20).record.job_id\n"
            "    then = c.launch_request(req('ka-then'), after=first).record.job_id\n"
            "    print(first, then)\n")
    made = in_namespace(sys.executable, "-c", code, MODEL)
    assert made.returncode == 0, made.stderr
    first, then = made.stdout.split()
    raw = {job: qstat_json(job)[job] for job in (first, then)}
    assert raw[first]["job_state"] == "W" and "etime" not in raw[first], raw[first]
    eligible = pbs_time(raw[first]["Execution_Time"])
    assert raw[then]["job_state"] == "H" and raw[then]["depend"] == f"after:{first}@{HEAD}", raw[then]
    assert raw[first]["depend"] == f"before:{then}@{HEAD}"  # the server notes the child on its parent
    shown = {s["job_id"]: s for s in status(first, then)}
    assert shown[first]["comment"].startswith("eligible at ") and shown[then]["comment"].startswith("held until")

    def both_ready() -> list[dict[str, Any]] | None:
        seen = status(first, then)
        return seen if all(x["state"] == "READY" for x in seen) else None

    ready = poll(both_ready, 120, "both jobs to be READY")
    assert all(s["scheduler_state"] == "R" for s in ready)
    ran = {job: qstat_json(job)[job] for job in (first, then)}
    assert pbs_time(ran[first]["stime"]) >= eligible  # not a second before its -a time
    assert pbs_time(ran[then]["stime"]) >= pbs_time(ran[first]["stime"])  # after its parent started
    assert "Execution_Time" not in ran[first] and ran[first]["etime"], ran[first]
    assert "depend" not in ran[then] and ran[then]["etime"], ran[then]
    ok("cancel", first, then)


def service_doc(name: str) -> dict[str, Any]:
    return dict(json.loads(ok("status", name, "--json"))[0])


def test_a_keep_alive_successor_waits_for_its_time_then_takes_over_before_the_walltime(two_nodes: None) -> None:
    """``serve --keep-alive`` on the real server: the successor is submitted with ``qsub -a`` (45 s before the
    first job's 75 s walltime ends), waits in W for its ``Execution_Time``, runs not before it, and the keeper
    hands over and cancels the first job before PBS kills it at its walltime."""
    quick = {"PBSTK_SERVICE_POLL_S": "1", "PBSTK_SERVICE_DRAIN_S": "3"}  # the keeper inherits them
    made = in_namespace(sys.executable, "-m", "pbs_toolkit", "serve", MODEL, "--profile", "realpbs-1g", "--preset",
                        "single", "--replicas", "1", "--name", "ka", "--keep-alive", "--walltime", "00:01:15",
                        "--handover", "45", "--wait", "--timeout", "120", env=quick, timeout=180)
    assert made.returncode == 0, made.stderr
    first = service_doc("ka")["slots"][0]["current"]
    started = pbs_time(qstat_json(first)[first]["stime"])
    doc = poll(lambda: (d := service_doc("ka"))["slots"][0]["successor"] and d, 60, "a successor")
    successor = doc["slots"][0]["successor"]
    waiting = qstat_json(successor)[successor]
    assert waiting["job_state"] == "W" and "Submit_arguments" in waiting, waiting
    assert "-a" in str(waiting["Submit_arguments"]).split(), waiting["Submit_arguments"]
    eligible = pbs_time(waiting["Execution_Time"])
    assert started + 75 - 45 - 5 <= eligible < started + 75, (started, waiting["Execution_Time"])

    def handed_over() -> bool:
        slot = service_doc("ka")["slots"][0]
        return bool(slot["current"] == successor and not slot["draining"])

    poll(handed_over, 120, "the handover to the successor")
    ran = qstat_json(successor)[successor]
    assert ran["job_state"] == "R" and pbs_time(ran["stime"]) >= eligible and "Execution_Time" not in ran, ran
    gone = poll(lambda: (j := qstat_json(first)[first])["job_state"] == "F" and j, 60, "the first job to end")
    assert gone["Exit_status"] != -29, gone  # cancelled by the keeper, not killed at its walltime
    env = job_env("ka")
    assert ask_models(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]) == MODEL
    assert pbstk("cancel", "ka").returncode == 0


def test_qdel_of_a_job_in_state_e_and_pbstk_cancel(two_nodes: None) -> None:
    """A job whose server has exited is in E while its MoM ends it (the hook holds it there 20 s): a plain qdel
    is refused with PBSE_BADSTATE (exit 168); ``pbstk cancel`` says the job already ended and succeeds."""
    job = ok("launch", MODEL, "--profile", "realpbs-exit", "--preset", "single", "--port", "auto",
             "--name", "slowexit", "--wait", "--timeout", "120").split()[1]
    exiting = poll(lambda: (j := qstat_json(job)[job])["job_state"] == "E" and j, 60, f"{job} to be E")
    assert exiting["Exit_status"] == 0 and exiting["substate"] in (50, 51, 52, 53), exiting
    refused = in_namespace("qdel", job)
    assert refused.returncode == 168, (refused.returncode, refused.stderr)
    assert refused.stderr.strip() == f"qdel: Request invalid for state of job {job}"
    cancel = pbstk("cancel", job)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"{job}: already ended"
    assert qstat_json(job)[job]["job_state"] in ("E", "F")
    final = poll(lambda: (s := status(job)[0])["scheduler_state"] == "F" and s, 60, f"PBS to finish {job}")
    assert final["state"] == "FINISHED" and final["exit_status"] == 0, final  # ended by itself, as it was
