"""Output for people and for scripts: ``--json`` objects (docs/json.md), coloured tables, ``-v``, completion.

Real components throughout: the fake PBS for scheduler jobs, the ``local`` scheduler with the stand-in vLLM for
a server that answers, a pseudo-terminal for what a person sees, and Click's completion protocol in a
separate ``python -m pbs_toolkit`` process, as a shell would run it.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from helpers import launch, pbstk

from pbs_toolkit.cli.main import cli, load_all
from pbs_toolkit.cli.output import table
from pbs_toolkit.jobs.store import JobRecord, JobStore
from pbs_toolkit.schema import SCHEMA_VERSION

#: commands that print no result object (``logs`` prints the log itself)
NO_JSON = {"logs", "_keeper", "run"}  # _keeper: the hidden detached keeper prints no result; run: stdout is COMMAND's
ANSI = "\x1b["
LOCAL = ("--profile", "local-gpu", "--preset", "single", "--gpus-per-node", "1", "--port", "auto")


def json_of(*args: str) -> Any:
    """``pbstk ARGS`` (which must succeed) parsed as JSON; every object in it carries the schema stamp."""
    res = pbstk(*args)
    assert res.exit_code == 0, (args, res.output)
    data = json.loads(res.stdout)
    for item in data if isinstance(data, list) else [data]:
        assert item["schema_version"] == SCHEMA_VERSION and item["kind"], (args, item)
    return data


def commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    found = []
    for name, command in group.commands.items():
        found.append((f"{prefix}{name}", command))
        if isinstance(command, click.Group):
            found += commands(command, f"{prefix}{name} ")
    return found


def _only_groups_subcommands(command: click.Command) -> bool:
    """A group that prints nothing itself (``pbstk config`` only lists ``show``) needs no --json."""
    return isinstance(command, click.Group) and not command.invoke_without_command


# -- --json everywhere, one shape per object --------------------------------------------------------------------


def test_every_command_that_prints_a_result_has_json() -> None:
    missing = [name for name, command in commands(load_all())
               if name not in NO_JSON and not _only_groups_subcommands(command)
               and not any("--json" in p.opts for p in command.params)]
    assert missing == [], f"commands without --json (add it, or name them in NO_JSON): {missing}"


def test_settings_and_render_json_objects(tmp_path: Path) -> None:
    listed = json_of("presets", "--json")
    assert {p["kind"] for p in listed} == {"preset"}
    shown = json_of("presets", "show", "dp2", "--json")
    assert shown == next(p for p in listed if p["name"] == "dp2")  # one shape for the list and for show
    assert shown["layout"] == "DP2" and shown["gpus"] == 2 and shown["rationale"]
    profiles = json_of("profiles", "--json")
    assert {p["kind"] for p in profiles} == {"profile"} and "local" in {p["name"] for p in profiles}
    rendered = json_of("render", "org/model", *LOCAL, "--json")
    assert rendered["kind"] == "render" and "vllm" in rendered["start_script"] and not rendered["dry_run"]
    written = json_of("render", "org/model", *LOCAL, "-o", str(tmp_path / "out"), "--json")
    assert "job_script" not in written and all(Path(p).is_file() for p in written["written"])
    dry = json_of("launch", "org/model", *LOCAL, "--dry-run", "--json")
    assert dry["kind"] == "render" and dry["dry_run"] is True and dry["layout"] == rendered["layout"]


def test_jobs_and_status_agree_on_the_record_fields(fakepbs: Path, standins: Path) -> None:
    record = launch("--name", "same")
    listed = json_of("jobs", "--json")
    (job,) = [j for j in listed if j["job_id"] == record.job_id]
    (st,) = json_of("status", record.job_id, "--json")
    assert job["kind"] == st["kind"] == "job"
    shared = set(job) - {"extra"}  # runtime bookkeeping the status call may just have updated
    assert shared <= set(st) and {k: st[k] for k in shared} == {k: job[k] for k in shared}
    assert job["transport"] == st["transport"] == "local"
    assert st["state"] in ("PENDING", "STARTING", "READY")
    assert "api_key" not in job and record.api_key not in json.dumps([listed, st])
    (cancelled,) = json_of("cancel", record.job_id, "--json")
    assert cancelled == {"schema_version": SCHEMA_VERSION, "kind": "cancellation", "job_id": record.job_id,
                         "name": "same", "cancelled": True, "outcome": "cancelled"}
    # qdel returns before the job has ended (E, then F), and pbstk already says CANCELLED while the scheduler still
    # shows E: a second qdel then still reaches the exiting job. Wait for the scheduler's own end (F).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (st,) = json_of("status", record.job_id, "--json")
        if st["state"] == "CANCELLED" and st["scheduler_state"] in ("F", "FINISHED"):
            break
        time.sleep(0.5)
    (again,) = json_of("cancel", record.job_id, "--json")
    assert again["cancelled"] is False and again["outcome"] == "already ended"


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no line from the process in time"
    return proc.stdout.readline()


def test_commands_on_a_ready_server_print_their_objects(standins: Path, tmp_path: Path) -> None:
    launched = json_of("launch", "org/model", *LOCAL, "--name", "obj", "--wait", "--timeout", "60", "--json")
    job = launched["job_id"]
    try:
        assert launched["kind"] == "job" and launched["state"] == "READY" and "notes" in launched
        waited = json_of("wait", job, "--json")
        assert waited["state"] == "READY" and waited["url"] == launched["url"]
        endpoint = json_of("env", job, "--json")
        record = JobStore().find(job)
        assert endpoint["kind"] == "endpoint" and endpoint["base_url"] == launched["url"]
        assert endpoint["api_key"] == record.api_key == endpoint["env"]["OPENAI_API_KEY"]
        text = pbstk("env", job).stdout.splitlines()
        assert text == [f"export {k}={v}" for k, v in endpoint["env"].items()]  # same variables either way
        res = pbstk("metrics", job, "--json", "--interval", "0.1")
        assert res.exit_code == 0, res.output
        for line in res.stdout.splitlines():  # a stream: one object per line
            look = json.loads(line)
            assert (look["schema_version"], look["kind"], look["job_id"]) == (SCHEMA_VERSION, "metrics", job)
        bench = json_of("bench", job, "--client", "builtin", "-c", "1", "--num-prompts", "2", "--input-len", "4",
                        "--output-len", "3", "--json")
        assert bench["kind"] == "bench_result" and bench["results"][0]["completed"] == 2
        doctor = json_of("doctor", job, "--json")
        assert doctor["kind"] == "diagnosis" and doctor["job_id"] == job
        entry = json_of("update-endpoint", job, "--registry", str(tmp_path / "e.yaml"), "--json")
        assert entry["kind"] == "registry_entry" and entry["alias"] == "obj"
        proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", "tunnel", job, "--json"],  # noqa: S603
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            opened = json.loads(_first_line(proc, 30))
            assert opened["kind"] == "tunnel" and opened["schema_version"] == SCHEMA_VERSION
            assert opened["remote_url"] == launched["url"] and opened["local_url"].startswith("http://127.0.0.1:")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
    finally:
        pbstk("cancel", job)


# -- tables: plain for pipes, coloured for people ---------------------------------------------------------------

ROWS = [["1.pbs", "a", "READY"], ["2.pbs", "b", "FAILED"], ["3.pbs", "c", "PENDING"]]


def test_table_off_a_terminal_is_the_plain_columns() -> None:
    text = table(ROWS, ["JOB", "NAME", "STATE"])
    assert text.splitlines() == ["JOB    NAME  STATE", "1.pbs  a     READY", "2.pbs  b     FAILED",
                                 "3.pbs  c     PENDING"]


def test_table_on_a_terminal_colours_states_unless_no_color() -> None:
    coloured = table(ROWS, ["JOB", "NAME", "STATE"], rich=True, color=True, width=80)
    assert "\x1b[32mREADY" in coloured and "\x1b[31mFAILED" in coloured and "\x1b[33mPENDING" in coloured
    assert "1.pbs" in coloured and "\x1b[32m1.pbs" not in coloured  # only the state column
    plain = table(ROWS, ["JOB", "NAME", "STATE"], rich=True, color=False, width=80)
    assert ANSI not in plain and "─" in plain and "READY" in plain


def run_in_pty(args: list[str], env: dict[str, str], timeout: float = 60.0) -> str:
    """``python -m pbs_toolkit ARGS`` with stdout on a pseudo-terminal: what a person sees."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args], stdout=follower,  # noqa: S603
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        proc.wait(timeout=30)
    assert proc.returncode == 0, out
    return out.decode()


