"""benchmarks/cpu/bench_status_calls.py counts what it claims: pbstk's status poll is one scheduler call whatever N,
and the replay of vec-inf's ``status`` makes 1 + 2N calls against a real Slurm."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
from slurm_cluster import SlurmCluster

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "cpu" / "bench_status_calls.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_status_calls", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pbstk_polls_n_jobs_with_one_qstat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mod = bench()
    home = tmp_path / "fakepbs"
    home.mkdir()
    for key, value in {"FAKEPBS_HOME": str(home), "FAKEPBS_KILL_DELAY": "1", "FAKEPBS_EXITING_DELAY": "0.2"}.items():
        monkeypatch.setenv(key, value)
    try:
        calls, _seconds = mod.pbs_poll(tmp_path, 3)
    finally:
        ids = [p.stem for p in (home / "jobs").glob("*.json")]
        os.spawnv(os.P_WAIT, str(mod.FAKEPBS_BIN / "qdel"), ["qdel", *ids])  # noqa: S606 - argument list
    assert dict(calls) == {"qstat": 1}


def test_vec_inf_replay_makes_one_plus_two_n_calls(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    mod = bench()
    slurm_cluster.cancel_all()
    for _ in range(3):
        slurm_cluster.run("sbatch", f"--output={tmp_path}/%j.out", "--wrap=sleep 60")
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    shims = mod.Shims(tmp_path / "shims", slurm_cluster.env["PATH"])
    calls, _seconds = shims.counted(mod.vec_inf_status_all)
    slurm_cluster.cancel_all()
    assert dict(calls) == {"squeue": 1, "scontrol": 6}
