"""The autoscaling policy of a service (``pbstk serve --min-replicas N --max-replicas M``): a pure function from one
tick's observations to a decision, so every rule is tested without a process (tests/test_autoscale.py).

The keeper (services/keeper/loop.py, through services/keeper/scaler.py) observes once per tick and applies the decision:

* **up** when the service is overloaded for ``UP_TICKS`` ticks in a row (the tick after a first overloaded one comes
  ``CONFIRM_S`` after the overload was first seen, not a whole poll interval later; between ticks the keeper
  watches the router's open requests, and when they alone show an overload that a tick could act on
  (``router_overload``: the same rule as a tick whose ``/metrics`` went unanswered, only while nothing is counted
  or starting and the service may grow) a tick runs at once, and the overload counts as seen from that sighting,
  ``Observation.sighted``): the replicas' ``vllm:num_requests_waiting``
  (summed) above ``W`` (``--scale-up-waiting``, default 1), or every replica that answered running at its capacity
  (``--max-num-seqs``, when known) with some request waiting, or the router failing requests for want of a worker
  (its 503s and exhausted retries since the last tick, from its Prometheus port), or a queue before the engines:
  the requests open at the router (in flight to the replicas, from its Prometheus port) above what the replicas
  report holding (running + waiting) by more than ``W`` and a tenth of that (``QUEUE_SLACK``: a request in transit
  between the two looks is no queue). vLLM's API server can hold requests its engine has not taken in yet: measured
  on an H100, 512 open, the replicas said ``256 running, 0 waiting``. A tick in which no replica's ``/metrics``
  answered (vLLM serves it on the same busy event loop as ``/health``) still counts from the router's figure when the
  capacity is known: more requests open than the routable replicas' ``--max-num-seqs`` plus ``W``; without it,
  the queue rule against what they last reported holding (while as many are routable); with neither it neither
  counts nor resets the count; a replica in the
  router whose last look failed still serves (services/health.py) and is not "starting". Never above
  ``--max-replicas``, nor above what the profile's ``max_running_jobs`` lets run at once (halved with keep-alive:
  every replica needs room for its successor); while a replica added earlier is still queued or starting, nothing
  more is added: it counts toward the target already, so a slow queue does not turn a burst into a storm of jobs;
* **down** (one replica, drained first) after ``D`` (``--scale-down-idle``, default 5m) in which no request
  waited (at the replicas, or open at the router beyond what they hold and a tenth) and the running ones fit on
  one replica fewer (spare capacity: ``--max-num-seqs`` of each replica, when known; otherwise only when nothing
  runs); never below ``--min-replicas``; and not within ``D`` of the last change (a cooldown: a replica added for
  a burst is not removed in the lull between two waves);
* otherwise **hold**, with the reason.

``news`` is the keeper's log line for the count: an overload seen (``overload seen (1/2): <signal>``) or a counted
one dismissed (``overload dismissed after N tick(s): <the tick's reason>``); a quiet tick has none.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from pbs_toolkit.durations import short
from pbs_toolkit.errors import UsageError

#: how many ticks in a row the waiting requests must stay above ``W`` before a replica is added
UP_TICKS = 2
#: seconds to the look that confirms an overload, when the keeper's poll interval is longer: a burst is confirmed
#: (or dismissed) 5 s after it was first seen, not a whole 15 s poll later
CONFIRM_S = 5.0
DEFAULT_UP_WAITING = 1.0
DEFAULT_DOWN_IDLE_S = 300.0
#: the requests open at the router may exceed what the replicas hold by ``W`` plus this share of it (in transit)
QUEUE_SLACK = 0.1


@dataclass(frozen=True)
class ScaleSpec:
    """What the user asked for (``serve`` options)."""

    min_replicas: int
    max_replicas: int
    up_waiting: float = DEFAULT_UP_WAITING
    down_idle_s: float = DEFAULT_DOWN_IDLE_S

    def check(self, max_replicas_allowed: int) -> None:
        if self.min_replicas < 1:
            raise UsageError(f"--min-replicas {self.min_replicas}: a service keeps at least 1 replica (to end an "
                             f"idle service, use --idle-cancel)")
        if self.max_replicas < self.min_replicas:
            raise UsageError(f"--max-replicas {self.max_replicas} is below --min-replicas {self.min_replicas}")
        if self.max_replicas > max_replicas_allowed:
            raise UsageError(f"--max-replicas {self.max_replicas}: at most {max_replicas_allowed} replicas per service")
        if not math.isfinite(self.up_waiting) or self.up_waiting < 0:
            raise UsageError(f"--scale-up-waiting {self.up_waiting}: must be a number of requests >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleSpec:
        return cls(int(data["min_replicas"]), int(data["max_replicas"]), float(data["up_waiting"]),
                   float(data["down_idle_s"]))


@dataclass(frozen=True)
class Observation:
    """One tick's look at the service."""

    now: float
    #: replicas the service has now (queued and starting ones included; those being removed not)
    target: int
    #: of those, how many are queued or starting (not in the router yet)
    starting: int
    #: requests waiting and running, summed over the replicas in the router (``None``: no replica answered)
    waiting: float | None
    running: float | None
    #: one replica's capacity (``--max-num-seqs``), when known
    capacity: int | None = None
    #: the most replicas the profile's ``max_running_jobs`` lets run at once (0: no limit known)
    job_cap: int = 0
    #: how many replicas' ``/metrics`` answered this tick (what ``waiting`` and ``running`` sum over)
    answered: int = 0
    #: requests the router failed since the last tick for want of a worker (503s, exhausted retries); ``None``:
    #: not known
    refused: float | None = None
    #: requests open at the router now (sent to a replica, no answer yet); ``None``: not known
    in_flight: float | None = None
    #: when the keeper's watch between ticks saw the router's figure alone show this overload (``router_overload``),
    #: which woke this tick; ``None``: the tick came on its own
    sighted: float | None = None

    @property
    def routable(self) -> int:
        return self.target - self.starting

    @property
    def held(self) -> float | None:
        """What every routable replica reports holding (running + waiting); ``None`` unless all of them answered."""
        if self.waiting is None or not self.routable or self.answered < self.routable:
            return None
        return self.waiting + (self.running or 0)