def test_status_on_a_terminal_is_coloured_and_in_a_pipe_plain(fakepbs: Path, standins: Path) -> None:
    record = launch("--name", "tty")
    try:
        env = {**os.environ, "TERM": "xterm", "COLUMNS": "200"}
        env.pop("NO_COLOR", None)
        seen = run_in_pty(["status"], env)
        assert record.job_id in seen and ANSI in seen and "─" in seen
        assert any(f"\x1b[33m{state}" in seen for state in ("PENDING", "STARTING")) or "\x1b[32mREADY" in seen
        no_color = run_in_pty(["status"], {**env, "NO_COLOR": "1"})
        assert record.job_id in no_color and ANSI not in no_color and "─" in no_color
        piped = pbstk("status")
        header = ["JOB", "NAME", "STATE", "SCHED", "UPTIME", "WALLTIME-LEFT", "URL", "DETAIL"]
        assert piped.stdout.splitlines()[0].split() == header
        assert ANSI not in piped.stdout and "─" not in piped.stdout
    finally:
        pbstk("cancel", record.job_id)


# -- -v: the commands pbstk runs ----------------------------------------------------------------------------


def test_verbose_shows_scheduler_commands_and_never_the_key(fakepbs: Path, standins: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "s3cret-key-value")
    res = CliRunner().invoke(cli, ["-v", "launch", "org/model", "--preset", "dp4", "--profile", "generic-pbspro",
                                   "--port", "auto", "--api-key-env", "MY_KEY"])
    assert res.exit_code == 0, res.output
    # qsub runs inside the submission wrapper (schedulers/marker.py): its script is summarised, its argv shown
    assert any(line.startswith("pbstk: run: ") and " qsub " in line for line in res.stderr.splitlines()), res.stderr
    assert "s3cret-key-value" not in res.stderr + res.stdout
    job = JobStore().find(None).job_id
    try:
        quiet = pbstk("status", job)
        assert quiet.exit_code == 0 and "qstat" not in quiet.stderr
        loud = pbstk("-v", "status", job)
        assert loud.exit_code == 0, loud.output
        qstat = [line for line in loud.stderr.splitlines() if line.startswith("pbstk: run: qstat ")]
        assert qstat and job in qstat[0], loud.stderr
        assert "qstat" not in loud.stdout  # stdout stays the result
        monkeypatch.setenv("PBSTK_VERBOSE", "1")
        assert "pbstk: run: qstat " in pbstk("status", job).stderr
        monkeypatch.setenv("PBSTK_VERBOSE", "0")
        assert "qstat" not in pbstk("status", job).stderr
    finally:
        pbstk("cancel", job)


