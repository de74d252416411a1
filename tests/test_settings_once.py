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
    path.write_text("account: PROJ\n")  # generic-pbspro needs one; the user's config is read as well


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
        counts = resolutions(lambda: jobs.append(manage.launch_replica(c, rec, rec.slots[0])), "local.yaml")
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
