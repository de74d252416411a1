"""``pbstk run MODEL MODEL ... [--each [--parallel N]] -- COMMAND`` (issue 31, item 5): one multi-model service
(the stand-in vLLM per model, the real vllm-router, the real keeper; the local scheduler and the fake PBS), then
COMMAND once against it or once per model with ``{model}``/``{alias}`` replaced, a summary table, the worst exit
status, and the service cancelled.

pbstk runs as a subprocess (test_campaigns.py's ``cli``): COMMAND writes to the real stdout and gets real signals.

Before: several MODEL words were taken as MODEL and COMMAND (``--`` was lost), ``--each``/``--parallel``/
``--models`` were unknown options (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import helpers
import pytest
import yaml
from helpers import MODEL
from test_campaigns import LOCAL, _env, cli, usage_of
from test_serve_models import checkpoint

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobStore

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed next to this Python")

#: COMMAND: one chat completion for the model named in argv[1] (through OPENAI_BASE_URL with OPENAI_API_KEY),
#: then exit with that model's code from CODES (a JSON object in the environment)
ASK = textwrap.dedent("""\
    import json, os, sys, urllib.request
    model = sys.argv[1]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(req, timeout=30))
    print(f"asked={model} answered={answer['model']} env={os.environ.get('PBSTK_MODEL')}/"
          f"{os.environ.get('PBSTK_ALIAS')} args={sys.argv[2:]} key-in-argv={os.environ['OPENAI_API_KEY'] in sys.argv}")
    sys.stdout.flush()
    sys.exit(json.loads(os.environ.get("CODES", "{}")).get(model, 0))
""")


def _profile(isolated_user: Path, name: str, scheduler: str, extra: str = "") -> None:
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.yaml").write_text(
        f"name: {name}\nscheduler: {scheduler}\nnodes: 1\ngpus_per_node: 1\ngpu_memory_gb: 80\ncpus_per_node: 2\n"
        f"walltime: '00:10:00'\naddress: loopback\nbind_host: 127.0.0.1\nrouter_command: {ROUTER}\n{extra}")


@pytest.fixture
def pair(isolated_user: Path, standins: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Two small models that share the one GPU of a local profile; the stand-in answers a request for another
    model with vLLM's 404; COMMAND's script."""
    _profile(isolated_user, "gpu1", "local", "port: 8000\n")
    for key, value in (("PBSTK_SERVICE_POLL_S", "0.5"), ("PBSTK_TEST_STANDIN_DELAY", "0"),
                       ("PBSTK_TEST_STANDIN_CHECK_MODEL", "1"), ("CUDA_VISIBLE_DEVICES", "0")):
        monkeypatch.setenv(key, value)
    root = isolated_user / "m"
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    yield checkpoint(root, "alpha", 1_200_000_000), checkpoint(root, "beta", 3_400_000_000), script
    _stop()


def _stop() -> None:
    from test_service import _stop_services

    _stop_services()


def _table(stderr: str) -> dict[str, list[str]]:
    """The summary table's rows (on stderr, after its MODEL header), by model."""
    lines = stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["MODEL", "ALIAS", "EXIT"])
    return {line.split()[0]: line.split() for line in lines[head + 1:] if line and not line.startswith("pbstk:")}


