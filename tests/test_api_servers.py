"""Several vLLM API-server processes in front of one engine (issue 43 item 1; docs/vllm.md "API servers").

The one-GPU presets ask for ``ONE_GPU_SERVERS`` where they apply; every reader of a server stays right when the
stand-in runs them as vLLM 0.22.1 did on an H200: one port, ``/metrics`` the sum of every process, and requests
gauges that keep the last busy step's value once the engine is idle.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import MODEL, pbstk, status_of, wait_recorded
from test_multimodal import TEXT_CONFIG, flag_value, render, vllm_args

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.settings.front_servers import ONE_GPU_SERVERS
from pbs_toolkit.vllm.prom import parse_metrics, settle

FLAG = "--api-server-count"


@pytest.fixture
def text_model(tmp_path: Path) -> str:
    d = tmp_path / "models" / "m-text"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TEXT_CONFIG))
    return str(d)


# -- which launches ask for several ----------------------------------------------------------------------------------


def test_one_gpu_presets_ask_for_several_api_servers(text_model: str) -> None:
    assert flag_value(vllm_args(render(text_model, "-p", "single")), FLAG) == str(ONE_GPU_SERVERS)
    assert flag_value(vllm_args(render(text_model, "-p", "auto", "--gpus-per-node", "1")), FLAG) == str(ONE_GPU_SERVERS)


def test_auto_on_several_gpus_leaves_it_to_vllm(text_model: str) -> None:
    result = render(text_model, "-p", "auto", "--gpus-per-node", "4")
    assert FLAG not in vllm_args(result)
    assert "dropped --api-server-count from preset auto (DP4): measured for one GPU; on 4 GPUs" in result.stderr
    assert FLAG not in vllm_args(render(text_model, "-p", "dp4"))  # vLLM's own default there: one a rank


def test_old_vllm_gets_none_and_a_note(text_model: str) -> None:
    result = render(text_model, "-p", "single", "--vllm-version", "0.9.2")
    assert FLAG not in vllm_args(result)
    assert "dropped --api-server-count from preset single: --api-server-count does not exist before vLLM 0.10" \
        in result.stderr


def test_a_users_count_replaces_the_presets(text_model: str) -> None:
    args = vllm_args(render(text_model, "-p", "single", "--vllm-arg=--api-server-count=2"))
    assert args.count(FLAG) + sum(a.startswith(f"{FLAG}=") for a in args) == 1
    assert f"{FLAG}=2" in args


# -- /metrics of several processes -----------------------------------------------------------------------------------

ONE = """# TYPE python_info gauge
python_info{implementation="CPython"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 5.0
vllm:request_success_total{engine="0",model_name="m"} 2.0
"""
SEVERAL = ONE.split("\n", 2)[2]
PER_PID = SEVERAL.replace('vllm:num_requests_running{engine="0",model_name="m"} 3.0',
                          'vllm:num_requests_running{engine="0",model_name="m",pid="11"} 3.0\n'
                          'vllm:num_requests_running{engine="0",model_name="m",pid="12"} 2.0')


def test_a_gauge_every_process_copied_counts_once() -> None:
    assert parse_metrics(PER_PID, 0.0).running == 3.0  # the largest copy, not 5


def test_stale_gauges_of_several_processes_read_as_zero_once_nothing_moves() -> None:
    one, several = parse_metrics(ONE, 0.0), parse_metrics(SEVERAL, 0.0)
    assert (one.several_processes, several.several_processes) == (False, True)
    seen = settle(several, None)
    later = parse_metrics(SEVERAL, 0.5)
    seen = settle(later, seen)
    assert later.running == 3.0 and not later.gauges_stale  # half a second: a step may still be under way
    last = parse_metrics(SEVERAL, 1.5)
    settle(last, seen)
    assert (last.running, last.gauges_stale) == (0.0, True)
    moved = parse_metrics(SEVERAL.replace(" 10.0", " 11.0"), 1.6)
    settle(moved, seen)
    assert moved.running == 3.0  # progress: the gauge is live
    single = parse_metrics(ONE, 5.0)
    settle(single, settle(parse_metrics(ONE, 0.0), None))
    assert single.running == 3.0  # one process: its gauges are live whatever moves


LOCAL = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto"]


def _complete(st: dict[str, object], key: str | None, delay: float = 0.0) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "standin_delay_s": delay}).encode()
    request = urllib.request.Request(f"{st['url']}/completions", data=body,  # noqa: S310 - loopback
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
        assert answer.status == 200


def test_readers_count_every_process_and_see_an_idle_engine_idle(standins: Path) -> None:
    """A `single` job on the stand-in runs 4 API servers: `metrics` counts the requests every process answered,
    says the gauges are stale once the engine idles, and the job's own idle watch ends it (before: "1 running"
    for ever, so a forgotten server ran to its walltime)."""
    result = pbstk(*LOCAL, "--idle-cancel", "3s")
    assert result.exit_code == 0, result.output
    job = result.stdout.split()[1]
    assert pbstk("wait", job, "--timeout", "60").exit_code == 0
    st, key = status_of(job), JobStore().find(job).api_key
    log = Path(JobStore().find(job).run_dir, "vllm.log")
    assert f"Started {ONE_GPU_SERVERS} API server processes" in log.read_text()
    for _ in range(12):
        _complete(st, key)
    _complete(st, key, delay=2.0)  # a slow one: the engine steps meanwhile, the job is not idle
    doc = json.loads(pbstk("metrics", job, "--json", "--interval", "1.2").stdout)
    assert doc["totals"]["requests_success"] == 13, doc  # whichever process answered
    assert doc["several_api_servers"] is True
    assert (doc["running"], doc["gauges_stale"]) == (0.0, True), doc  # the stand-in's gauge still says 1
    assert "ended idle" not in log.read_text()
    started = time.monotonic()
    done = wait_recorded(job, "FINISHED", timeout=60)
    assert done["ended"] == "idle" and done["reason"].startswith("ended idle after 3s"), done
    assert time.monotonic() - started < 45
