"""The swapper's decisions and the development endpoints' guard (server/start/pbstk_swapper.py and
pbstk_dev_guard.py, issue 31 item 3): files a swapping job writes into its run directory and runs with the vLLM's
own Python, so they are loaded here from their paths; both are pure where these tests look."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

START = Path(__file__).resolve().parent.parent / "pbs_toolkit" / "server" / "start"


def load(name: str) -> ModuleType:
    """The helper as a module, no bytecode written beside it (the package's start/ holds only what it ships)."""
    spec = importlib.util.spec_from_file_location(name, START / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


swapper = load("pbstk_swapper")
guard = load("pbstk_dev_guard")
NOW = 1000.0


def model(served: str, *, awake: bool, inflight: int = 0, last_busy: float = 0.0, group: str = "0",
          waiting_since: float = 0.0, awake_since: float = 0.0) -> Any:
    """A model as the swapper sees it: ``inflight``, requests in its API server (held, for a sleeping one)."""
    m = swapper.Model(served, 8000, group, "/nonexistent")
    m.awake, m.inflight, m.last_busy = awake, inflight, last_busy
    m.waiting_since = waiting_since or (NOW if inflight and not awake else 0.0)
    m.awake_since = awake_since
    return m


def names(actions: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    return [(a, m.served) for a, m in actions]


def test_a_request_for_a_sleeping_model_puts_the_idle_one_to_sleep_then_wakes_it() -> None:
    a, b = model("a", awake=True, last_busy=900), model("b", awake=False, inflight=3)
    assert names(swapper.decide([a, b], 1, NOW, 0.0)) == [("sleep", "a"), ("wake", "b")]


def test_the_least_recently_busy_idle_model_sleeps_first() -> None:
    a, b = model("a", awake=True, last_busy=990), model("b", awake=True, last_busy=950)
    c = model("c", awake=False, inflight=1)
    assert names(swapper.decide([a, b, c], 2, NOW, 0.0)) == [("sleep", "b"), ("wake", "c")]


def test_a_busy_model_is_not_put_to_sleep_until_the_sleeper_waited_its_fair_time() -> None:
    busy = model("a", awake=True, inflight=5, last_busy=NOW, awake_since=NOW - 60)
    fresh = model("b", awake=False, inflight=1, waiting_since=NOW - 1)
    assert swapper.decide([busy, fresh], 1, NOW, 0.0) == []  # thrashing avoided: it waits
    old = model("b", awake=False, inflight=1, waiting_since=NOW - swapper.FAIR_S)
    assert names(swapper.decide([busy, old], 1, NOW, 0.0)) == [("sleep", "a"), ("wake", "b")]
    just_woken = model("a", awake=True, inflight=5, last_busy=NOW, awake_since=NOW - 1)
    assert swapper.decide([just_woken, old], 1, NOW, 0.0) == []  # nor one that has just woken


def test_models_of_other_gpu_sets_are_never_put_to_sleep_for_it() -> None:
    other = model("a", awake=True, group="1", last_busy=0)
    mine = model("b", awake=True, group="0", inflight=1, last_busy=NOW, awake_since=NOW)
    wanted = model("c", awake=False, group="0", inflight=1)
    assert swapper.decide([other, mine, wanted], 1, NOW, 0.0) == []
    assert names(swapper.decide([other, wanted], 1, NOW, 0.0)) == [("wake", "c")]


def test_sleep_after_puts_an_idle_model_to_sleep_and_never_a_busy_one() -> None:
    idle = model("a", awake=True, last_busy=NOW - 61, awake_since=NOW - 100)
    busy = model("b", awake=True, inflight=1, last_busy=NOW, group="1")
    assert names(swapper.decide([idle, busy], 1, NOW, 60.0)) == [("sleep", "a")]
    assert swapper.decide([idle, busy], 1, NOW, 0.0) == []  # off by default
    woken = model("a", awake=True, last_busy=0, awake_since=NOW - 10)
    assert swapper.decide([woken], 1, NOW, 60.0) == []  # awake for 10 s only


def test_the_leak_figure_is_the_last_sleep_line_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("x\nINFO Sleep mode freed 7.00 GiB memory, 1.00 GiB memory is still in use.\ny\n"
                   "INFO Sleep mode freed 6.50 GiB memory, 2.50 GiB memory is still in use.\n")
    assert swapper.last_still_in_use(str(log)) == 2.5
    assert swapper.last_still_in_use(str(tmp_path / "none.log")) is None


def test_a_leak_is_told_from_the_other_models_awake_beside_it(tmp_path: Path) -> None:
    """vLLM's "Y GiB memory is still in use" is the whole GPU's (4x H100, vLLM 0.22.1: 2.23, 4.46 and 6.19 GiB as one,
    two and three models slept), so with --max-awake 2 a model that sleeps while another is awake shows that one's
    memory too. Before: compared with its first sleep whatever was awake, the swapper ended a healthy job."""
    log = tmp_path / "vllm.model2.log"
    a, b = model("a", awake=True), model("b", awake=False)
    a.log = str(log)
    s = swapper.Swapper.__new__(swapper.Swapper)
    s.models = [a, b]

    def sleeps(still_in_use: float, b_awake: bool) -> None:
        with log.open("a") as fh:
            fh.write(f"INFO Sleep mode freed 30.00 GiB memory, {still_in_use:.2f} GiB memory is still in use.\n")
        b.awake, a.awake = b_awake, False
        s.check_leak(a)

    sleeps(4.4, b_awake=False)   # both asleep: the two models' own
    sleeps(32.1, b_awake=True)   # b awake beside it: b's 28 GB counted too, no leak
    sleeps(5.0, b_awake=False)
    sleeps(33.0, b_awake=True)
    s.write_state = lambda: None
    with pytest.raises(SystemExit) as ended:
        sleeps(6.9, b_awake=False)  # 2.5 GiB more than its first sleep beside the same (none) awake: the leak
    assert ended.value.code == swapper.LEAK_EXIT


def through(middleware: Any, method: str, path: str, authorization: str | None) -> list[dict[str, Any]]:
    """One ``http`` request through an ASGI middleware, as vLLM runs one: the messages it sent (none when it
    passed the request on to its app)."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    asyncio.run(middleware({"type": "http", "method": method, "path": path, "root_path": "", "headers": headers},
                           receive, send))
    return sent


def ask(path: str, authorization: str | None, key: bytes | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, bool]:
    """Run the guard as vLLM would (an ASGI app wrapped by the class): (status it sent, whether it passed on)."""
    if key is not None:
        (tmp_path / "api_key").write_bytes(key + b"\n")
        monkeypatch.setenv(guard.KEY_FILE_ENV, str(tmp_path / "api_key"))
    else:
        monkeypatch.delenv(guard.KEY_FILE_ENV, raising=False)
    passed: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        passed.append(True)

    sent = through(guard.DevGuard(app), "POST", path, authorization)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, bool(passed)


@pytest.mark.parametrize("path", ["/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/is_sleeping",
                                  "/v1/completions", "/health/../sleep", "/"])
def test_the_guard_refuses_every_path_but_the_probes_without_the_key(path: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert ask(path, None, b"s3cret", tmp_path, monkeypatch) == (401, False)
    assert ask(path, "Bearer wrong", b"s3cret", tmp_path, monkeypatch) == (401, False)
    assert ask(path, "Basic s3cret", b"s3cret", tmp_path, monkeypatch) == (401, False)
    assert ask(path, "Bearer s3cret", b"s3cret", tmp_path, monkeypatch) == (None, True)
    assert ask(path, "Bearer s3cret", None, tmp_path, monkeypatch) == (401, False)  # no key file: closed


@pytest.mark.parametrize("path", sorted(guard.OPEN_PATHS))
def test_the_probes_stay_open(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ask(path, None, b"s3cret", tmp_path, monkeypatch) == (None, True)


def test_the_guard_keeps_only_a_digest_of_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "k").write_bytes(b"s3cret")
    monkeypatch.setenv(guard.KEY_FILE_ENV, str(tmp_path / "k"))
    kept = guard.DevGuard(None)
    assert kept.digest == hashlib.sha256(b"s3cret").digest() and b"s3cret" not in repr(vars(kept)).encode()


def test_the_guard_counts_generation_requests_in_flight_and_tells_them_with_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request held for a sleeping engine shows in no vLLM metric (a paused engine does not step): the guard's
    own count, read at /pbstk/inflight, is the swapper's signal."""
    (tmp_path / "k").write_bytes(b"s3cret")
    monkeypatch.setenv(guard.KEY_FILE_ENV, str(tmp_path / "k"))
    during: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        during.append(kept.inflight)
        if scope["path"] == "/v1/fails":
            raise RuntimeError("the app failed")

    kept = guard.DevGuard(app)

    def call(method: str, path: str, key: str | None = "s3cret") -> list[dict[str, Any]]:
        return through(kept, method, path, f"Bearer {key}" if key else None)

    call("POST", "/v1/chat/completions")
    call("GET", "/v1/models")
    call("POST", "/health")
    with pytest.raises(RuntimeError):
        call("POST", "/v1/fails")
    assert during == [1, 0, 0, 1] and kept.inflight == 0  # counted while in the app, and back after a failure
    answer = call("GET", guard.INFLIGHT_PATH)
    assert answer[0]["status"] == 200 and answer[1]["body"] == b'{"inflight": 0}'
    assert call("GET", guard.INFLIGHT_PATH, key=None)[0]["status"] == 401
