"""The autoscaling policy (services/keeper/autoscale.py) rule by rule: pure, no process."""

from __future__ import annotations

from typing import Any

import pytest

from pbs_toolkit.errors import UsageError
from pbs_toolkit.services.keeper.autoscale import Memory, Observation, ScaleSpec, decide

SPEC = ScaleSpec(min_replicas=1, max_replicas=3, up_waiting=1, down_idle_s=60)


def obs(now: float, target: int = 1, waiting: float | None = 0, running: float | None = 0, starting: int = 0,
        capacity: int | None = 4, job_cap: int = 0, answered: int | None = None,
        in_flight: float | None = None) -> Observation:
    if answered is None:
        answered = 0 if waiting is None else target - starting
    return Observation(now=now, target=target, starting=starting, waiting=waiting, running=running,
                       capacity=capacity, job_cap=job_cap, answered=answered, in_flight=in_flight)


def run(ticks: list[Observation], spec: ScaleSpec = SPEC, memory: Memory | None = None) -> list[str]:
    mem = memory or Memory()
    actions = []
    for o in ticks:
        d, mem = decide(spec, mem, o)
        assert d.reason
        actions.append(d.action)
    return actions


def test_two_ticks_above_w_add_one_replica_and_one_tick_does_not() -> None:
    assert run([obs(0, waiting=5), obs(10, waiting=0), obs(20, waiting=5)]) == ["hold"] * 3
    assert run([obs(0, waiting=5), obs(10, waiting=5)]) == ["hold", "up"]
    assert run([obs(0, waiting=1), obs(10, waiting=1)]) == ["hold", "hold"]  # not *above* W
    d, mem = decide(SPEC, Memory(above=1), obs(10, waiting=7))
    assert d.action == "up" and d.target == 2 and "7 request(s) waiting" in d.reason and mem.above == 0


def test_the_look_that_confirms_an_overload_comes_sooner_than_a_poll() -> None:
    """2x H200: with the keeper's 15 s poll, 31 s passed between a burst and the decision; the second look now
    comes CONFIRM_S after the first overloaded one, and only then."""
    from pbs_toolkit.services.keeper.autoscale import CONFIRM_S, confirm_within

    _, mem = decide(SPEC, Memory(), obs(0, waiting=5))
    assert confirm_within({"memory": mem.to_dict()}, 0) == CONFIRM_S < 15
    assert confirm_within({"memory": mem.to_dict()}, 2) == CONFIRM_S - 2  # counted from the first look, not the tick
    d, mem = decide(SPEC, mem, obs(CONFIRM_S, waiting=5))
    assert d.action == "up" and confirm_within({"memory": mem.to_dict()}, 5) is None  # decided: the usual poll
    _, mem = decide(SPEC, Memory(), obs(0, waiting=0))
    assert confirm_within({"memory": mem.to_dict()}, 0) is None and confirm_within(None, 0) is None  # calm, fixed


def test_an_overload_sighted_between_ticks_is_confirmed_from_that_moment() -> None:
    """The keeper's watch saw the router's figure show the overload at 100 and woke the tick, whose look (slow
    probes) ended at 106: the confirming look is due at 105, at once, not 5 s after the tick."""
    from pbs_toolkit.services.keeper.autoscale import CONFIRM_S, confirm_within, news

    seen = Observation(now=106, target=1, starting=0, waiting=None, running=None, capacity=2, in_flight=16,
                       sighted=100)
    d, mem = decide(SPEC, Memory(), seen)
    assert d.action == "hold" and mem.above == 1 and mem.seen_at == 100
    line = news(Memory(), mem, d)
    assert line and line.endswith("(sighted at the router 6.0 s earlier, between ticks: this tick came at once)")
    assert confirm_within({"memory": mem.to_dict()}, 106) == 0
    d, mem = decide(SPEC, mem, Observation(now=112, target=1, starting=0, waiting=None, running=None, capacity=2,
                                           in_flight=16))
    assert d.action == "up" and mem.seen_at is None and CONFIRM_S < 12