def test_each_runs_command_per_model_in_turn_and_exits_with_the_worst(pair: Any, tmp_path: Path) -> None:
    alpha, beta, script = pair
    registry = tmp_path / "endpoints.yaml"
    ran = cli("run", f"{alpha}:name=a", f"{beta}:name=b", "--profile", "gpu1", "--name", "duo", "--each",
              "--keep-alive", "--walltime", "00:30:00", "--registry", str(registry), "--", sys.executable, str(script),
              "{model}", "{alias}", "out/{{model}}-{model}.json",
              # keep-alive: the job and its successor each book a GPU of this machine (two of them)
              env=_env(CODES=json.dumps({"a": 0, "b": 3}), CUDA_VISIBLE_DEVICES="0,1"), timeout=240)
    assert ran.returncode == 3, ran.stderr  # the worst of 0 and 3
    # one after the other, in the order given, each against its own model through the one URL
    assert ran.stdout.splitlines() == [
        "asked=a answered=a env=a/a args=['a', 'out/{model}-a.json'] key-in-argv=False",
        "asked=b answered=b env=b/b args=['b', 'out/{model}-b.json'] key-in-argv=False"], ran.stdout
    rows = _table(ran.stderr)
    assert [rows["a"][:3], rows["b"][:3]] == [["a", "a", "0"], ["b", "b", "3"]], ran.stderr
    assert rows["a"][4] == "-" and rows["b"][4] == "-"  # in turn: the output went to the terminal, no log
    assert "pbstk: cancelled duo" in ran.stderr, ran.stderr
    assert "2/2 models READY" in ran.stderr and "replicas READY" not in ran.stderr, ran.stderr  # models, not jobs
    assert yaml.safe_load(registry.read_text())["endpoints"] in ({}, None)  # both entries taken back
    status = json.loads(cli("status", "duo", "--json").stdout)[0]
    assert status["state"] == "CANCELLED", status
    assert status["lease_s"] == 300, status  # the run's lease (default 5m), watched by the service's keeper
    assert status["keep_alive"] is True, status  # serve's keep-alive of every model, for long campaigns
    doc = usage_of("duo")  # the service's one job, and each model's part of it
    # duo-r0 (and its replacement duo-r0-g1 should a port race on this shared machine end the first job)
    assert doc["jobs"] and all(r["name"].startswith("duo-r0") and r["service"] == "duo" for r in doc["jobs"]), doc
    assert doc["services"][0]["service"] == "duo" and doc["totals"]["walltime_s"] is not None, doc
    assert sorted(m["model"] for m in doc["services"][0]["models"]) == ["a", "b"], doc["services"]


#: COMMAND of the crash test: ASK's one request for argv[1] (exit 1 unless 200); after the model KILL_AFTER's run,
#: SIGKILL of the API server of model KILL's vLLM (the oldest process whose command line names it: not its engine)
ASK_THEN_KILL = textwrap.dedent("""\
    import json, os, signal, subprocess, sys, time, urllib.error, urllib.request
    model = sys.argv[1]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    try:
        code = urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as exc:
        code = exc.code
    print(f"asked={model} status={code}", flush=True)
    if model == os.environ["KILL_AFTER"]:
        match = ["pgrep", "-f", "--", "--served-model-name " + os.environ["KILL"]]
        pid = subprocess.check_output([*match[:1], "-o", *match[1:]])
        os.kill(int(pid.split()[0]), signal.SIGKILL)
        # killed during this run: its job ends the processes the kill left (its other API servers) before this run
        # ends, as a crash does long before the next run in a campaign (the replacement's wait at least 1 s off)
        for _ in range(600):
            if subprocess.run(match, stdout=subprocess.DEVNULL).returncode:
                break
            time.sleep(0.05)
    sys.exit(0 if code == 200 else 1)
""")


