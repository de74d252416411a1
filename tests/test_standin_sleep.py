"""The stand-in vLLM's sleep mode over HTTP (tests/standins/sleepmode.py; docs/multi-model.md), the part of vLLM
that swapping models on the same GPUs (issue 31) will drive: the endpoints, what a sleeping engine does with a
request, the wake's time and the memory its /metrics shows.

Before: the stand-in ignored --enable-sleep-mode; /sleep, /wake_up and /is_sleeping were 404 in every mode.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import STANDINS
from helpers import until, wait_for

GIB = 1 << 30
KEY = "sk-sleep-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A stand-in vLLM on 127.0.0.1 with ``args`` and ``env``; its output in ``log``."""

    def __init__(self, log: Path, *args: str, **env: str) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.log = log
        full = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "VLLM_SERVER_DEV_MODE")}
        full.update({"PBSTK_TEST_STANDIN_DELAY": "0", "VLLM_API_KEY": KEY, **env})
        with log.open("w") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - argument list
                [sys.executable, str(STANDINS / "vllm"), "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                 *args], env=full, stdout=out, stderr=subprocess.STDOUT)
        until(self._healthy, 30, f"stand-in on {port}")

    def _healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def post(self, path: str, **kw: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", timeout=60, **kw)

    def sleeping(self) -> bool:
        answer = requests.get(f"{self.url}/is_sleeping", timeout=10)
        assert answer.status_code == 200, answer.text
        return bool(answer.json()["is_sleeping"])

    def gauge(self, name: str, labels: str = "") -> float:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        found = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} ([0-9.e+]+)$|"
                          rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        assert found, (name, labels, text)
        return float(found.group(1) or found.group(2))

    def complete(self, **body: Any) -> requests.Response:
        return self.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3, **body},
                         headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(*args: str, **env: str) -> Server:
        started.append(Server(tmp_path / f"vllm-{len(started)}.log", *args, **env))
        return started[-1]

    yield start
    for server in started:
        server.proc.kill()
        server.proc.wait(10)


SLEEPY = ("--enable-sleep-mode",)
DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def test_the_endpoints_exist_only_in_development_mode(servers: Any) -> None:
    server = servers(*SLEEPY)
    assert server.post("/sleep?level=1").status_code == 404
    assert server.post("/wake_up").status_code == 404
    assert requests.get(f"{server.url}/is_sleeping", timeout=10).status_code == 404
    assert server.complete().json()["choices"][0]["finish_reason"] == "length"


def test_sleep_frees_the_memory_its_metrics_show_and_wake_gives_it_back(servers: Any) -> None:
    server = servers(*SLEEPY, **DEV, PBSTK_TEST_STANDIN_GPU_BYTES=str(8 * GIB))
    assert not server.sleeping()
    assert server.gauge("vllm:engine_sleep_state", 'sleep_state="awake"') == 1
    assert server.gauge("standin:gpu_memory_used_bytes") == 8 * GIB
    answer = server.post("/sleep?level=1")  # no key: vLLM's --api-key guards /v1 only, not the dev endpoints
    assert (answer.status_code, answer.json()) == (200, {"status": "sleeping", "level": 1})
    assert server.sleeping()
    assert server.gauge("vllm:engine_sleep_state", 'sleep_state="awake"') == 0
    assert server.gauge("vllm:engine_sleep_state", 'sleep_state="weights_offloaded"') == 1
    assert server.gauge("standin:gpu_memory_used_bytes") == GIB  # CUDA graphs and context stay
    assert "Sleep mode freed 7.00 GiB memory, 1.00 GiB memory is still in use." in server.log.read_text()
    answer = server.post("/wake_up")
    assert (answer.status_code, answer.json()) == (200, {"status": "awake", "tags": None})
    assert not server.sleeping() and server.gauge("standin:gpu_memory_used_bytes") == 8 * GIB
    assert server.post("/sleep?level=2").json() == {"status": "sleeping", "level": 2}
    assert server.gauge("vllm:engine_sleep_state", 'sleep_state="discard_all"') == 1
    # a partial wake leaves the engine asleep; the scheduler resumes once nothing is
    assert server.post("/wake_up?tags=weights").json() == {"status": "sleeping", "tags": ["weights"]}
    assert server.sleeping() and server.gauge("standin:gpu_memory_used_bytes") == 4.5 * GIB
    assert server.post("/wake_up?tags=kv_cache").json() == {"status": "awake", "tags": ["kv_cache"]}
    assert not server.sleeping()