def test_the_router_watch_wakes_a_tick_only_when_the_tick_could_act() -> None:
    from pbs_toolkit.services.keeper.autoscale import router_overload

    def look(**kw: Any) -> Observation:
        base = {"now": 0, "target": 1, "starting": 0, "waiting": 3, "running": 2, "capacity": 2, "answered": 1,
                "in_flight": 16}
        return Observation(**{**base, **kw})

    why = router_overload(SPEC, Memory(), look())
    assert why and "16 request(s) open at the router, above the capacity" in why  # the replicas' figures not used
    assert router_overload(SPEC, Memory(), look(in_flight=3)) is None  # within 1 x 2 + W
    assert router_overload(SPEC, Memory(above=1), look()) is None  # already counted: the confirm look is due
    assert router_overload(SPEC, Memory(), look(target=2, starting=1)) is None  # one on its way
    assert router_overload(SPEC, Memory(), look(target=3, in_flight=99)) is None  # at --max-replicas
    assert router_overload(SPEC, Memory(held=4, held_by=1), look(capacity=None, in_flight=9)) is not None
    assert router_overload(SPEC, Memory(), look(capacity=None, in_flight=99)) is None  # nothing to set it against


def test_the_keeper_logs_an_overload_seen_and_one_dismissed_but_no_quiet_tick() -> None:
    from pbs_toolkit.services.keeper.autoscale import news

    before = Memory()
    d, first = decide(SPEC, before, obs(0, waiting=5))
    assert news(before, first, d) == "overload seen (1/2): 5 request(s) waiting (> 1)"
    d, calm = decide(SPEC, first, obs(5, waiting=0, running=1))
    line = news(first, calm, d)
    assert line and line.startswith("overload dismissed after 1 tick(s): 0 waiting, 1 running"), line
    d, quiet = decide(SPEC, calm, obs(20, waiting=0, running=1))
    assert news(calm, quiet, d) is None  # a quiet tick: no line
    d, again = decide(SPEC, first, obs(5, waiting=None, running=None))
    assert again.above == 1 and news(first, again, d) is None  # no news: neither seen again nor dismissed
    d, up = decide(SPEC, first, obs(5, waiting=5))
    assert d.action == "up" and news(first, up, d) is None  # the scale-up has its own line


def test_a_tick_without_an_answer_neither_counts_nor_resets_the_overload() -> None:
    """A replica too busy to answer its /metrics in time (no answer this tick) is no news: under a long queue the
    count goes on after it, where it used to start again (the service never scaled up, measured on GPUs)."""
    assert run([obs(0, waiting=5), obs(5, waiting=None, running=None), obs(10, waiting=5)]) == ["hold", "hold", "up"]
    d, mem = decide(SPEC, Memory(above=1), obs(5, waiting=None, running=None))
    assert d.action == "hold" and mem.above == 1
    assert run([obs(0, waiting=5), obs(5, waiting=0), obs(10, waiting=5)]) == ["hold"] * 3  # an answer of 0 resets


def test_replicas_full_at_their_capacity_with_a_queue_are_overloaded() -> None:
    """In flight against capacity: every replica that answered runs --max-num-seqs requests and some wait, even
    when fewer than W wait (here W = 5)."""
    spec = ScaleSpec(min_replicas=1, max_replicas=3, up_waiting=5, down_idle_s=60)
    full = [obs(0, target=2, running=8, waiting=1), obs(10, target=2, running=8, waiting=1)]
    assert run(full, spec) == ["hold", "up"]
    d, _ = decide(spec, Memory(above=1), full[1])
    assert "8 running at capacity (2 x --max-num-seqs 4), 1 waiting" in d.reason, d.reason
    assert run([obs(0, target=2, running=7, waiting=1), obs(10, target=2, running=7, waiting=1)], spec) == ["hold"] * 2
    assert run([obs(0, target=2, running=8), obs(10, target=2, running=8)], spec) == ["hold"] * 2  # full, no queue


def test_requests_open_at_the_router_beyond_what_the_replicas_hold_are_a_queue() -> None:
    """What a GPU run showed: 512 requests open, the replica said 256 running and 0 waiting (its API server held
    the rest before the engine) and the capacity was not known: no earlier rule fired, the service never grew."""
    gpu = obs(0, running=256, waiting=0, capacity=None, in_flight=512)
    assert run([gpu, gpu]) == ["hold", "up"]
    d, _ = decide(SPEC, Memory(above=1), gpu)
    assert "512 request(s) open at the router, the replicas hold 256 (256 running, 0 waiting): 256 queued before " \
           "the engines" in d.reason, d.reason
    # requests in transit between the two looks are no queue: W plus a tenth of what the replicas hold
    assert run([obs(t, running=100, waiting=0, capacity=None, in_flight=111) for t in (0, 5, 10)]) == ["hold"] * 3
    assert run([obs(t, running=100, waiting=0, capacity=None, in_flight=112) for t in (0, 5)]) == ["hold", "up"]
    # a replica that did not answer would make the replicas' sum too small: no verdict from the difference
    part = obs(0, target=2, running=4, waiting=0, answered=1, in_flight=50)
    assert run([part, part], ScaleSpec(1, 3, 1, 60)) == ["hold", "hold"]
    # a tick that resets: the router's figure matches what the replicas hold
    calm = obs(5, running=256, waiting=0, capacity=None, in_flight=256)
    assert run([gpu, calm, gpu]) == ["hold"] * 3