def test_each_waits_for_a_model_whose_job_is_replaced(isolated_user: Path, standins: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Three models in one job; after the first run, the API server of the second model's vLLM is killed (kill -9,
    as the OOM killer does): the job ends, all its models with it, and the keeper replaces it. The later runs wait
    for their model's server instead of starting against none (issue 41: 0 of 10 and 1 of 10 requests answered),
    say so, and every request gets its answer."""
    _profile(isolated_user, "gpu1k", "local", "port: 8000\nrestart_backoff: 1s\n")
    for key, value in (("PBSTK_SERVICE_POLL_S", "0.5"), ("PBSTK_TEST_STANDIN_DELAY", "0"),
                       ("PBSTK_TEST_STANDIN_CHECK_MODEL", "1"), ("CUDA_VISIBLE_DEVICES", "0")):
        monkeypatch.setenv(key, value)
    root = isolated_user / "m"
    models = [checkpoint(root, name, size) for name, size in (("ka", 1_200_000_000), ("kb", 1_300_000_000),
                                                                ("kc", 1_400_000_000))]
    script = tmp_path / "ask_then_kill.py"
    script.write_text(ASK_THEN_KILL)
    try:
        ran = cli("run", f"{models[0]}:name=each-ka", f"{models[1]}:name=each-kb", f"{models[2]}:name=each-kc",
                  "--profile", "gpu1k", "--name", "trio", "--each", "--",
                  sys.executable, str(script), "{model}",
                  env=_env(KILL_AFTER="each-ka", KILL="each-kb"), timeout=240)
    finally:
        _stop()
    assert ran.stdout.splitlines() == ["asked=each-ka status=200", "asked=each-kb status=200",
                                       "asked=each-kc status=200"], (ran.stdout, ran.stderr)
    assert ran.returncode == 0, ran.stderr
    assert re.search(r"\[2/3\] each-kb: waiting for its server \(", ran.stderr), ran.stderr
    assert "[2/3] each-kb: its server answers again after" in ran.stderr, ran.stderr


def test_without_each_command_runs_once_and_keep_then_reuse_each(pair: Any, tmp_path: Path) -> None:
    """No --each: COMMAND runs once; there is no one model, so PBSTK_MODEL is absent and PBSTK_MODELS lists the
    served names; the service is named run-DATE-TIME-PID when --name is not given. --keep leaves it up, and a
    later `run --reuse NAME --each` runs once per model of it and leaves it up too."""
    alpha, beta, _script = pair
    every = tmp_path / "every.py"
    every.write_text(textwrap.dedent("""\
        import os, subprocess, sys
        models = os.environ["PBSTK_MODELS"].split()
        print("models:", models, "PBSTK_MODEL" in os.environ)
        for m in models:
            subprocess.run([sys.executable, sys.argv[1], m], check=True)
    """))
    ran = cli("run", f"{alpha}:name=a", f"{beta}:name=b", "--profile", "gpu1", "--keep", "--", sys.executable,
              str(every), str(pair[2]), timeout=240)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == "models: ['a', 'b'] False", ran.stdout
    assert [line.split()[0] for line in ran.stdout.splitlines()[1:]] == ["asked=a", "asked=b"], ran.stdout
    (service,) = {r.name.rsplit("-r", 1)[0] for r in JobStore().all()}  # its jobs are SERVICE-r0...
    assert re.fullmatch(r"run-\d{8}-\d{6}-\d+", service), service
    assert f"--keep: {service} stays up" in ran.stderr, ran.stderr

    one_alias = cli("run", "--reuse", service, "--registry", str(tmp_path / "r.yaml"), "--alias", "x", "--",
                    "true")
    assert one_alias.returncode == 2 and "has several models" in one_alias.stderr, one_alias.stderr
    again = cli("run", "--reuse", service, "--each", "--", sys.executable, str(pair[2]), "{model}",
                env=_env(CODES=json.dumps({"a": 2})), timeout=240)
    assert again.returncode == 2, again.stderr
    assert [line.split()[0] for line in again.stdout.splitlines()] == ["asked=a", "asked=b"], again.stdout
    assert json.loads(cli("status", service, "--json").stdout)[0]["state"] == "READY"  # not the run's to end
    assert cli("cancel", service).returncode == 0


def test_each_parallel_on_the_fake_pbs_writes_a_log_per_model(isolated_user: Path, fakepbs: Path, standins: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """Three models (a --models file) in two fake-PBS jobs (c takes a whole GPU); --parallel 2: the first two
    runs overlap (each waits until both have started), each run's output is in its own log, the worst code
    wins."""
    _profile(isolated_user, "pbs1", "pbs", "router: local\n")
    for key, value in (("PBSTK_SERVICE_POLL_S", "0.5"), ("PBSTK_TEST_STANDIN_DELAY", "0"),
                       ("PBSTK_TEST_STANDIN_CHECK_MODEL", "1")):
        monkeypatch.setenv(key, value)
    root = isolated_user / "m"
    a, b, c = (checkpoint(root, n, size) for n, size in (("a", 1_200_000_000), ("b", 1_200_000_000),
                                                          ("c", 3_400_000_000)))
    marks = tmp_path / "marks"
    marks.mkdir()
    together = tmp_path / "together.py"
    together.write_text(textwrap.dedent(f"""\
        import os, subprocess, sys, time
        model = sys.argv[1]
        open(os.path.join({str(marks)!r}, model), "w").close()
        deadline = time.monotonic() + 60  # the first two runs are at once: each sees the other's mark
        while model != "b" and len(os.listdir({str(marks)!r})) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("started together:", sorted(os.listdir({str(marks)!r}))[:2])
        sys.stdout.flush()
        sys.exit(subprocess.run([sys.executable, {str(tmp_path / 'ask.py')!r}, model]).returncode)
    """))
    (tmp_path / "ask.py").write_text(ASK)
    try:
        listing = tmp_path / "models.yaml"  # --models: the file serve reads, a preset and a name per model
        listing.write_text(yaml.safe_dump({"models": [{"model": a, "name": "a"},
                                                      {"model": c, "name": "c", "preset": "single"},
                                                      {"model": b, "name": "b"}]}))
        ran = cli("run", "--models", str(listing), "--profile", "pbs1",
                  "--name", "trio", "--each", "--parallel", "2", "--", sys.executable, str(together), "{model}",
                  env=_env(CODES=json.dumps({"a": 0, "b": 5, "c": 3})), timeout=300)
        assert ran.returncode == 5, ran.stderr
        assert ran.stdout == "", ran.stdout  # every run's output is in its log
        rows = _table(ran.stderr)
        assert {m: rows[m][2] for m in rows} == {"a": "0", "c": "3", "b": "5"}, ran.stderr
        assert list(rows) == ["a", "c", "b"], ran.stderr  # the file's order, not the plan's (largest first)
        for model in ("a", "c", "b"):
            log = Path(rows[model][4])
            assert log.parent.parent == isolated_user / "state" / "pbstk" / "runs", log
            text = log.read_text()
            assert f"asked={model} answered={model} env={model}/{model}" in text, text
        assert "started together: ['a', 'c']" in Path(rows["a"][4]).read_text()
        jobs = [r for r in JobStore().all() if r.name.startswith("trio-r")]  # the plan's two PBS jobs (slots)
        assert {r.name.split("-g")[0] for r in jobs} == {"trio-r0", "trio-r1"}, [r.name for r in jobs]
        assert all(r.job_id.endswith(".fakepbs") for r in jobs), [r.job_id for r in jobs]
        assert "pbstk: cancelled trio" in ran.stderr
    finally:
        _stop()


def test_refusals_are_one_line_and_queue_nothing(isolated_user: Path, standins: Path) -> None:
    cases = [
        (("m1", "m2", "--each"), "--each needs `--`"),
        (("m1", "m2", "--each", "--"), "run needs a COMMAND"),
        (("m1", "m2", "--each", "--parallel", "0", "--", "true"), "--parallel 0 is out of range"),
        (("m1", "m2", "--parallel", "2", "--", "true"), "give --each too"),
        (("m1", "m2", "--each", "--", "echo", "{model}", "{foo}"), "unknown placeholder {foo}"),
        (("m1", "m2", "--registry", "r.yaml", "--alias", "x", "--", "true"), "--alias names one entry"),
        (("--reuse", "svc", "m1", "--", "true"), "--reuse takes no MODEL"),
        (("m1", "m2", "--replicas", "2", "--", "true"), "--replicas is for one model"),
    ]
    for args, says in cases:
        refused = cli("run", *args)
        assert refused.returncode == 2, (args, refused.stderr)
        assert refused.stderr.startswith("pbstk: error: ") and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert says in refused.stderr, (args, refused.stderr)
    assert not list(JobStore().all())


def test_ctrl_c_reaches_every_run_and_cancels_the_service(pair: Any, tmp_path: Path) -> None:
    """SIGINT while two runs go at once: both process groups get it and end, the third run never starts, the
    service is cancelled, pbstk exits 130."""
    alpha, beta, _script = pair
    gamma = checkpoint(Path(alpha).parent, "gamma", 1_200_000_000)
    pids = tmp_path / "pids"
    pids.mkdir()
    child = tmp_path / "child.sh"  # a run with a grandchild in its process group
    child.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ > {pids}/$1\nwait\n")
    child.chmod(0o755)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "run", f"{alpha}:name=a", f"{beta}:name=b",  # noqa: S603
                             f"{gamma}:name=g", "--profile", "gpu1", "--name", "cc", "--each", "--parallel", "2",
                             "--", str(child), "{model}"], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with helpers.interrupting(proc, 120) as interrupt:
        helpers.until(lambda: proc.poll() is not None or len(os.listdir(pids)) == 2 and all(
            (pids / p).read_text().strip() for p in os.listdir(pids)), timeout=180, what="two runs started")
        assert proc.poll() is None, proc.communicate()
        groups = {p: int((pids / p).read_text()) for p in os.listdir(pids)}
        assert all(helpers.group_alive(g) for g in groups.values())
        err = interrupt()
    assert proc.returncode == 130, err
    assert not any(helpers.group_alive(g) for g in groups.values()), "a run's process group outlived pbstk run"
    rows = _table(err)
    assert sorted(groups) == sorted(m for m in rows if rows[m][2] != "-"), err  # the third never ran
    assert len(rows) == 3 and [m for m in rows if rows[m][2] == "-"] == [m for m in "abg" if m not in groups]
    assert "pbstk: cancelled cc" in err, err
    assert json.loads(cli("status", "cc", "--json").stdout)[0]["state"] == "CANCELLED"


def test_each_with_one_model_is_one_run_of_a_plain_job(standins: Path, tmp_path: Path) -> None:
    """One MODEL (no service: a job, as `pbstk run MODEL` launches): --each runs COMMAND once, its served name
    (here from :name=) in {model}; the exit status is that run's."""
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    ran = cli("run", f"{MODEL}:name=solo", *LOCAL, "--name", "one", "--each", "--", sys.executable, str(script),
              "{model}", env=_env(CODES=json.dumps({"solo": 4})))
    assert ran.returncode == 4, ran.stderr
    assert ran.stdout.startswith("asked=solo answered=solo env=solo/solo"), ran.stdout
    assert _table(ran.stderr)["solo"][:3] == ["solo", "solo", "4"], ran.stderr
    assert helpers.wait_recorded("one", "CANCELLED")["state"] == "CANCELLED"


