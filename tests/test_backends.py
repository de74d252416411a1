"""Scheduler backends as plug-ins: one registry feeds profiles, the CLI and the stream names; a profile may keep
a backend's own keys in a section named after it (flat profiles still load); each backend maps its own exit
information to one ``Outcome`` (tested with the real backends in test_status_combine and test_launch_local)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.errors import ConfigError, SchedulerError, SchedulerUnavailable, UsageError
from pbs_toolkit.jobs.logs import stream_path, streams
from pbs_toolkit.schedulers import BACKENDS, JobRef, Scheduler, SchedulerJob, get_scheduler
from pbs_toolkit.schedulers.base import status_failed
from pbs_toolkit.settings.profiles import SCHEDULERS, load_profile
from pbs_toolkit.transports import LocalRunner
from pbs_toolkit.transports.base import Result

FLAT = """name: site
scheduler: pbs
queue: debug
account: proj1
filesystems: home:eagle
extra_directives: ["-l foo=bar"]
walltime: "00:30:00"
"""
NESTED = """name: site
scheduler: pbs
walltime: "00:30:00"
pbs:
  queue: debug
  account: proj1
  filesystems: home:eagle
  extra_directives: ["-l foo=bar"]
"""


def test_every_backend_provides_the_whole_interface() -> None:
    assert list(BACKENDS) == list(SCHEDULERS)  # profiles validate against the registry itself
    for name, cls in BACKENDS.items():
        backend = get_scheduler(name)
        assert isinstance(backend, Scheduler) and backend.name == name and cls.description
        assert (cls.template_dir / cls.template_name).is_file(), name
        assert cls.script_name and "/" not in cls.script_name
        assert set(cls.streams) == {"sched-out", "sched-err"}, name
        assert backend.stop_hint("1.x", "/runs/r")


def test_the_cli_offers_exactly_the_registered_backends() -> None:
    result = pbstk("launch", "--help")
    for name in BACKENDS:
        assert name in result.stdout
    refused = pbstk("launch", MODEL, "--scheduler", "nosuch")
    assert refused.exit_code == 2 and "nosuch" in refused.output


def test_a_backend_section_loads_like_the_flat_keys(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(FLAT)
    nested.write_text(NESTED)
    a, b = load_profile(str(flat)), load_profile(str(nested))
    assert (a.queue, a.account, a.filesystems, a.extra_directives) == ("debug", "proj1", "home:eagle", ["-l foo=bar"])
    assert {k: v for k, v in a.__dict__.items() if k != "source"} == {
        k: v for k, v in b.__dict__.items() if k != "source"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (NESTED.replace("  queue: debug", "  port: 9000"), "section 'pbs' has unknown key 'port'"),
        (NESTED + "queue: other\n", "given both at the top level and in section 'pbs'"),
        (NESTED.replace("pbs:\n", "pbs: 3\nx:\n"), "section 'pbs' must be a mapping"),
        # a section for another backend than the profile's is not read: it is an unknown key
        (NESTED.replace("scheduler: pbs", "scheduler: local"), "pbs"),
    ],
)
def test_a_bad_backend_section_is_refused(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_profile(str(path))


def test_backend_keys_are_checked_by_the_backend(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(NESTED.replace("  queue: debug", "  queue: 'debug -V'"))
    with pytest.raises(UsageError, match="bad queue"):
        load_profile(str(path))


def test_stream_names_are_generic_and_the_old_ones_still_work() -> None:
    assert {"vllm", "sched-out", "sched-err", "pbs-out", "pbs-err"} <= set(streams())
    assert stream_path("/r", "pbs", "sched-out") == stream_path("/r", "pbs", "pbs-out") == "/r/pbs.out"
    assert stream_path("/r", "pbs", "pbs-err") == "/r/pbs.err"
    # the local backend's output is what its supervisor captured, not a file PBS would have written
    assert stream_path("/r", "local", "sched-err") == "/r/.local-job/stderr"
    assert stream_path("/r", "local", "vllm") == "/r/vllm.log"
    with pytest.raises(UsageError, match="unknown log stream"):
        stream_path("/r", "pbs", "nope")


class _CommandBackend(Scheduler):
    """A backend as a contributor writes one: argument lists and answers only. The sequence (the submission
    wrapper, retries, the timeout, the errors) comes from the base, with real commands run by a real runner."""

    name = "cmd"

    def __init__(self, status: list[str], cancel: list[str], submit_rc: int = 0) -> None:
        self.status, self.cancel_cmd, self.submit_rc = status, cancel, submit_rc

    def submit_command(self, runner: Any, script_path: str, *, begin_at: float | None,
                       after: str | None) -> tuple[list[str], dict[str, str]]:
        return (["sh", "-c", 'echo "$SITE_ID"; echo "$1" >&2; exit "$2"', "sh", script_path, str(self.submit_rc)],
                {"SITE_ID": "42.site"})

    def parse_job_id(self, stdout: str) -> str:
        return stdout.strip()

    def status_argv(self, job_ids: Sequence[str]) -> list[str]:
        return self.status

    def read_status(self, runner: Any, job_ids: Sequence[str], result: Result) -> dict[str, SchedulerJob]:
        if result.rc != 0:
            raise status_failed("status", result)
        return {}

    def cancel_argv(self, job_id: str) -> list[str]:
        return self.cancel_cmd


def test_the_base_runs_the_submit_query_cancel_sequence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = LocalRunner()
    sched = _CommandBackend(["sh", "-c", "exit 3"], ["sh", "-c", "echo nope >&2; exit 5"])
    # submit: the command's stdout is the id, and the wrapper leaves it in RUN_DIR/job_id (with the env it needed)
    assert sched.submit(runner, "/r/job.x", str(tmp_path), "t") == "42.site"
    assert (tmp_path / "job_id").read_text() == "42.site\n"
    with pytest.raises(SchedulerError, match=r"sh refused the job: /r/job.x"):
        _CommandBackend([], [], submit_rc=1).submit(runner, "/r/job.x", str(tmp_path), "t")
    assert (tmp_path / "submit_rc").read_text() == "1\n"
    # query and cancel: refused is SchedulerError with the words, a killed command SchedulerUnavailable
    with pytest.raises(SchedulerError, match=r"status failed \(exit 3\)"):
        sched.query(runner, [JobRef("1", str(tmp_path))])
    assert sched.query(runner, []) == {}
    with pytest.raises(SchedulerError, match=r"sh 1 failed \(exit 5\): nope"):
        sched.cancel(runner, JobRef("1", str(tmp_path)))
    killed = _CommandBackend(["sh", "-c", "kill -9 $$"], ["sh", "-c", "kill -9 $$"])
    with pytest.raises(SchedulerUnavailable, match="killed"):
        killed.query(runner, [JobRef("1", str(tmp_path))])
    with pytest.raises(SchedulerUnavailable, match="was killed .* is the job stopped"):
        killed.cancel(runner, JobRef("1", str(tmp_path)))
    # a hung status or cancel command is "the scheduler did not answer", after PBSTK_SCHEDULER_TIMEOUT_S
    monkeypatch.setenv("PBSTK_SCHEDULER_TIMEOUT_S", "0.3")
    hung = _CommandBackend(["sleep", "30"], ["sleep", "30"])
    with pytest.raises(SchedulerUnavailable, match="did not answer within 0.3 s"):
        hung.query(runner, [JobRef("1", str(tmp_path))])
    with pytest.raises(SchedulerUnavailable, match="did not answer within 0.3 s"):
        hung.cancel(runner, JobRef("1", str(tmp_path)))


def test_a_profile_keeps_a_backends_keys_in_its_section(tmp_path: Path) -> None:
    """``Profile`` holds the generic keys; what one backend reads is in ``profile.backend``, of that backend's
    ``section_type``, whether the file nests the keys or keeps them flat."""
    from dataclasses import fields

    from pbs_toolkit.schedulers.pbs import PBSKeys
    from pbs_toolkit.schedulers.slurm import SlurmKeys
    from pbs_toolkit.settings.profiles import Profile

    own = {f.name for cls in BACKENDS.values() for f in fields(cls.section_type)}
    assert {"select", "place", "qos", "exclusive", "gpu_directive"} <= own
    assert not own & {f.name for f in fields(Profile)}  # not one flat Profile holding every backend's keys
    for text in (FLAT, NESTED):
        (tmp_path / "p.yaml").write_text(text)
        pbs = load_profile(str(tmp_path / "p.yaml"))
        assert pbs.backend == PBSKeys(filesystems="home:eagle", extra_directives=["-l foo=bar"])
        assert (pbs.queue, pbs.account) == ("debug", "proj1")  # every batch scheduler's: generic
    slurm = load_profile("perlmutter")
    assert type(slurm.backend) is SlurmKeys and slurm.backend.qos == "regular" and not slurm.backend.exclusive
    assert not hasattr(slurm.backend, "select") and not hasattr(pbs.backend, "exclusive")


def test_another_backends_flat_key_is_accepted_and_not_read(tmp_path: Path) -> None:
    """As before sections: a flat key only another backend reads loads (config.yaml sets such keys for every
    profile) and reaches nothing; in the backend's own section it is refused (test above)."""
    path = tmp_path / "p.yaml"
    path.write_text(FLAT + "qos: debug\nexclusive: true\n")
    profile = load_profile(str(path))
    assert not hasattr(profile.backend, "qos") and profile.to_dict()["qos"] is None
    rendered = pbstk("render", MODEL, "--profile", str(path), "--preset", "dp4")
    assert rendered.exit_code == 0, rendered.output
    assert "qos" not in rendered.stdout and "exclusive" not in rendered.stdout


def test_switching_the_scheduler_switches_the_section() -> None:
    """``--scheduler`` on a profile: the new backend's section, keys both read carried over (a cluster profile
    tried with ``--scheduler local`` keeps its PBS keys: local runs the PBS template)."""
    from pbs_toolkit.schedulers.pbs import PBSKeys
    from pbs_toolkit.schedulers.slurm import SlurmKeys
    from pbs_toolkit.services.router.job import job_profile

    polaris = load_profile("polaris")
    local = polaris.with_overrides({"scheduler": "local"})
    assert local.backend == polaris.backend and type(local.backend) is PBSKeys
    slurm = polaris.with_overrides({"scheduler": "slurm", "qos": "debug", "extra_directives": ["--mem=0"]})
    assert slurm.backend == SlurmKeys(qos="debug", extra_directives=["--mem=0"])
    assert polaris.with_overrides({"qos": "debug"}).backend == polaris.backend  # not PBS's: dropped
    # a router job never takes whole nodes, whatever the backend calls that
    exclusive = slurm.with_overrides({"exclusive": True})
    assert exclusive.backend.exclusive and not job_profile(exclusive).backend.exclusive
    assert job_profile(polaris).backend == polaris.backend
