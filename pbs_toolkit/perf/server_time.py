"""How much of a benchmark level's time vLLM itself accounts for: a level limited outside vLLM's engines.

A load generator that cannot keep its requests open, or a server whose API process cannot hand them to its engines
as fast as they come, caps a level below what the engines can do; its tokens/s then describe the client or the front
end, not the preset. On 2x H200 (session 13, benchmarks/README.md) dp2's engines ran about 395 of 1,024 open
requests with none waiting. ``vllm:e2e_request_latency_seconds`` is vLLM's own time of each request: from when its
API server begins rendering the prompt (after the HTTP request was read and parsed; images and tokenizing are
inside) to the engine's last output for it (vLLM 0.22, ``renderers/base.py`` ``arrival_time``). Read before and
after a level, its sum and count give vLLM's mean time of that level's requests (``vllm bench serve``'s warm-ups
within a level are of the level's length and change little). Against the client's mean end-to-end latency it says
how much of the waiting happened inside vLLM.

A service's level (``pbstk bench SERVICE``) goes through its router; the clock then looks at every serving
replica's histogram and adds their differences, each replica's own (one replica restarted: no figure), so that the
note also tells a level limited by the router or its front from one limited by the replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.perf.scrape import scrape
from pbs_toolkit.transports import Runner
from pbs_toolkit.vllm.prom import Histogram, delta

#: a level whose requests spent less than this share of the client's time inside vLLM gets a note
INSIDE_SHARE_NOTE = 0.8
#: a look at ``/metrics`` between levels: short, as a busy server's ``/metrics`` may not answer at once
LOOK_TIMEOUT_S = 3.0


#: one look: each server's histogram, in the order of the clock's servers
Look = tuple[Histogram, ...]


class ServerClock:
    """vLLM's ``e2e_request_latency_seconds`` histogram of one server or of several (a service's replicas, whose
    router's ``/metrics`` is not a vLLM's), looked at between levels.

    After one look that fails or finds no such histogram on any of them (a router, a server of another kind, a
    replica gone) it forgets its servers and looks no more: one missing figure, not a delay at every level."""

    def __init__(self, servers: Sequence[tuple[Runner, Any]]) -> None:
        self._servers = list(servers)

    def look(self) -> Look | None:
        if not self._servers:
            return None
        found = []
        for runner, st in self._servers:
            try:
                e2e = scrape(runner, st, timeout=LOOK_TIMEOUT_S).e2e
            except PbstkError:
                e2e = None
            if e2e is None:
                self._servers = []
                return None
            found.append(e2e)
        return tuple(found)


def server_mean_ms(before: Look | None, after: Look | None) -> float | None:
    """vLLM's mean end-to-end milliseconds of the requests that finished between two looks, over every server
    looked at (each one's ``prom.delta``, added); ``None`` without both looks, or when none finished, or when a
    server restarted in between (its count or sum went down: the observations since then are not the level's)."""
    if before is None or after is None or len(before) != len(after):
        return None
    total = count = 0.0
    for b, a in zip(before, after, strict=True):
        if a.count < b.count or a.sum < b.sum:
            return None
        d = delta(b, a)
        total, count = total + d.sum, count + d.count
    mean = Histogram(sum=total, count=count).mean()
    return None if mean is None else 1000.0 * mean


def outside_note(concurrency: int, server_ms: float | None, client_ms: float | None) -> str | None:
    """One line for a level whose requests waited mostly outside vLLM (vLLM's mean time of a request under
    ``INSIDE_SHARE_NOTE`` of the client's); ``None`` for one that did not, or where either time is unknown."""
    if server_ms is None or not client_ms:
        return None
    share = server_ms / client_ms
    if share >= INSIDE_SHARE_NOTE:
        return None
    return (f"c={concurrency}: vLLM had each request for {share:.0%} of the time the client waited for it "
            f"(mean {server_ms:,.0f} of {client_ms:,.0f} ms); the rest went before vLLM began on it or after its "
            "last token (the load generator, the network, a router, vLLM's HTTP layer): this level measured those "
            "more than the engines")
