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

from pbs_toolkit.campaigns.children import Child, run_children
from pbs_toolkit.errors import PbstkError, UsageError, WaitTimeout
from pbs_toolkit.jobs.plan import slug
from pbs_toolkit.paths import user_state_dir
from pbs_toolkit.services.ready import check_route
from pbs_toolkit.services.record import ServiceRecord
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
                "seconds": self.child.seconds, "log": None if self.child.log is None else str(self.child.log)}


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


def log_dir(name: str) -> Path:
    """Where ``--parallel`` runs write their output: ``$XDG_STATE_HOME/pbstk/runs/NAME-YYYYmmdd-HHMMSS/``."""
    return user_state_dir() / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_each(models: Sequence[tuple[str, str]], command: Sequence[str], env: dict[str, str],
             notice: Callable[[str], None], *, parallel: int = 1, logs: Path | None = None,
             grace_s: float = 10.0) -> tuple[list[ModelRun], list[int]]:
    """COMMAND once per ``(served name, alias)``, with ``PBSTK_MODEL``/``PBSTK_ALIAS`` set and the placeholders
    replaced; ``parallel`` > 1: that many at once, each writing to ``logs/K-SLUG.log``. Returns the runs (in
    the models' order) and the signals received (empty: none)."""
    runs = []
    for i, (model, alias) in enumerate(models, 1):
        argv = expand(command, {"model": model, "alias": alias})
        log = logs / f"{i}-{slug(model)}.log" if parallel > 1 and logs is not None else None
        runs.append(ModelRun(model, alias, Child(argv, {**env, "PBSTK_MODEL": model, "PBSTK_ALIAS": alias}, log)))
    by_child = {id(r.child): r for r in runs}
    total = len(runs)

    def started(child: Child) -> None:
        run = by_child[id(child)]
        where = f" (output: {child.log})" if child.log is not None else ""
        notice(f"[{runs.index(run) + 1}/{total}] {run.model}: {' '.join(child.argv)}{where}")

    def ended(child: Child) -> None:
        run = by_child[id(child)]
        notice(f"[{runs.index(run) + 1}/{total}] {run.model}: exit {child.code}")

    received = run_children([r.child for r in runs], notice, parallel, grace_s, started, ended)
    return runs, received
