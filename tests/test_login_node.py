"""pbstk on a cluster's login node (issue 21, items 9 and 10): no SSH to yourself, and no silent local server.

The "site" is a user profile whose ssh_host is a name that never resolves and whose login_hosts match this
machine; the fake PBS's qsub on PATH makes this machine its login node. A launch that tried SSH would fail
with exit 4; one that does not submits to the fake PBS directly.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import MODEL, path_without, pbstk

from pbs_toolkit.jobs.store import JobStore

SITE = ["--profile", "site", "--preset", "dp4", "--port", "auto"]


@pytest.fixture
def site(isolated_user: Path) -> Path:
    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "site.yaml").write_text(
        "name: site\nscheduler: pbs\ngpus_per_node: 4\nssh_host: login.site.invalid\n"
        f"login_hosts: [{json.dumps(socket.gethostname())}]\n")
    return profiles


def ssh_host(*args: str) -> str | None:
    result = pbstk("config", "show", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["settings"]["ssh_host"]["value"]  # type: ignore[no-any-return]


def test_on_the_login_host_with_qsub_on_path_there_is_no_ssh(site: Path, fakepbs: Path, standins: Path) -> None:
    result = pbstk("launch", MODEL, *SITE, "--name", "here")
    assert result.exit_code == 0, result.output
    record = JobStore().find(result.stdout.split()[1])
    assert record.transport == "" and record.profile == "site"
    assert ssh_host("-P", "site") is None
    assert ssh_host("-P", "site", "--ssh", "other.invalid") == "other.invalid"  # an explicit host still wins
    pbstk("cancel", record.job_id)


def test_without_qsub_on_path_the_profile_still_sshes(site: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", path_without(tmp_path / "bin", "qsub"))
    assert ssh_host("-P", "site") == "login.site.invalid"
    assert ssh_host("-P", "polaris", "-A", "x") == "polaris.alcf.anl.gov"


@pytest.mark.parametrize("how", [["--ssh", "none"], ["--ssh", ""], ["env"]])
def test_ssh_none_or_empty_means_no_ssh(how: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if how == ["env"]:
        monkeypatch.setenv("PBSTK_SSH_HOST", "")
        how = []
    assert not ssh_host("-P", "polaris", "-A", "x", *how)
    dry = pbstk("launch", MODEL, "-P", "polaris", "-A", "x", "--dry-run", "--json", *how)
    assert dry.exit_code == 0, dry.output
    assert "$HOME" not in json.loads(dry.stdout)["run_dir"]  # paths are this machine's, not a remote home's


def test_no_profile_with_a_scheduler_on_path_is_refused(fakepbs: Path, standins: Path) -> None:
    result = pbstk("launch", MODEL, "--preset", "single", "--gpus-per-node", "1", "--port", "auto")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: ") and "--profile" in lines[0], result.stderr
    assert "qsub" in lines[0] and JobStore().all() == []
    ok = pbstk("launch", MODEL, "--profile", "local", "--preset", "cpu", "--port", "auto", "--name", "meant")
    assert ok.exit_code == 0, ok.output  # --profile local says you mean this machine
    pbstk("cancel", ok.stdout.split()[1])


def test_the_refusal_names_the_profile_of_this_login_host(site: Path, fakepbs: Path) -> None:
    result = pbstk("launch", MODEL, "--preset", "single", "--gpus-per-node", "1")
    assert result.exit_code == 2 and "pass --profile site for this cluster" in result.stderr, result.output
