"""``doctor``'s advice: no "remove --enforce-eager" where eager is by design or pbstk's own fallback, no "server
failed" for a READY job, and a recommended command that keeps the launch's options and never repeats what runs.

Jobs run under the fake PBS with the stand-in vLLM.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.jobs.records import JobRecord
from pbs_toolkit.jobs.spec import LaunchSpec, split_vllm_args
from pbs_toolkit.jobs.status_types import ServerState
from pbs_toolkit.perf.doctor import DoctorContext, Remedy, diagnose
from pbs_toolkit.perf.recommend import relaunch

EAGER_RESTART = "pbstk: vLLM failed before it was ready with a graph/compile error (exit 1); restarting once with " \
                "--enforce-eager"
COMPILE_FAILED = "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: injected failure"


def _codes(ctx: DoctorContext) -> dict[str, str]:
    return {f.code: f"{f.severity} {f.title} {f.fix}" for f in diagnose(ctx)}


def test_cpu_preset_is_eager_by_design() -> None:
    assert "eager-mode" in _codes(DoctorContext(vllm_args=["--enforce-eager"], vllm_version="0.22.1"))
    assert _codes(DoctorContext(vllm_args=["--enforce-eager"], vllm_version="0.22.1", device="cpu")) == {}


def test_eager_fallback_is_named_with_its_cause_not_as_a_flag_to_remove() -> None:
    log = ["INFO starting", COMPILE_FAILED, EAGER_RESTART, "pbstk: attempt 2: starting vLLM on n:8000: vllm serve",
           "WARNING [cuda.py:1] Cudagraph is disabled under eager mode"]
    found = {f.code: f for f in diagnose(DoctorContext(vllm_args=["--enforce-eager"], log_lines=log,
                                                       eager_fallback=True, state=ServerState.READY))}
    assert set(found) == {"eager-fallback"}
    assert COMPILE_FAILED in found["eager-fallback"].evidence
    assert "Remove --enforce-eager" not in found["eager-fallback"].fix


def test_ready_job_has_no_server_failed_finding() -> None:
    log = [COMPILE_FAILED, "RuntimeError: Engine core initialization failed. See root cause above."]
    assert "server-failed" in _codes(DoctorContext(log_lines=log, state=ServerState.FAILED))
    assert "server-failed" not in _codes(DoctorContext(log_lines=log, state=ServerState.READY))


def _doctor(job: str) -> dict[str, object]:
    result = pbstk("doctor", job, "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def _launch(*args: str) -> str:
    result = pbstk("launch", MODEL, "--profile", "generic-pbspro", "--port", "auto", "--wait", *args)
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()[0].split()[1]


def test_recommended_command_keeps_the_launch_options(fakepbs: Path, standins: Path) -> None:
    job = _launch("--preset", "tp2", "--account", "proj-x", "--queue", "workq", "--walltime", "00:30:00",
                  "--vllm-arg=--max-model-len=4096", "--env", "MY_SETTING=1", "--name", "doc")
    d = _doctor(job)
    assert d["recommended_preset"] == "dp2", d
    argv = shlex.split(str(d["launch"]))
    assert argv[:5] == ["pbstk", "launch", MODEL, "--preset", "dp2"]
    for option in (["--account", "proj-x"], ["--queue", "workq"], ["--walltime", "00:30:00"],
                   ["--env", "MY_SETTING=1"], ["--name", "doc"], ["--profile", "generic-pbspro"]):
        assert any(argv[i:i + 2] == option for i in range(len(argv))), (option, argv)
    assert "--vllm-arg=--max-model-len=4096" in argv
    pbstk("cancel", job)
    # what doctor recommends, launched: no advice to launch it again
    rerun = pbstk(*argv[1:5], "--profile", "generic-pbspro", "--port", "auto", "--wait", "--account", "proj-x",
                  "--name", "doc2")
    assert rerun.exit_code == 0, rerun.output
    again = rerun.stdout.splitlines()[0].split()[1]
    d2 = _doctor(again)
    assert d2["recommended_preset"] is None and d2["launch"] is None, d2
    pbstk("cancel", again)


def test_eager_fallback_job_is_not_told_to_remove_eager(fakepbs: Path, standins: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "compile-fail-once")
    job = _launch("--preset", "dp2", "--name", "fellback")
    d = _doctor(job)
    assert d["state"] == "READY"
    codes = {f["code"]: f for f in d["findings"]}  # type: ignore[attr-defined]
    assert "server-failed" not in codes and "eager-mode" not in codes, codes
    assert "BackendCompilerFailed" in codes["eager-fallback"]["evidence"]
    assert d["launch"] is None, d  # dp2 is what auto picks for a 2B model: nothing to relaunch
    text = pbstk("doctor", job).stdout
    assert "[high] The server failed" not in text and "Remove --enforce-eager" not in text, text
    pbstk("cancel", job)


def test_a_kv_cache_too_small_for_one_request_is_named_with_its_fix() -> None:
    """vLLM 0.22.1's log of a model whose KV cache cannot hold one request of its max length: doctor names the
    engine core's ValueError (not the API server's "See root cause above") and says which flags to change.
    Before: the finding quoted the wrapper and said "Read the log around this line"."""
    log = (Path(__file__).parent / "data" / "observe" / "startup-0.22.1-kv-short.log").read_text().splitlines()
    found = {f.code: f for f in diagnose(DoctorContext(log_lines=log, state=ServerState.FAILED))}
    failed = found["server-failed"]
    assert failed.evidence.startswith("log: ValueError: To serve at least one request with the model's max seq len "
                                      "(40960)"), failed.evidence
    assert "raise --gpu-memory-utilization or lower --max-model-len" in failed.fix, failed.fix


def _findings_text(text: str) -> dict[str, list[str]]:
    """``doctor``'s human output: each finding's title -> its own lines (``evidence:``, ``fix:``, ``relaunch:``)."""
    found: dict[str, list[str]] = {}
    title = ""
    for line in text.splitlines():
        if line.startswith("["):
            title = line
            found[title] = []
        elif line.startswith("  ") and title:
            found[title].append(line)
        else:
            title = ""
    return found


def _dry_run(relaunch: str) -> tuple[list[str], dict[str, object]]:
    """The relaunch command's argv, and ``launch --dry-run --json`` of it through the CLI."""
    argv = shlex.split(relaunch)
    assert argv[:3] == ["pbstk", "launch", MODEL], argv
    result = pbstk(*argv[1:], "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    return argv, dict(json.loads(result.stdout))


def test_each_fixable_finding_prints_the_command_that_relaunches_it_fixed(fakepbs: Path, standins: Path) -> None:
    """issue 44 item 5a: "Remove --enforce-eager" came with no command to do it. Each finding a new launch fixes
    now has the job's own launch command with only that fix applied, on its own line (JSON: ``relaunch``)."""
    job = _launch("--preset", "dp2", "--name", "eag", "--account", "proj-x", "--vllm-arg=--enforce-eager",
                  "--vllm-arg=--max-num-batched-tokens=2048", "--vllm-arg=--no-enable-prefix-caching",
                  "--env", "MY_SETTING=a b")
    d = _doctor(job)
    by_code = {f["code"]: f for f in d["findings"]}  # type: ignore[attr-defined]
    assert {"eager-mode", "small-batched-tokens", "prefix-caching-off"} <= set(by_code), by_code
    assert all("relaunch" in f for f in by_code.values())
    text = pbstk("doctor", job).stdout
    assert text.endswith("\n")
    human = _findings_text(text)
    for code, dropped, kept in (
        ("eager-mode", "--vllm-arg=--enforce-eager", "--vllm-arg=--max-num-batched-tokens=2048"),
        ("small-batched-tokens", "--vllm-arg=--max-num-batched-tokens=2048", "--vllm-arg=--enforce-eager"),
        ("prefix-caching-off", "--vllm-arg=--no-enable-prefix-caching", "--vllm-arg=--enforce-eager"),
    ):
        finding = by_code[code]
        relaunch = str(finding["relaunch"])
        lines = human[f"[{finding['severity']}] {finding['title']}"]
        assert lines == [f"  evidence: {finding['evidence']}", f"  fix:      {finding['fix']}",
                         f"  relaunch: {relaunch}"], lines  # the fix ends its line; the command has its own
        argv, rendered = _dry_run(relaunch)
        assert dropped not in argv and kept in argv and "proj-x" in argv, argv
        assert ["--env", "MY_SETTING=a b"] == argv[argv.index("--env"):argv.index("--env") + 2]
        assert "'MY_SETTING=a b'" in relaunch  # each value quoted for the shell
        args = rendered["vllm_args"]
        assert dropped.split("=", 1)[1] not in args, args  # type: ignore[operator]
    assert "--vllm-arg=--max-num-batched-tokens=8192" in shlex.split(str(by_code["small-batched-tokens"]["relaunch"]))
    pbstk("cancel", job)


def test_an_eager_preset_and_tp_on_a_small_model_relaunch_as_graphs_and_dp(fakepbs: Path, standins: Path) -> None:
    job = _launch("--preset", "tp2-eager", "--name", "tpeager")
    d = _doctor(job)
    by_code = {f["code"]: f for f in d["findings"]}  # type: ignore[attr-defined]
    argv, rendered = _dry_run(str(by_code["eager-mode"]["relaunch"]))
    assert argv[argv.index("--preset") + 1] == "tp2-eager" and "--no-eager" in argv
    assert "EAGER=false" in str(rendered["start_script"])
    argv, rendered = _dry_run(str(by_code["tp-small-model"]["relaunch"]))
    assert argv[argv.index("--preset") + 1] == "dp2" and rendered["layout"] == "DP2", argv
    assert by_code.get("kv-underused-load", {}).get("relaunch") is None  # the client's load: no launch fixes it
    pbstk("cancel", job)


def _record(user: list[str], preset_flags: list[str], *, eager: bool = False, preset: str = "dp2") -> JobRecord:
    """A job record as ``launch`` writes it: the rendered vLLM arguments end with the user's ``--vllm-arg``s."""
    rendered = ["--served-model-name", "m", "--data-parallel-size", "2", *preset_flags, *user]
    options = ["--queue", "--vllm-arg=odd", "--port", "auto", *(f"--vllm-arg={a}" for a in user), "--env", "A=1 2"]
    return JobRecord("1.x", "pbs", "p", MODEL, "m", preset, "job", "/r",
                     spec=LaunchSpec(vllm_args=rendered, eager=eager, options=options))


@pytest.mark.parametrize(("user", "preset_flags", "remedy", "eager", "wanted"), [
    # a value set replaces the user's, in either spelling, and overrides the preset's
    (["--max-num-seqs", "64"], ["--max-num-seqs", "512"], Remedy(set=("--max-num-seqs=256",)), False,
     ["--vllm-arg=--max-num-seqs=256"]),
    ([], ["--max-num-seqs", "512"], Remedy(set=("--max-num-seqs=2048",)), False, ["--vllm-arg=--max-num-seqs=2048"]),
    # a bare flag: needed only against the preset's other spelling
    (["--no-enable-prefix-caching"], [], Remedy(set=("--enable-prefix-caching",)), False, []),
    ([], ["--no-enable-prefix-caching"], Remedy(set=("--enable-prefix-caching",)), False,
     ["--vllm-arg=--enable-prefix-caching"]),
    # eager: the user's flag dropped; an eager preset turned off
    (["--enforce-eager=true", "--max-model-len=4096"], [], Remedy(drop=("--enforce-eager",), eager_off=True), False,
     ["--vllm-arg=--max-model-len=4096"]),
    ([], [], Remedy(drop=("--enforce-eager",), eager_off=True), True, ["--no-eager"]),
    # nothing a launch option can change: no command
    ([], ["--swap-space", "4"], Remedy(drop=("--swap-space",)), False, None),
    ([], [], Remedy(drop=("--enforce-eager",), eager_off=True), False, None),
    (["--max-num-seqs=64"], [], None, False, None),
])
def test_relaunch_applies_only_the_remedy(user: list[str], preset_flags: list[str], remedy: Remedy | None,
                                          eager: bool, wanted: list[str] | None) -> None:
    command = relaunch(_record(user, preset_flags, eager=eager), remedy)
    if wanted is None:
        assert command is None
        return
    assert command is not None
    assert shlex.split(command) == ["pbstk", "launch", MODEL, "--preset", "dp2", "--profile", "p", "--name", "job",
                                    "--queue", "--vllm-arg=odd", "--port", "auto", "--env", "A=1 2", *wanted]


def test_relaunch_of_auto_asks_for_auto_and_a_layout_names_its_preset() -> None:
    record = _record([], [], preset="auto (TP2 x DP2)")
    assert shlex.split(relaunch(record, Remedy(set=("--max-num-seqs=8",))) or "")[4] == "auto"
    assert shlex.split(relaunch(record, Remedy(layout=(1, 4))) or "")[4] == "dp4"


def test_split_vllm_args_never_takes_a_value_for_a_vllm_arg() -> None:
    assert split_vllm_args(["--queue", "--vllm-arg=q", "--vllm-arg=-tp", "--no-eager", "--env", "X=--vllm-arg=1"]) == (
        ["--queue", "--vllm-arg=q", "--no-eager", "--env", "X=--vllm-arg=1"], ["-tp"])