def test_with_no_answer_from_the_replicas_the_router_figure_counts_against_capacity() -> None:
    """vLLM serves /metrics on the same busy event loop as /health: a tick with no answer still counts from the
    router's open requests when the capacity is known, and resets when they fit."""
    busy = obs(0, target=2, waiting=None, running=None, capacity=4, in_flight=10)
    assert run([busy, busy]) == ["hold", "up"]
    d, _ = decide(SPEC, Memory(above=1), busy)
    assert "10 request(s) open at the router, above the capacity of the replicas (2 x --max-num-seqs 4" in d.reason
    fits = obs(5, target=2, waiting=None, running=None, capacity=4, in_flight=9)  # 8 + W: not above
    assert run([busy, fits, busy]) == ["hold"] * 3
    unknown = obs(5, target=2, waiting=None, running=None, capacity=None, in_flight=100)  # no capacity: no news
    assert run([busy, unknown, busy]) == ["hold", "hold", "up"]


def test_with_no_answer_and_no_known_capacity_what_the_replicas_last_held_stands_in() -> None:
    """The GPU case with /metrics timing out: no --max-num-seqs given, the replica last said 256 running; then no
    answer while 512 are open at the router: queued before the engines. Not once the replicas changed in number."""
    answered = obs(0, running=256, waiting=0, capacity=None, in_flight=256)
    silent = obs(5, waiting=None, running=None, capacity=None, in_flight=512)
    assert run([answered, silent, silent]) == ["hold", "hold", "up"]
    d, mem = decide(SPEC, Memory(above=1, held=256, held_by=1), silent)
    assert d.action == "up" and "512 request(s) open at the router, the replicas last held 256 (their /metrics did " \
                                 "not answer): 256 queued before the engines" in d.reason, d.reason
    assert mem.held is None  # a change: what the replicas held is no longer known
    _, mem = decide(SPEC, Memory(), answered)
    assert (mem.held, mem.held_by) == (256, 1)
    _, mem = decide(SPEC, mem, silent)
    assert (mem.held, mem.held_by, mem.above) == (256, 1, 1)  # kept through a silent tick
    assert Memory.from_dict(mem.to_dict()) == mem
    fits = obs(10, waiting=None, running=None, capacity=None, in_flight=260)  # within W and a tenth: resets
    assert decide(SPEC, mem, fits)[1].above == 0
    two = obs(10, target=2, waiting=None, running=None, capacity=None, in_flight=512)  # 2 routable now: no news
    assert decide(SPEC, mem, two)[1].above == 1


def test_requests_open_at_the_router_beyond_what_the_replicas_hold_are_no_spare_capacity() -> None:
    spec = ScaleSpec(min_replicas=1, max_replicas=3, up_waiting=100, down_idle_s=60)  # no scale-up in this test
    calm = [obs(t, target=2, running=2, waiting=0, in_flight=2) for t in (0, 30, 61)]
    assert run(calm, spec) == ["hold", "hold", "down"]
    queued = [obs(t, target=2, running=2, waiting=0, in_flight=50) for t in (0, 30, 61)]
    assert run(queued, spec) == ["hold", "hold", "hold"]
    in_transit = [obs(t, target=2, running=2, waiting=0, in_flight=3) for t in (0, 30, 61)]  # one in transit
    assert run(in_transit, spec) == ["hold", "hold", "down"]


def test_requests_the_router_failed_for_want_of_a_worker_are_overload() -> None:
    """The router's 503s and exhausted retries since the last tick count as overload even while no request
    waits at a replica (or none answered /metrics); not while every replica is still starting."""
    ticks = [obs(0, waiting=None, running=None), obs(5, waiting=0)]
    ticks = [Observation(**{**vars(o), "refused": 12.0}) for o in ticks]
    assert run(ticks) == ["hold", "up"]
    d, _ = decide(SPEC, Memory(above=1), ticks[1])
    assert "12 request(s) failed at the router" in d.reason, d.reason
    starting = Observation(**{**vars(obs(0, target=1, starting=1, waiting=None, running=None)), "refused": 5.0})
    assert decide(SPEC, Memory(), starting)[1].above == 0
    assert run([obs(0, waiting=0), obs(5, waiting=0)]) == ["hold", "hold"]  # refused None or 0: nothing