@dataclass
class Memory:
    """What the policy carries from one tick to the next (saved in the service's record)."""

    #: consecutive ticks with more than ``W`` requests waiting
    above: int = 0
    #: since when no request has waited and the running ones fit on one replica fewer (``None``: not so now)
    calm_since: float | None = None
    #: when the last replica was added or removed
    last_change: float = 0.0
    #: what the replicas last reported holding (running + waiting, every routable one answering), and how many
    #: were routable then: the stand-in for their capacity in a tick where none answers
    held: float | None = None
    held_by: int = 0
    #: when the overload being counted was first seen (the confirming look is due ``CONFIRM_S`` after it)
    seen_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Memory:
        data = data or {}
        return cls(int(data.get("above") or 0), data.get("calm_since"), float(data.get("last_change") or 0.0),
                   data.get("held"), int(data.get("held_by") or 0), data.get("seen_at"))


@dataclass(frozen=True)
class Decision:
    """``up``, ``down`` or ``hold``, and why, in words."""

    action: str
    reason: str
    at: float = 0.0
    target: int = 0
    #: the overload this tick saw, in words (``None``: none); not saved
    signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "at": self.at, "target": self.target}


def limit(spec: ScaleSpec, obs: Observation) -> tuple[int, str]:
    """The most replicas allowed now, and which option or profile key sets it."""
    if obs.job_cap and obs.job_cap < spec.max_replicas:
        return obs.job_cap, "the profile's max_running_jobs"
    return spec.max_replicas, "--max-replicas"


def _spare(obs: Observation) -> bool:
    """No request waits (nor is open at the router beyond what the replicas hold) and the running ones would fit on
    one replica fewer."""
    if obs.waiting is None or obs.running is None or obs.waiting > 0:
        return False
    held = obs.held
    if obs.in_flight is not None and held is not None and obs.in_flight - held > QUEUE_SLACK * held + 1:
        return False  # queued before the engines (a request or two in transit between the two looks is not)
    if obs.capacity:
        return obs.running <= (obs.target - obs.starting - 1) * obs.capacity
    return obs.running == 0


