"""``pbstk run M1 M2 --each -- COMMAND``: COMMAND once per model of the server, ``{model}`` and ``{alias}`` replaced
in its arguments, one after the other or ``--parallel N`` at once; a row per run and the worst exit status
(docs/campaigns.md "Several models").

Placeholders are ``{name}`` tokens (``name`` a word: letters, digits, ``_``) inside argv words (``out/{model}.json``
works); ``{{name}}`` is the text ``{name}``; every other brace is kept as written, so a JSON argument (``vf-eval
-a '{"num_examples": 10}'``) passes unchanged. Nothing is evaluated and no shell runs: each argv word is replaced
text, and the program is started from the argument list.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pbs_toolkit.campaigns.children import WAIT, Child, run_children
from pbs_toolkit.envvars import env_float
from pbs_toolkit.errors import PbstkError, UsageError, WaitTimeout
from pbs_toolkit.jobs.plan import slug
from pbs_toolkit.paths import user_state_dir
from pbs_toolkit.services import record as records
from pbs_toolkit.services.ready import check_route
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.session import ServiceSession

#: the placeholders ``--each`` fills in: the served name (the request's ``model``) and its registry alias
PLACEHOLDERS = ("model", "alias")
_TOKEN = re.compile(r"\{\{([A-Za-z_]\w*)\}\}|\{([A-Za-z_]\w*)\}", re.ASCII)


def check_placeholders(argv: Sequence[str]) -> None:
    """Refuse, before anything is launched, a ``{name}`` that ``--each`` does not fill in."""
    for word in argv:
        for found in _TOKEN.finditer(word):
            name = found.group(2)
            if name is not None and name not in PLACEHOLDERS:
                raise UsageError(f"COMMAND argument {word!r}: unknown placeholder {{{name}}} (known: "
                                 + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS) + f"; write {{{{{name}}}}} for the "
                                 f"text {{{name}}})")


def expand(argv: Sequence[str], values: dict[str, str]) -> list[str]:
    """``argv`` with each ``{name}`` replaced by ``values[name]`` and ``{{name}}`` by the text ``{name}``."""
    def one(found: re.Match[str]) -> str:
        if found.group(1) is not None:
            return "{" + found.group(1) + "}"
        return values[found.group(2)]

    return [_TOKEN.sub(one, word) for word in argv]


@dataclass
class ModelRun:
    """One run of COMMAND: the model's served name, its alias, and the process (its code, duration, log)."""

    model: str
    alias: str
    child: Child

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "alias": self.alias, "exit_code": self.child.code,
                "seconds": self.child.seconds, "log": None if self.child.log is None else str(self.child.log),
                "not_run": self.child.why or None}


def worst(runs: Sequence[ModelRun]) -> int:
    """The exit status of ``run --each``: the largest of the runs' (0 only when every run succeeded); a run that
    never started (an interrupt came first) counts as 1."""
    return max((1 if r.child.code is None else r.child.code for r in runs), default=0)


def wait_models(session: ServiceSession, rec: ServiceRecord, timeout: float, every: float = 0.25) -> None:
    """Until the router lists a server for every model of a multi-model service and answers the key
    (``WaitTimeout`` after ``timeout`` s): a service is READY once each of its jobs is routable, and the keeper
    adds a job's other models right after its first."""
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        try:
            route = check_route(session, rec)
            if route.ok and route.workers is not None and len(route.workers) >= len(rec.models):
                return
        except PbstkError:
            route = None
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"service {rec.name}: not every one of its {len(rec.models)} models is in the router "
                              f"after {timeout:g} s ({route.text if route else 'no answer'})")
        time.sleep(every)


def model_wait_seconds() -> float:
    """``PBSTK_RUN_MODEL_WAIT_S``: how long a run of ``--each`` waits for its model's server while the service
    replaces it (600, ten minutes); then the run fails with the cause."""
    return env_float("PBSTK_RUN_MODEL_WAIT_S", 600.0, lambda v: 0 <= v < float("inf"))