def test_a_queued_replica_counts_toward_the_target_no_storm() -> None:
    # a replica added is queued for many ticks while the queue stays long: nothing more is added meanwhile
    ticks = [obs(t, target=2, starting=1, waiting=20) for t in range(0, 100, 10)]
    actions = run(ticks, memory=Memory(above=0, last_change=0))
    assert actions == ["hold"] * len(ticks)
    d, _ = decide(SPEC, Memory(above=5), obs(100, target=2, starting=1, waiting=20))
    assert "still queued or starting" in d.reason
    # once it runs and requests still wait, the next one is added at once (the count of ticks was kept)
    d, _ = decide(SPEC, Memory(above=5), obs(110, target=2, waiting=20))
    assert d.action == "up" and d.target == 3


def test_never_above_max_replicas_nor_max_running_jobs() -> None:
    d, _ = decide(SPEC, Memory(above=3), obs(0, target=3, waiting=50))
    assert d.action == "hold" and "--max-replicas (3)" in d.reason
    d, _ = decide(SPEC, Memory(above=3), obs(0, target=2, waiting=50, job_cap=2))
    assert d.action == "hold" and "max_running_jobs (2)" in d.reason
    # a limit lowered under the replicas running: one goes (drained), not all at once
    d, _ = decide(SPEC, Memory(), obs(0, target=3, job_cap=2, running=8, waiting=3))
    assert d.action == "down" and d.target == 2


def test_down_after_d_without_waiting_and_with_spare_capacity_never_below_min() -> None:
    spec = ScaleSpec(min_replicas=1, max_replicas=3, down_idle_s=60)
    ticks = [obs(t, target=3, running=2) for t in (0, 30, 59, 60)]
    assert run(ticks, spec) == ["hold", "hold", "hold", "down"]
    # after a removal the next one waits another D
    d, mem = decide(spec, Memory(calm_since=0), obs(60, target=3))
    assert d.action == "down" and d.target == 2
    d, mem = decide(spec, mem, obs(90, target=2))
    assert d.action == "hold" and "fewer in" in d.reason
    d, mem = decide(spec, mem, obs(120, target=2))
    assert d.action == "down" and d.target == 1
    d, mem = decide(spec, mem, obs(1000, target=1))
    assert d.action == "hold" and "--min-replicas" in d.reason


def test_no_spare_capacity_no_down() -> None:
    # 8 running on 2 replicas of 4: one replica fewer could not hold them
    assert run([obs(t, target=2, running=8) for t in range(0, 300, 30)]) == ["hold"] * 10
    # a waiting request resets the calm period
    ticks = [obs(0, target=2, running=1), obs(50, target=2, waiting=1, running=4), obs(100, target=2, running=1),
             obs(150, target=2, running=1), obs(160, target=2, running=1)]
    assert run(ticks) == ["hold", "hold", "hold", "hold", "down"]
    # capacity unknown: only when nothing runs
    assert run([obs(t, target=2, running=1, capacity=None) for t in range(0, 300, 60)]) == ["hold"] * 5
    assert run([obs(t, target=2, running=0, capacity=None) for t in (0, 60)]) == ["hold", "down"]


def test_cooldown_after_a_scale_up() -> None:
    # a replica added for a burst is not removed in the lull right after it
    d, mem = decide(SPEC, Memory(above=1), obs(100, target=1, waiting=9))
    assert d.action == "up"
    actions = run([obs(t, target=2) for t in (110, 130, 159)], memory=mem)
    assert actions == ["hold", "hold", "hold"]
    # calm for long enough, but the last change was less than D ago: the cooldown holds it
    assert run([obs(165, target=2)], memory=Memory(calm_since=0, last_change=110)) == ["hold"]
    assert run([obs(170, target=2)], memory=Memory(calm_since=0, last_change=110)) == ["down"]


def test_below_min_grows_and_no_metrics_holds() -> None:
    d, _ = decide(ScaleSpec(2, 4), Memory(), obs(0, target=1))
    assert d.action == "up" and "--min-replicas 2" in d.reason
    d, _ = decide(SPEC, Memory(), obs(0, target=2, waiting=None, running=None))
    assert d.action == "hold" and "answered" in d.reason


