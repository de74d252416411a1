"""perf/server_time.py: vLLM's own time of a level's requests from two looks at its e2e histogram, the note for a
level that waited mostly outside vLLM, and how a saved level keeps the figure (bench --json, tune reports)."""

from __future__ import annotations

from pbs_toolkit.perf.benchjob import LevelResult
from pbs_toolkit.perf.server_time import outside_note, server_mean_ms
from pbs_toolkit.perf.tune import TuneReport, render_table
from pbs_toolkit.vllm.prom import Histogram


def hist(total: float, count: float) -> Histogram:
    return Histogram(buckets=[(float("inf"), count)], sum=total, count=count)


def test_the_mean_is_of_the_requests_between_the_two_looks() -> None:
    assert server_mean_ms((hist(10.0, 4),), (hist(16.0, 8),)) == 1500.0
    assert server_mean_ms(None, (hist(16.0, 8),)) is None and server_mean_ms((hist(1.0, 1),), None) is None
    assert server_mean_ms((hist(10.0, 4),), (hist(10.0, 4),)) is None  # nothing finished
    assert server_mean_ms((hist(10.0, 4),), (hist(3.0, 6),)) is None  # the server restarted: its sums went down
    assert server_mean_ms((hist(10.0, 4),), (hist(12.0, 2),)) is None


def test_a_services_replicas_are_added_each_from_its_own_look() -> None:
    before = (hist(10.0, 4), hist(100.0, 50))
    # 4 requests in 6 s on the first, 2 in 1 s on the second: 7 s over 6 requests, not an average of the two means
    assert server_mean_ms(before, (hist(16.0, 8), hist(101.0, 52))) == 7000.0 / 6
    # the second restarted and served more since than it had before: the sum still grew, its own look did not
    assert server_mean_ms(before, (hist(16.0, 8), hist(90.0, 60))) is None
    assert server_mean_ms(before, (hist(16.0, 8),)) is None  # a replica fewer: not the same servers


def test_a_note_only_for_a_level_that_waited_mostly_outside_vllm() -> None:
    note = outside_note(1024, 2_100.0, 6_600.0)
    assert note is not None and note.startswith("c=1024: vLLM had each request for 32% of the time")
    assert "mean 2,100 of 6,600 ms" in note
    assert outside_note(256, 900.0, 1_000.0) is None  # 90%: the server's level
    assert outside_note(64, None, 1_000.0) is None and outside_note(64, 10.0, None) is None
    assert outside_note(64, 10.0, 0.0) is None


def level(c: int, server: float | None, client: float) -> LevelResult:
    return LevelResult(duration=10.0, completed=8, failed=0, total_input_tokens=80, total_output_tokens=800,
                       request_throughput=0.8, output_throughput=80.0, total_token_throughput=88.0,
                       mean_ttft_ms=5.0, median_ttft_ms=5.0, p99_ttft_ms=9.0, mean_tpot_ms=1.0, median_tpot_ms=1.0,
                       p99_tpot_ms=2.0, mean_itl_ms=1.0, mean_e2el_ms=client, max_concurrency=c, concurrency=c,
                       num_prompts=8, client="builtin", server_e2e_ms=server)


def test_a_saved_level_keeps_the_servers_time_and_an_old_one_has_none() -> None:
    saved = level(64, 123.456, 400.0).to_dict()
    assert saved["server_e2e_ms"] == 123.456
    again = LevelResult.from_dict(saved)
    assert again == level(64, 123.456, 400.0) and "server_e2e_ms" not in again.other
    unseen = level(64, None, 400.0).to_dict()
    assert "server_e2e_ms" not in unseen and LevelResult.from_dict(unseen).server_e2e_ms is None


def test_tune_names_the_levels_that_measured_the_client() -> None:
    doc = TuneReport.from_dict({
        "model": "m", "input_len": 128, "output_len": 256, "concurrencies": [1, 256], "baseline": "dp4",
        "runs": [{"preset": "dp4", "layout": "DP4", "ready_s": 100.0,
                  "results": [level(1, 95.0, 100.0).to_dict(), level(256, 1_000.0, 4_000.0).to_dict()]}]})
    text = render_table(doc)
    notes = [line for line in text.splitlines() if "vLLM had each request" in line]
    assert len(notes) == 1 and notes[0].startswith("dp4: c=256: vLLM had each request for 25% of the time")