class ModelGate:
    """Whether a run of ``--each`` may start against its model now (``run_children``'s gate): the service's
    keeper has that model's job READY and its server answers (a refused connection is a dead server; a slow
    answer is a busy one, which serves). While the job is being replaced, the run waits (at most ``wait_s``,
    and says so once), then fails with the cause; a job the service stopped restarting fails it at once.

    A model's server that died during the previous run (its job ended, all its models with it) is caught here
    even before the keeper's next look: its server refuses the connection."""

    #: seconds between two looks at one model
    EVERY_S = 1.0

    def __init__(self, session: ServiceSession, name: str, notice: Callable[[str], None],
                 wait_s: float | None = None) -> None:
        self.session, self.name, self.notice = session, name, notice
        self.wait_s = model_wait_seconds() if wait_s is None else wait_s
        self.since: dict[str, float] = {}  # model -> when its run began to wait
        self.looked: dict[str, tuple[float, str | None]] = {}  # model -> (when, what the last look said)

    def __call__(self, model: str, label: str) -> str | None:
        now = time.monotonic()
        at, said = self.looked.get(model, (0.0, None))
        if said == WAIT and now - at < self.EVERY_S:
            return WAIT
        said, cause = self.look(model)
        self.looked[model] = (now, said)
        if said != WAIT:
            if model in self.since:
                self.notice(f"{label}: its server answers again after {now - self.since.pop(model):.0f} s")
            return said
        first = self.since.setdefault(model, now)
        if first == now:
            self.notice(f"{label}: waiting for its server ({cause}); at most {self.wait_s:g} s "
                        "(PBSTK_RUN_MODEL_WAIT_S)")
        if now - first > self.wait_s:
            return f"no server for {model} after {self.wait_s:g} s ({cause})"
        return WAIT

    def look(self, model: str) -> tuple[str | None, str]:
        """(None: go, WAIT, or why it never will; the cause of a wait)."""
        from pbs_toolkit.transports.http import reach

        rec = records.find(self.session.store, self.name)
        if rec.ended is not None:
            return f"service {self.name} has ended ({rec.state})", ""
        slots = _slots_of(rec, model)
        live = [s for s in slots if not s.gave_up]
        if not live:
            return f"its job is no longer restarted: {slots[0].gave_up}" if slots else "no job serves it", ""
        cause = "its job is being replaced"
        for slot in live:
            url = _url_of(slot, model)
            if slot.state != "READY" or not slot.current or url is None:
                cause = (f"its job is being replaced after: {slot.last_failure}" if slot.last_failure
                         else f"its job is {slot.state}")
                continue
            parts = urlsplit(url)
            status, why = reach(self.session.runner(rec.transport), parts.hostname or "", parts.port or 80,
                                timeout=2.0)
            if status is not None or (why and "timed out" in why):  # answers, or too busy to: it serves
                return None, ""
            cause = f"its server at {url} does not answer ({why})"
        return WAIT, cause


def _slots_of(rec: ServiceRecord, model: str) -> list[Slot]:
    """The slots whose jobs serve ``model``: a multi-model service's planned job, else every replica."""
    if not rec.models:
        return [s for s in rec.slots if not s.retiring]
    jobs = {m["job"] for m in rec.models if m["served_model_name"] == model}  # planned job K is slot K - 1
    return [rec.slots[j - 1] for j in sorted(jobs) if 0 < j <= len(rec.slots)]


def _url_of(slot: Slot, model: str) -> str | None:
    """The URL of ``model``'s server in the slot's current job, as the keeper saw it."""
    job = slot.current or ""
    for url, served in slot.model_urls.get(job, {}).items():
        if served == model:
            return url
    return slot.urls.get(job)


def log_dir(name: str) -> Path:
    """Where ``--parallel`` runs write their output: ``$XDG_STATE_HOME/pbstk/runs/NAME-YYYYmmdd-HHMMSS/``."""
    return user_state_dir() / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_each(models: Sequence[tuple[str, str]], command: Sequence[str], env: dict[str, str],
             notice: Callable[[str], None], *, parallel: int = 1, logs: Path | None = None,
             grace_s: float = 10.0, gate: Callable[[str, str], str | None] | None = None,
             watch: tuple[str, str] = ("", "")) -> tuple[list[ModelRun], list[int]]:
    """COMMAND once per ``(served name, alias)``, with ``PBSTK_MODEL``/``PBSTK_ALIAS`` set and the placeholders
    replaced; ``parallel`` > 1: that many at once, each writing to ``logs/K-SLUG.log``; ``gate`` (a
    :class:`ModelGate`): whether a run's model can be served now; ``watch``: as ``children.run_command``'s. Returns the
    runs (in the models' order) and the signals received (empty: none)."""
    runs = []
    for i, (model, alias) in enumerate(models, 1):
        argv = expand(command, {"model": model, "alias": alias})
        log = logs / f"{i}-{slug(model)}.log" if parallel > 1 and logs is not None else None
        runs.append(ModelRun(model, alias, Child(argv, {**env, "PBSTK_MODEL": model, "PBSTK_ALIAS": alias}, log,
                                                 note_file=watch[0], note=watch[1])))
    by_child = {id(r.child): r for r in runs}
    total = len(runs)

    def started(child: Child) -> None:
        run = by_child[id(child)]
        where = f" (output: {child.log})" if child.log is not None else ""
        notice(f"[{runs.index(run) + 1}/{total}] {run.model}: {' '.join(child.argv)}{where}")

    def ended(child: Child) -> None:
        run = by_child[id(child)]
        notice(f"[{runs.index(run) + 1}/{total}] {run.model}: "
               + (f"not run: {child.why}" if child.why else f"exit {child.code}"))

    def ready(child: Child) -> str | None:
        run = by_child[id(child)]
        return None if gate is None else gate(run.model, f"[{runs.index(run) + 1}/{total}] {run.model}")

    received = run_children([r.child for r in runs], notice, parallel, grace_s, started, ended, ready)
    return runs, received