@pytest.mark.ssh
def test_verbose_names_the_ssh_destination_not_stdin_or_env_values(login_node: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from pbs_toolkit.transports.ssh import SSHRunner

    with caplog.at_level("DEBUG", logger="pbs_toolkit.commands"), SSHRunner(
            login_node.alias, config_path=login_node.ssh_config, known_hosts_path=login_node.known_hosts) as ssh:
        assert ssh.run(["cat"], stdin="stdin-secret", env={"HF_TOKEN": "env-secret"}).stdout == "stdin-secret"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "pbs_toolkit.commands"]
    assert line == f"ssh {login_node.alias}: cat  [env HF_TOKEN; stdin given]"


# -- completion ---------------------------------------------------------------------------------------------


def complete(words: str, extra_env: dict[str, str] | None = None) -> list[str]:
    """What bash completion offers for ``words`` (the last word is being completed), from a fresh process."""
    parts = words.split(" ")
    env = {**os.environ, "_PBSTK_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1),
           **(extra_env or {})}
    res = subprocess.run([sys.executable, "-m", "pbs_toolkit"], env=env, capture_output=True, text=True,  # noqa: S603
                         timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return [line.split(",", 1)[1] for line in res.stdout.splitlines() if line.startswith("plain,")]


def _record(job_id: str, name: str) -> JobRecord:
    return JobRecord(job_id=job_id, scheduler="pbs", profile="generic-pbspro", model="org/m",
                     served_model_name="org/m", preset="dp4", name=name, run_dir=f"/runs/{name}", api_key="k")


def test_completion_of_jobs_presets_and_profiles(isolated_user: Path) -> None:
    store = JobStore()
    store.add(_record("41.pbs01", "alpha"))
    store.add(_record("42.pbs01", "beta"))
    assert {"41.pbs01", "42.pbs01", "alpha", "beta"} <= set(complete("pbstk status "))
    assert complete("pbstk cancel 4") == ["42.pbs01", "41.pbs01"] or set(complete("pbstk cancel 4")) == {
        "41.pbs01", "42.pbs01"}
    assert complete("pbstk logs al") == ["alpha"]
    from pbs_toolkit.services import record as records
    from pbs_toolkit.services.record import ServiceRecord

    for name in ("svc-on", "svc-off"):
        records.create(store, ServiceRecord(name=name, model="org/m", served_model_name="org/m", profile="local",
                                            replicas=1, request={}))
    records.end(store, records.find(store, "svc-off"), "CANCELLED")
    assert complete("pbstk metrics svc") == ["svc-on"]  # an active service's name, as for a job's
    assert set(complete("pbstk launch org/m --preset d")) == {"dp2", "dp4", "dp8"}
    assert set(complete("pbstk presets show d")) == {"dp2", "dp4", "dp8"}
    user_presets = isolated_user / "config" / "pbstk" / "presets"
    user_presets.mkdir(parents=True)
    (user_presets / "dmine.yaml").write_text((Path(__file__).parents[1] / "pbs_toolkit" / "settings" / "presets"
                                              / "dp2.yaml").read_text().replace("name: dp2", "name: dmine"))
    assert "dmine" in complete("pbstk render m --preset d")
    assert "polaris" in complete("pbstk launch m --profile p")


def test_completion_with_a_broken_store_offers_nothing_and_never_fails(isolated_user: Path) -> None:
    store_dir = isolated_user / "state" / "pbstk"
    store_dir.mkdir(parents=True, exist_ok=True)
    (store_dir / "jobs.sqlite3").write_bytes(b"this is not a database" * 100)
    assert complete("pbstk status ") == []
    assert set(complete("pbstk launch m --preset d")) == {"dp2", "dp4", "dp8"}  # presets do not need the store