@pytest.mark.parametrize(("spec", "words"), [
    (ScaleSpec(0, 2), "at least 1"), (ScaleSpec(3, 2), "below --min-replicas"), (ScaleSpec(1, 5000), "at most"),
    (ScaleSpec(1, 2, up_waiting=-1), "--scale-up-waiting"),
])
def test_bad_specs(spec: ScaleSpec, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        spec.check(1000)


# -- services/keeper/scaler.py's pure parts: the idle watch of a service, retiring a slot, the status line -------------

def _st(job: str, state: str = "READY", port: int = 9000, args: tuple[str, ...] = ()) -> Any:
    from pbs_toolkit.jobs.spec import LaunchSpec
    from pbs_toolkit.jobs.status import JobStatus, ServerState
    from pbs_toolkit.jobs.store import JobRecord

    record = JobRecord(job_id=job, scheduler="local", profile="p", model="m", served_model_name="m", preset="x",
                       name=job, run_dir="/nonexistent", spec=LaunchSpec(vllm_args=list(args)))
    return JobStatus(record=record, state=ServerState(state), address="127.0.0.1", port=port)


def _snap(running: float = 0, waiting: float = 0, success: float = 0) -> Any:
    from pbs_toolkit.vllm.prom import MetricsSnapshot

    return MetricsSnapshot(timestamp=0, running=running, waiting=waiting, requests_success=success)


def _rec(**kw: Any) -> Any:
    from pbs_toolkit.services.record import ServiceRecord

    return ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=1, request={}, **kw)


def test_a_service_is_idle_only_when_nothing_ran_waited_or_finished_for_the_duration() -> None:
    from pbs_toolkit.services.keeper.scaler import idle_end

    rec = _rec(idle_cancel_s=10)
    assert idle_end(rec, {"a": _snap(success=3)}, 1, 0) is None  # first look: the counter is new
    assert idle_end(rec, {"a": _snap(success=3)}, 1, 9) is None
    why = idle_end(rec, {"a": _snap(success=3)}, 1, 10)
    assert why is not None and why.startswith("idle: no request for 10s")
    for busy in ({"a": _snap(running=1, success=3)}, {"a": _snap(waiting=2, success=3)},
                 {"a": _snap(success=4)}, {}):  # running, waiting, a request finished, or no replica answered
        rec = _rec(idle_cancel_s=10, idle={"since": 0.0, "sig": '[["a", 3]]'})
        assert idle_end(rec, busy, 1, 50) is None and rec.idle["since"] == 50
    rec = _rec(idle_cancel_s=10, idle={"since": 0.0, "sig": '[["a", 3]]'})
    assert idle_end(rec, {"a": _snap(success=3)}, 2, 50) is None  # one of two routable replicas did not answer
    assert idle_end(_rec(), {}, 0, 50) is None  # off


def test_retiring_a_slot_drains_what_serves_and_cancels_the_rest() -> None:
    from pbs_toolkit.services.keeper.scaler import capacity, retire_jobs, to_cancel
    from pbs_toolkit.services.record import Slot

    statuses = {"j1": _st("j1", port=9001, args=("--max-num-seqs", "6")), "j2": _st("j2", "PENDING", 9002)}
    slot = Slot(3, current="j1", successor="j2", retiring=True)
    routed = {"http://127.0.0.1:9001", "http://127.0.0.1:9009"}
    assert retire_jobs(slot, statuses, routed) == ["http://127.0.0.1:9001"]
    assert to_cancel(slot, statuses, routed) == ["j2"]
    assert (slot.current, slot.successor, slot.draining) == (None, None, "j1")
    queued = Slot(4, current="j2", retiring=True)
    assert to_cancel(queued, statuses, routed) == ["j2"] and queued.draining is None and not queued.jobs()
    # a keep-alive predecessor still drains: the serving job waits its turn (out of the router already)
    busy = Slot(5, current="j1", draining="j0", retiring=True)
    assert to_cancel(busy, statuses, routed) == [] and (busy.current, busy.draining) == ("j1", "j0")
    assert capacity(statuses) == 6 and capacity({"j2": statuses["j2"]}) is None


def test_the_status_line() -> None:
    from pbs_toolkit.services.keeper.scaler import summary

    scale = {"spec": {"min_replicas": 1, "max_replicas": 4}, "last": {"action": "up", "reason": "7 waiting", "at": 0},
             "now": {"action": "hold", "reason": "spare capacity"}}
    text = summary(scale, 2, 1)
    assert text is not None and text.startswith("autoscaling 1..4: target 2, 1 routable; last: up at ")
    assert text.endswith("(7 waiting); now: spare capacity")
    assert summary({}, 2, 2) is None