def overloaded(spec: ScaleSpec, obs: Observation, memory: Memory | None = None) -> str | None:
    """Why the service is overloaded, in words, or ``None``: the router failed requests for want of a worker,
    more than ``W`` waiting, or all the replicas that answered running at their capacity with requests waiting."""
    if obs.refused and obs.starting < obs.target:  # with every replica still starting, a 503 says nothing of load
        return f"{obs.refused:g} request(s) failed at the router (no worker free, retries exhausted)"
    if obs.waiting is None:
        return _over_capacity(spec, obs, memory or Memory())
    if obs.waiting > spec.up_waiting:
        return f"{obs.waiting:g} request(s) waiting (> {spec.up_waiting:g})"
    full = obs.capacity and obs.answered and (obs.running or 0) >= obs.answered * obs.capacity
    if full and obs.waiting > 0:
        return f"{obs.running or 0:g} running at capacity ({obs.answered} x --max-num-seqs {obs.capacity}), " \
               f"{obs.waiting:g} waiting"
    return _queued_before_engines(spec, obs)


def _queued_before_engines(spec: ScaleSpec, obs: Observation) -> str | None:
    """More requests open at the router than every routable replica reports holding (running + waiting), by more
    than ``W`` and ``QUEUE_SLACK`` of what they hold: requests queued before the engines."""
    held = obs.held
    if obs.in_flight is None or held is None:
        return None
    queued = obs.in_flight - held
    if queued > spec.up_waiting + QUEUE_SLACK * held:
        return f"{obs.in_flight:g} request(s) open at the router, the replicas hold {held:g} " \
               f"({obs.running or 0:g} running, {obs.waiting or 0:g} waiting): {queued:g} queued before the engines"
    return None


def _over_capacity(spec: ScaleSpec, obs: Observation, memory: Memory) -> str | None:
    """No replica's ``/metrics`` answered: more requests open at the router than the routable replicas' capacity
    (``--max-num-seqs`` each) plus ``W``; without a known capacity, more than they last reported holding (the
    queue rule, against their last answer, while as many are routable)."""
    if obs.in_flight is None or not obs.routable:
        return None
    if obs.capacity:
        if obs.in_flight > obs.routable * obs.capacity + spec.up_waiting:
            return f"{obs.in_flight:g} request(s) open at the router, above the capacity of the replicas " \
                   f"({obs.routable} x --max-num-seqs {obs.capacity}; their /metrics did not answer)"
        return None
    held = _last_held(obs, memory)
    if held is not None and obs.in_flight - held > spec.up_waiting + QUEUE_SLACK * held:
        return f"{obs.in_flight:g} request(s) open at the router, the replicas last held {held:g} (their /metrics " \
               f"did not answer): {obs.in_flight - held:g} queued before the engines"
    return None


def _last_held(obs: Observation, memory: Memory) -> float | None:
    """What the replicas last reported holding, if as many are routable now as then."""
    return memory.held if memory.held is not None and memory.held_by == obs.routable else None


def _news(obs: Observation, memory: Memory) -> bool:
    """Whether this tick says anything of the load: a replica answered, or the router's figure has something to
    be set against (a known capacity, or what the replicas last held)."""
    if obs.waiting is not None:
        return True
    return obs.in_flight is not None and (bool(obs.capacity) or _last_held(obs, memory) is not None)


def confirm_within(scale: dict[str, Any] | None, now: float) -> float | None:
    """While an overload is being counted (seen, not yet for ``UP_TICKS`` ticks): the seconds until ``CONFIRM_S``
    after it was first seen (0: at once), else ``None``: how soon the keeper looks again (``scale``: the record's
    autoscaling state, its ``memory`` as :class:`Memory`)."""
    if not scale:
        return None
    memory = Memory.from_dict(scale.get("memory"))
    if not 0 < memory.above < UP_TICKS:
        return None
    seen = memory.seen_at if memory.seen_at is not None else now
    return max(0.0, seen + CONFIRM_S - now)


def worth_watching(spec: ScaleSpec, memory: Memory, obs: Observation) -> bool:
    """Whether an overload sighted between ticks could bring a tick forward to any end: none is being counted
    yet, no replica is on its way, and the service may grow."""
    return not memory.above and not obs.starting and obs.target < limit(spec, obs)[0]


