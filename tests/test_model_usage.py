"""`pbstk usage` per model (issue 31 item 4): the pure split of a job's GPU time among the models placed on each
GPU (campaigns/model_usage.py), with hand-made event lists."""

from __future__ import annotations

import pytest

from pbs_toolkit.campaigns.model_usage import Event, parse_events, split


def _parts(result: dict) -> dict[str, float]:
    return {m: round(s.fraction, 6) for m, s in result.items()}


def test_without_events_every_model_is_awake_and_shares_by_memory() -> None:
    """Two models on GPU 0 (0.1 and 0.3 of it) and one alone on GPU 1: GPU 0's time goes 1:3, GPU 1's to c."""
    placed = {"a": ([0], 0.1), "b": ([0], 0.3), "c": ([1], 0.95)}
    got = split(placed, None, 0.0, 100.0)
    assert _parts(got) == {"a": 0.125, "b": 0.375, "c": 0.5}
    assert all(s.awake_s == 0.0 for s in got.values())  # no events: no awake time to report


def test_only_the_awake_models_share_a_gpu_and_an_empty_gpu_is_split_evenly() -> None:
    """a and b on one GPU, shares 0.2 and 0.6. 0-10 s: nobody listens yet (even); a awake 10-50 (all of it to
    a); both 50-70 (1:3); b alone 70-100."""
    placed = {"a": ([0], 0.2), "b": ([0], 0.6)}
    events = [Event(10, "a", True), Event(50, "b", True), Event(70, "a", False)]
    got = split(placed, events, 0.0, 100.0)
    a = 5 + 40 + 20 * 0.25
    b = 5 + 20 * 0.75 + 30
    assert _parts(got) == {"a": round(a / 100, 6), "b": round(b / 100, 6)}
    assert got["a"].awake_s == pytest.approx(60.0) and got["b"].awake_s == pytest.approx(50.0)
    assert sum(s.fraction for s in got.values()) == pytest.approx(1.0)


def test_asleep_everywhere_is_split_evenly_and_a_model_over_two_gpus_counts_on_each() -> None:
    """Model big spans GPUs 0 and 1, small shares GPU 1; small sleeps from t=0: GPU 1 is big's while big is
    awake; then both sleep and GPU 1 is split evenly, GPU 0 stays big's (the only model placed there)."""
    placed = {"big": ([0, 1], 0.6), "small": ([1], 0.3)}
    events = [Event(0, "big", True), Event(0, "small", True), Event(0.0, "small", False), Event(40, "big", False)]
    got = split(placed, events, 0.0, 80.0)
    # GPU 0: 80 s of big. GPU 1: 40 s big, then 40 s split 20/20
    assert got["big"].fraction == pytest.approx((80 + 40 + 20) / 160)
    assert got["small"].fraction == pytest.approx(20 / 160)
    assert got["small"].awake_s == 0.0 and got["big"].awake_s == pytest.approx(40.0)


def test_events_outside_the_window_set_the_state_and_unknown_models_are_ignored() -> None:
    placed = {"a": ([0], 0.5), "b": ([0], 0.5)}
    events = [Event(-5, "a", True), Event(-1, "zzz", True), Event(30, "b", True), Event(500, "a", False)]
    got = split(placed, events, 0.0, 60.0)
    assert got["a"].fraction == pytest.approx((30 + 15) / 60)
    assert got["a"].awake_s == pytest.approx(60.0) and got["b"].awake_s == pytest.approx(30.0)


def test_cpu_models_share_the_node_as_one_device() -> None:
    """No GPUs planned (a CPU profile): the node is one device, no share set: evenly among the awake."""
    got = split({"a": ([], None), "b": ([], None)}, [Event(0, "a", True), Event(25, "b", True)], 0.0, 100.0)
    assert got["a"].fraction == pytest.approx((25 + 37.5) / 100) and got["b"].fraction == pytest.approx(0.375)


def test_an_empty_window_gives_the_state_at_its_end() -> None:
    got = split({"a": ([0], 0.1), "b": ([0], 0.3)}, None, 10.0, 10.0)
    assert _parts(got) == {"a": 0.25, "b": 0.75}


def test_parse_events_skips_what_is_not_an_event_and_sorts() -> None:
    text = ('{"t": 5.5, "model": "b", "event": "awake"}\n'
            '{"t": 1, "model": "a", "event": "awake"}\n'
            'not json\n[1, 2]\n{"t": "x", "model": "a", "event": "awake"}\n'
            '{"t": 2, "model": "a", "event": "dozing"}\n'
            '{"t": 3, "model": "a", "event": "asleep"}\n{"t": 9, "mod')
    assert parse_events(text) == [Event(1.0, "a", True), Event(3.0, "a", False), Event(5.5, "b", True)]
