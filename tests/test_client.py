"""The Python API: ``pbs_toolkit.Client``, ``pbs_toolkit.launched`` and the package-level shortcuts.

Everything runs for real on the ``local`` scheduler with the stand-in ``vllm`` (profile ``local-gpu``, one GPU).
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, wait_for
from sshd import SshdInfo

import pbs_toolkit
from pbs_toolkit.client import BenchResult, Client, Endpoint, Job
from pbs_toolkit.errors import ServerFailed, WaitTimeout
from pbs_toolkit.jobs.status import ServerState
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.transports import LocalRunner, Runner

README = Path(__file__).parent.parent / "README.md"
LOCAL = {"preset": "single", "profile": "local-gpu", "gpus_per_node": 1, "port": "auto"}


def server_pid(job: Job) -> int:
    """The stand-in server's pid, from the marker the start script writes."""
    data = wait_for(lambda: _marker(job).get("pid"), 10, "server.json with a pid")
    return int(data)


def _marker(job: Job) -> dict[str, Any]:
    try:
        return dict(json.loads(Path(job.run_dir, "server.json").read_text()))
    except (OSError, ValueError):
        return {}


def gone(pid: int) -> bool:
    """The process ended (a zombie counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def only_job_cancelled(client: Client) -> Any:
    """Poll status until the single job is recorded final; returns its status."""
    return wait_for(lambda: (s := client.status(all=True)[0]).state.final and s, 15, "the job to end")


# -- package-level functions -----------------------------------------------------------------------------------


def test_package_launch_twice_in_one_process_survives_submodule_imports(standins: Path) -> None:
    # the notebook sequence from issue 12: the second call used to hit "'module' object is not callable"
    first = pbs_toolkit.launch(MODEL, name="one", **LOCAL)
    for name in ("jobs.launch", "jobs.status", "jobs.render", "client"):  # what any caller may import in between
        importlib.import_module(f"pbs_toolkit.{name}")
    second = pbs_toolkit.launch(MODEL, name="two", **LOCAL)
    assert isinstance(first, Job) and isinstance(second, Job) and first.job_id != second.job_id
    assert callable(pbs_toolkit.status) and callable(pbs_toolkit.render) and callable(pbs_toolkit.cancel)
    states = pbs_toolkit.status(first, second.job_id)
    assert [s.record.job_id for s in states] == [first.job_id, second.job_id]
    assert pbs_toolkit.render(MODEL, **LOCAL).job_name
    assert pbs_toolkit.cancel(first) and pbs_toolkit.cancel("two")
    # the modules themselves are still importable by their full names
    assert importlib.import_module("pbs_toolkit.jobs.launch").launch is not pbs_toolkit.launch


# -- launched -------------------------------------------------------------------------------------------------


def test_launched_yields_a_working_endpoint_and_cancels_on_exception(standins: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), pbs_toolkit.launched(MODEL, timeout=30, name="s", **LOCAL) as ep:
        assert isinstance(ep, Endpoint) and ep.base_url.startswith("http://127.0.0.1:")
        assert ep.model == MODEL and ep.api_key and ep.api_key not in repr(ep)
        job = Client().jobs()[0]
        pid = server_pid(job)
        raise RuntimeError("boom")
    wait_for(lambda: gone(pid), 10, "the server to be stopped")
    assert only_job_cancelled(Client()).state is ServerState.CANCELLED


def test_launched_cancels_on_keyboard_interrupt(standins: Path) -> None:
    with pytest.raises(KeyboardInterrupt), pbs_toolkit.launched(MODEL, timeout=30, **LOCAL):
        pid = server_pid(Client().jobs()[0])
        raise KeyboardInterrupt
    wait_for(lambda: gone(pid), 10, "the server to be stopped")


def test_launched_cancels_when_the_wait_fails(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")  # never listens
    with pytest.raises(WaitTimeout), pbs_toolkit.launched(MODEL, timeout=1, **LOCAL):
        raise AssertionError("a server that never listens cannot be ready")
    assert only_job_cancelled(Client()).state is ServerState.CANCELLED


# -- Client --------------------------------------------------------------------------------------------------


class CountingRunner(LocalRunner):
    closed = 0

    def close(self) -> None:
        CountingRunner.closed += 1


@pytest.fixture
def runners_made(monkeypatch: pytest.MonkeyPatch) -> list[Runner]:
    """Every ``LocalRunner`` constructed during the test, by anyone (``open_runner`` in any module included)."""
    made: list[Runner] = []
    from pbs_toolkit.settings.machine_gpus import this_machine

    this_machine("local")  # this machine's GPUs, asked once per process and environment: not a runner of the job
    monkeypatch.setattr(LocalRunner, "__init__", lambda self: made.append(self), raising=False)
    return made


def test_one_runner_serves_every_call(standins: Path, runners_made: list[Runner]) -> None:
    opened: list[str] = []

    def factory(transport: str) -> Runner:
        opened.append(transport)
        return CountingRunner()

    CountingRunner.closed = 0
    with Client(runner_factory=factory, profile="local-gpu") as client:
        job = client.launch(MODEL, preset="single", gpus_per_node=1, port="auto")
        client.wait(job, timeout=30)
        client.status(job)
        client.endpoint(job)
        list(client.logs(job, lines=3))
        client.doctor(job)
        assert client.cancel(job)
        assert opened == [""]  # one runner (one connection, one login) for all of it
        assert len(runners_made) == 1
    assert CountingRunner.closed == 1


def test_job_arguments_like_the_cli(standins: Path) -> None:
    with Client() as client:
        job = client.launch(MODEL, name="named", **LOCAL)
        record = JobStore().find(job.job_id)
        prefix = job.job_id.split(".", 1)[0]
        assert {client.record(ref).job_id for ref in (job, record, job.job_id, prefix, "named", None)} == {
            job.job_id}
        assert [j.job_id for j in client.jobs()] == [job.job_id]
        assert client.cancel("named")


def test_endpoint_refuses_a_job_that_is_not_ready(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")
    with Client() as client:
        job = client.launch(MODEL, **LOCAL)
        try:
            with pytest.raises(ServerFailed, match=r"is (PENDING|STARTING), not READY"):
                client.endpoint(job)
        finally:
            client.cancel(job)


def test_logs_tail_and_follow_until_the_job_ends(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "exit-after-ready")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SECONDS", "1")
    with Client() as client:
        job = client.launch(MODEL, **LOCAL)
        client.wait(job, timeout=30)
        tail = list(client.logs(job, lines=2))
        assert len(tail) == 2 and all(isinstance(line, str) and "\n" not in line for line in tail)
        followed = list(client.logs(job, lines=1000, follow=True, final_every=0.3))  # returns: the job ends
        assert any("listening" in line for line in followed)
        assert client.status(job)[0].state.final
        assert followed[-3:] == list(client.logs(job, lines=3))  # followed to the very end of the file
        assert list(client.logs(job, lines=0)) == []


# -- the README ----------------------------------------------------------------------------------------------


def readme_example() -> str:
    """The python code block of the README's "Python API" section."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python API section has one python example"
    return blocks[0]