def test_placeholders_are_word_tokens_and_json_arguments_pass_unchanged() -> None:
    from pbs_toolkit.campaigns.each import check_placeholders, expand

    values = {"model": "org/m", "alias": "m"}
    json_arg = '{"num_examples": 10, "sampling": {"temperature": 0}}'  # vf-eval -a '...': braces of JSON, kept
    assert expand(["-m", "{alias}", "out/{model}.json", "{{model}}", "{", "a}b", json_arg, "{model}{alias}", "{}"],
                  values) == ["-m", "m", "out/org/m.json", "{model}", "{", "a}b", json_arg, "org/mm", "{}"]
    check_placeholders(["{model}", "{{foo}}", "{", "}", json_arg, "{}", "{0}", "x{model.upper}"])
    for word in ("{foo}", "out/{Model}.json", "{model_name}"):
        with pytest.raises(UsageError, match=r"unknown placeholder .*write \{\{"):
            check_placeholders(["echo", word])


def test_each_in_turn_over_models_that_swap_on_one_gpu(isolated_user: Path, standins: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-awake 1 (serve's swapping): two models too large to be awake together share the one GPU; --each in
    turn asks each, the sleeping one is woken for its run, and both runs succeed."""
    _profile(isolated_user, "gpu1", "local", "port: 8000\n")
    for key, value in (("PBSTK_SERVICE_POLL_S", "0.5"), ("PBSTK_TEST_STANDIN_DELAY", "0"),
                       ("PBSTK_TEST_STANDIN_CHECK_MODEL", "1"), ("CUDA_VISIBLE_DEVICES", "0"),
                       ("PBSTK_TEST_STANDIN_WAKE_S", "0.3")):
        monkeypatch.setenv(key, value)
    root = isolated_user / "m"
    big, mid = checkpoint(root, "big", 40_000_000_000), checkpoint(root, "mid", 28_000_000_000)
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    try:
        ran = cli("run", f"{big}:name=big", f"{mid}:name=mid", "--profile", "gpu1", "--name", "sw", "--max-awake",
                  "1", "--each", "--", sys.executable, str(script), "{model}", timeout=240)
        assert ran.returncode == 0, ran.stderr
        assert [line.split()[:2] for line in ran.stdout.splitlines()] == [["asked=big", "answered=big"],
                                                                         ["asked=mid", "answered=mid"]], ran.stdout
        assert "pbstk: cancelled sw" in ran.stderr
        assert all("--enable-sleep-mode" in json.loads(line)["argv"]
                   for line in (standins / "argv.jsonl").read_text().splitlines())
    finally:
        _stop()


def test_children_run_n_at_once_and_one_that_cannot_start_is_126(tmp_path: Path) -> None:
    """The supervisor alone: a file that is executable but no program (no #!) does not stop the others; its
    status is 126 as a shell reports it; the others' statuses are their own (128 + N for signal N)."""
    from pbs_toolkit.campaigns.children import Child, run_children

    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00\x01not a program\n")
    junk.chmod(0o755)
    notes: list[str] = []
    kids = [Child([str(junk)], dict(os.environ)),
            Child([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), tmp_path / "logs" / "b.log"),
            Child(["sh", "-c", "echo out; kill -TERM $$"], dict(os.environ), tmp_path / "logs" / "c.log")]
    assert run_children(kids, notes.append, parallel=2) == []
    assert [k.code for k in kids] == [126, 3, 128 + signal.SIGTERM], notes
    assert any("could not be started" in n for n in notes), notes
    assert (tmp_path / "logs" / "c.log").read_text() == "out\n"
    assert oct((tmp_path / "logs" / "c.log").stat().st_mode & 0o777) == "0o600"
