"""A launch resolves its settings once (issue 22, item 1): the user's config.yaml and the profile file are read once,
``resolve_settings`` and ``fill_profile`` run once, and a profile is validated three times (parsed, layered,
filled), whether the launch is a dry run, a real submission, a service's replica or ``tune``'s preset check.

Before, choosing the runner needed ``ssh_host`` and ``render`` needed the runner, so one launch resolved
everything up to four times (a local service replica five). The counts are taken with ``sys.setprofile`` on the
functions' code objects, so a caller that imports them under another name is counted too.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.client import Client
from pbs_toolkit.settings import config, placeholders, profiles, yamlio

#: what one resolution costs, and what a second one would show
ONCE = {"resolve_settings": 1, "fill_profile": 1, "validate": 3, "config.yaml": 1, "generic-pbspro.yaml": 1}


@contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Count calls of the resolution's functions, and YAML reads by file name, within the block."""
    names = {config.resolve_settings.__code__: "resolve_settings", placeholders.fill_profile.__code__: "fill_profile",
             profiles.validate.__code__: "validate"}
    reads = yamlio.load_yaml_mapping.__code__
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code in names:
            counts[names[frame.f_code]] += 1
        elif frame.f_code is reads:
            counts[Path(str(frame.f_locals.get("path"))).name] += 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def resolutions(action: Callable[[], Any], profile_file: str = "generic-pbspro.yaml") -> dict[str, int]:
    with counting() as counts:
        action()
    keys = ("resolve_settings", "fill_profile", "validate", "config.yaml", profile_file)
    return {k.replace(profile_file, "generic-pbspro.yaml"): counts[k] for k in keys}


@pytest.fixture
def account() -> None:
    path = Path(os.environ["XDG_CONFIG_HOME"]) / "pbstk" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("account: PROJ\n")  # a user config: read once as well


def test_a_dry_run_resolves_once(account: None) -> None:
    with Client() as c:
        req = c.request(MODEL, "dp4", "generic-pbspro")
        assert resolutions(lambda: c.launch_request(req, dry_run=True)) == ONCE
    result = None

    def cli() -> None:
        nonlocal result
        result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--dry-run")

    assert resolutions(cli) == ONCE
    assert result is not None and result.exit_code == 0, result.output


def test_a_submitted_launch_resolves_once(account: None, fakepbs: Path) -> None:
    with Client() as c:
        assert resolutions(lambda: c.launch(MODEL, "dp4", "generic-pbspro", port="auto")) == ONCE
        assert len(c.jobs()) == 1  # it did submit


def test_a_local_service_replica_resolves_once(standins: Path) -> None:
    from pbs_toolkit.services import manage
    from pbs_toolkit.services import record as records
    from pbs_toolkit.services.record import ServiceRecord, Slot
    from pbs_toolkit.settings.launch_settings import RenderRequest

    req = RenderRequest(model=MODEL, preset="cpu", profile="local", port="auto")
    rec = ServiceRecord(name="once", model=MODEL, served_model_name=MODEL, profile="local", replicas=1,
                        request=asdict(req), scheduler="local", slots=[Slot(0)], api_key="k" * 32)
    with Client() as c:
        records.create(c.store, rec)
        jobs: list[str] = []
        session = c.service_session()
        counts = resolutions(lambda: jobs.append(manage.launch_replica(session, rec, rec.slots[0])), "local.yaml")
        try:
            assert counts == {**ONCE, "config.yaml": 0}  # no config.yaml here: looked for, not read
            assert c.store.find(jobs[0]).name == "once-r0"
        finally:
            c.cancel(jobs[0])


def test_tune_checks_every_preset_from_one_resolution(account: None) -> None:
    from pbs_toolkit.perf.tune import check_presets
    from pbs_toolkit.settings.launch_settings import resolve_launch_settings

    with Client() as c:
        counts = resolutions(lambda: check_presets(
            resolve_launch_settings(c.request(MODEL, None, "generic-pbspro")), ["dp4", "tp4", "tp2dp2"],
            c.runner("")))
    assert counts == ONCE


# -- the object itself -------------------------------------------------------------------------------------------


def test_launch_settings_are_immutable_and_keep_each_values_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    monkeypatch.setenv("PBSTK_WALLTIME", "02:00:00")
    req = RenderRequest(model=MODEL, profile="generic-pbspro", queue="debug", env={"A": "1"})
    settings = resolve_launch_settings(req)
    assert (settings.written.queue, settings.sources["queue"]) == ("debug", "flag --queue")
    assert (settings.written.walltime, settings.sources["walltime"]) == ("02:00:00", "PBSTK_WALLTIME")
    assert settings.sources["gpus_per_node"] == "profile generic-pbspro"
    assert settings.sources["bind_host"] == "package default"
    assert (settings.preset_name, settings.preset_source) == ("auto", "package default")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.preset = "tp4"  # type: ignore[misc]
    req.env["A"] = "2"  # the caller's request changes later: the resolved settings do not
    assert settings.request.env == {"A": "1"}


def test_with_request_changes_only_what_needs_no_resolution() -> None:
    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    settings = resolve_launch_settings(RenderRequest(model=MODEL, profile="generic-pbspro"))
    other = settings.with_request(preset="tp4", name="x", vllm_args=["--max-num-seqs", "8"])
    assert (other.preset_name, other.preset_source, other.request.name) == ("tp4", "flag --preset", "x")
    assert settings.preset_name == "auto" and settings.request.name is None  # the original is untouched
    for change in ({"queue": "debug"}, {"profile": "local"}, {"preset": None}, {"port": 9000}):
        with pytest.raises(ValueError, match="resolve the request again"):
            settings.with_request(**change)


def test_the_account_check_waits_for_a_launch_but_not_for_planning() -> None:
    from pbs_toolkit.errors import UsageError
    from pbs_toolkit.jobs.plan import plan_layout
    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    # polaris requires an account, and its hf_home holds {account}: both refusals wait for a launch
    settings = resolve_launch_settings(RenderRequest(model=MODEL, profile="polaris", preset="dp4"))
    with pytest.raises(UsageError, match="profile polaris needs an account: pass --account"):
        settings.launchable()  # the account first, as render always reported it
    preset, plan, _ = plan_layout(settings)  # presets show: no account needed
    assert (preset.name, plan.nnodes) == ("dp4", 1)
    problems = settings.problems()  # config show: every reason, as warnings
    assert problems[0] == f"profile polaris needs an account: {config.how_to_set('account')}"
    assert len(problems) == 2 and "hf_home" in problems[1] and "{account}" in problems[1]