def test_readme_python_example_runs(standins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(readme_example(), str(README), "exec"), {"__name__": "readme"})  # noqa: S102
    out = capsys.readouterr().out
    assert re.search(rf"^http://127\.0\.0\.1:\d+/v1 {re.escape(MODEL)}$", out, re.M), out
    assert "\nREADY\n" in out
    with Client() as client:
        states = wait_for(lambda: (s := client.status(all=True)) and all(x.state.final for x in s) and s, 15,
                          "both README jobs to end")
    assert [s.state for s in states] == [ServerState.CANCELLED] * 2
    assert os.environ.get("PBSTK_TEST_RECORD")  # ran against the stand-in, not a real vLLM


def test_metrics_bench_and_tune_share_the_clients_runner(standins: Path, runners_made: list[Runner]) -> None:
    opened: list[str] = []

    def factory(transport: str) -> Runner:
        opened.append(transport)
        return LocalRunner()

    with Client(runner_factory=factory) as client:
        doc = client.tune(MODEL, ["single"], profile="local-gpu", gpus_per_node=1, port="auto", concurrencies=[1],
                          input_len=8, output_len=4, num_prompts=2, client="builtin", timeout=30)
        assert [run.preset for run in doc.runs] == ["single"] and doc.recommended == "single"
        assert doc.runs[0].results[0].client == "builtin" and doc.runs[0].throughput(1)
        job = client.launch(MODEL, **LOCAL)
        try:
            client.wait(job, timeout=30)
            metrics = client.metrics(job, interval=0.1)
            assert metrics.job_id == job.job_id and "running" in metrics.summary
            bench = client.bench(job, [1], input_len=8, output_len=4, num_prompts=2, client="builtin")
            assert [(r.concurrency, r.completed, r.failed) for r in bench.results] == [(1, 2, 0)]
            assert BenchResult.from_dict(bench.to_dict()) == bench
        finally:
            client.cancel(job)
    assert opened == [""] and len(runners_made) == 1  # tune used to open a runner of its own


@pytest.mark.ssh
def test_one_ssh_connection_for_a_whole_session(login_node: SshdInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_CONFIG", str(login_node.ssh_config))
    monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(login_node.known_hosts))
    with Client(profile="generic-pbspro") as client:
        job = client.launch(MODEL, preset="dp4", port="auto", ssh_host=login_node.alias)
        assert job.transport == login_node.alias
        try:
            client.wait(job, timeout=30)
            assert client.status(job)[0].state is ServerState.READY
            assert client.endpoint(job).model == MODEL
            assert list(client.logs(job, lines=2))
        finally:
            assert client.cancel(job)
        runner: Any = client.runner(login_node.alias)
        assert list(client._runners) == [login_node.alias]  # nothing else was opened
        assert runner.connections_opened == 1  # one connection, one login, for launch to cancel


def test_update_and_remove_endpoint(standins: Path, tmp_path: Path) -> None:
    registry = tmp_path / "endpoints.yaml"
    with Client() as client:
        job = client.launch(MODEL, name="reg", **LOCAL)
        try:
            update = client.update_endpoint(job, registry=str(registry), timeout=30)
            assert (update.alias, update.model, update.url) == ("reg", MODEL, client.endpoint(job).base_url)
            assert "reg" in registry.read_text()
            assert client.remove_endpoint("reg", str(registry)) is True
            assert client.remove_endpoint("reg", str(registry)) is False
            assert "reg" not in registry.read_text()
        finally:
            client.cancel(job)
