"""``launch`` records what the job was launched with as ``record.spec`` (a ``LaunchSpec``), not in ``extra``."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import launch

from pbs_toolkit.jobs.spec import SPEC_KEYS
from pbs_toolkit.jobs.store import JobStore


def test_launch_records_a_typed_spec_and_keeps_extra_for_bookkeeping(fakepbs: Path, standins: Path) -> None:
    record = launch("--name", "spec")
    spec = record.spec
    assert (spec.layout, spec.data_parallel, spec.tensor_parallel, spec.gpus) == ("DP4", 4, 1, 4)
    assert spec.vllm_version and spec.vllm_args and spec.ssh_host is None
    assert not SPEC_KEYS & record.extra.keys()
    on_disk = json.loads(Path(record.run_dir, "pbstk-job.json").read_text())  # what a lost store is rebuilt from
    assert on_disk["spec"] == spec.to_dict() and "api_key" not in on_disk
    assert JobStore().find("spec").spec == spec