def router_overload(spec: ScaleSpec, memory: Memory, obs: Observation) -> str | None:
    """Between ticks (the keeper's watch, one request to the router's Prometheus port a second): why the router's
    figure alone (``obs.in_flight``; the replicas are not asked) shows an overload worth a tick now, or ``None``.
    The same rule as a tick in which no replica's ``/metrics`` answered; only while no overload is being counted
    yet, nothing is starting and the service may grow (otherwise a tick now would change nothing)."""
    if not worth_watching(spec, memory, obs):
        return None
    return _over_capacity(spec, replace(obs, waiting=None, running=None, answered=0), memory)


def news(before: Memory, after: Memory, decision: Decision) -> str | None:
    """The keeper's log line for what this tick did to the overload count, or ``None`` (no line on a quiet tick,
    nor on a scale-up, logged by itself): an overload first seen (tick 1 of ``UP_TICKS``, with its signal, and how
    much earlier the keeper's watch sighted it at the router), or a counted one dismissed (the count reset, with
    the tick's reason). A watch's sighting that the tick does not count writes no line."""
    if decision.action != "hold":
        return None
    if not before.above and after.above:
        early = decision.at - after.seen_at if after.seen_at is not None else 0.0
        how = f" (sighted at the router {early:.1f} s earlier, between ticks: this tick came at once)" \
            if early > 0 else ""
        return f"overload seen ({after.above}/{UP_TICKS}): {decision.signal}{how}"
    if before.above and not after.above:
        return f"overload dismissed after {before.above} tick(s): {decision.reason}"
    return None


def decide(spec: ScaleSpec, memory: Memory, obs: Observation) -> tuple[Decision, Memory]:
    """The decision for this tick and the memory for the next one. Pure."""
    over = overloaded(spec, obs, memory)
    above = memory.above + 1 if over else (memory.above if not _news(obs, memory) else 0)  # no answer: no news
    calm = obs.now if memory.calm_since is None else memory.calm_since
    held, held_by = (obs.held, obs.routable) if obs.held is not None else (memory.held, memory.held_by)
    seen = (memory.seen_at if memory.above else None) or (obs.sighted or obs.now if over else None)
    mem = Memory(above, calm if _spare(obs) else None, memory.last_change, held, held_by, seen if above else None)
    top, why_top = limit(spec, obs)

    def act(action: str, reason: str, target: int) -> tuple[Decision, Memory]:
        done = Memory(0, None if action == "up" else obs.now, obs.now)
        return Decision(action, reason, obs.now, target, over), done

    def hold(reason: str) -> tuple[Decision, Memory]:
        return Decision("hold", reason, obs.now, obs.target, over), mem

    if obs.target < spec.min_replicas:
        return act("up", f"{obs.target} replica(s), below --min-replicas {spec.min_replicas}", obs.target + 1)
    if obs.target > top:
        return act("down", f"{obs.target} replicas, above {why_top} ({top})", obs.target - 1)
    waiting = f"{over or 'no answer from the replicas this tick'}; overloaded for {above} tick(s)"
    if above >= UP_TICKS:
        if obs.starting:
            return hold(f"{waiting}, but {obs.starting} replica(s) still queued or starting count toward the target")
        if obs.target >= top:
            return hold(f"{waiting}, but at {why_top} ({top})")
        return act("up", waiting, obs.target + 1)
    if mem.calm_since is not None and obs.target > spec.min_replicas:
        calm_for = obs.now - mem.calm_since
        since_change = obs.now - memory.last_change
        if calm_for >= spec.down_idle_s and since_change >= spec.down_idle_s:
            fit = f"{obs.running:g} running fit on {obs.target - 1}" if obs.running else "nothing running"
            return act("down", f"no request waiting for {short(calm_for)} and {fit}", obs.target - 1)
        wait = max(spec.down_idle_s - calm_for, spec.down_idle_s - since_change)
        return hold(f"spare capacity; one replica fewer in {short(wait)} if it stays so")
    if above:
        return hold(f"{waiting}: one more tick and a replica is added")
    if obs.waiting is None:
        return hold("no replica in the router answered /metrics yet")
    state = "at --min-replicas" if obs.target <= spec.min_replicas else "no spare capacity"
    return hold(f"{obs.waiting:g} waiting, {obs.running or 0:g} running; {state}")