def test_bad_sleep_requests_are_answered_as_vllm_answers_them(servers: Any) -> None:
    server = servers(*SLEEPY, **DEV)
    assert server.post("/sleep?level=3").status_code == 422
    assert server.post("/sleep?mode=later").status_code == 422
    assert requests.get(f"{server.url}/sleep", timeout=10).status_code == 405
    assert server.post("/is_sleeping").status_code == 405
    assert not server.sleeping()
    plain = servers(**DEV)  # development mode without --enable-sleep-mode: nothing to free
    assert plain.post("/sleep?level=1").status_code == 500
    assert not plain.sleeping() and plain.complete().status_code == 200


def test_a_request_to_a_sleeping_engine_waits_and_is_answered_after_the_wake(servers: Any) -> None:
    server = servers(*SLEEPY, **DEV, PBSTK_TEST_STANDIN_WAKE_S="1.5")
    assert server.post("/sleep?level=1").status_code == 200
    answers: list[requests.Response] = []
    threading.Thread(target=lambda: answers.append(server.complete()), daemon=True).start()
    wait_for(lambda: "a request is held" in server.log.read_text(), 30, "the request queued while asleep")
    assert answers == []  # held, not refused
    # and seen by no gauge: a paused engine does not step, and vLLM's request gauges come from its steps
    assert server.gauge("vllm:num_requests_waiting") == 0 and server.gauge("vllm:num_requests_running") == 0
    woke: list[requests.Response] = []
    threading.Thread(target=lambda: woke.append(server.post("/wake_up")), daemon=True).start()
    wait_for(lambda: "wake up the engine" in server.log.read_text(), 30, "the wake to start")
    # while it wakes (PBSTK_TEST_STANDIN_WAKE_S) the engine is asleep: it says awake only once the wake is done
    assert server.sleeping() or "seconds to wake up" in server.log.read_text()
    wait_for(lambda: woke and answers, 60, "the wake and the held request's answer")
    assert woke[0].json()["status"] == "awake"
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["finish_reason"] == "length"
    assert "It took 1.500000 seconds to wake up tags ['weights', 'kv_cache']." in server.log.read_text()


def test_sleep_aborts_running_requests_unless_asked_to_wait(servers: Any) -> None:
    server = servers(*SLEEPY, **DEV)
    answers: list[requests.Response] = []
    threading.Thread(target=lambda: answers.append(server.complete(standin_delay_s=60)), daemon=True).start()
    wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, 30, "the request to run")
    assert server.post("/sleep?level=1").status_code == 200  # mode=abort, vLLM's default
    wait_for(lambda: answers, 30, "the aborted answer")
    assert answers[0].json()["choices"][0]["finish_reason"] == "abort"
    assert server.post("/wake_up").json()["status"] == "awake"
    order: list[str] = []
    threading.Thread(target=lambda: order.append(server.complete(standin_delay_s=1).json()["choices"][0][
        "finish_reason"]), daemon=True).start()
    wait_for(lambda: server.gauge("vllm:num_requests_running") == 1, 30, "the second request to run")
    assert server.post("/sleep?level=1&mode=wait").status_code == 200
    order.append("slept")
    wait_for(lambda: len(order) == 2, 30, "both")
    assert order == ["length", "slept"]  # the running request finished first, whole
