"""``start_router.sh``: the one start procedure of a service's vllm-router, on this machine or a login node
(``router: local``/``login``, :func:`~pbs_toolkit.services.router.process.start_router` runs it detached) and inside a
router job (``router: job``, the job runs it): a header of quoted settings rendered here, then the free-port rule
(``server/start/free_port.sh``, the start script's own) and the static body ``server/start_router.sh``.

The script picks the router's two ports free on its host, starts the router (behind pbstk's front when
isolated) with :func:`router_argv`'s command line, retries a lost bind race with new ports, takes a
``SEEDED_POLICIES`` router's start-up worker out again, and once the router answers ``/list_workers`` writes
``router.json`` (host, ports, pid; no secret), which the caller waits for: :func:`read_started`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbs_toolkit.jobs.render import START_DIR, sh_path
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.version import __version__

ENTRY_SCRIPT = "start_router.sh"
INFO_FILE = "router.json"
#: the front that keeps the router off the host's network (``server/router_front.py``), copied into the run dir
FRONT_FILE = "router_front.py"
#: the front's admin token in the run directory (0600; the script reads it into PBSTK_ROUTER_TOKEN)
TOKEN_FILE = "router.token"
_BODY = Path(__file__).resolve().parent.parent.parent / "server" / ENTRY_SCRIPT
#: the free-port rule, shared with the servers' start script
FREE_PORT_PART = START_DIR / "free_port.sh"
#: seconds the router gets to answer once started, and to drain after SIGTERM before it is killed
START_WAIT_S = 60
STOP_WAIT_S = 20
#: what ``start_router.sh`` puts into the router's command line once it has chosen them on its host
PORT_SLOT, PROM_PORT_SLOT, PYTHON_SLOT = "@PORT@", "@PROM_PORT@", "@PYTHON@"
#: attempts of a request that fails to reach its worker (``--retry-max-retries``, vllm-router's own default written
#: out): 5 attempts in all, the first one counted (measured: 5 failed sends to a dead worker, then a 500)
ROUTER_RETRIES = 5
#: consecutive failures that open a worker's circuit (``--cb-failure-threshold``): fewer than a request's attempts,
#: so a dead worker's circuit opens while a request still has an attempt left, and that one goes to a live worker
ROUTER_CB_FAILURES = ROUTER_RETRIES - 1
#: the router's own health checker never marks a worker unhealthy: the keeper is the one judge of a replica's
#: health (services/health.py), patient with a busy one, quick with a dead one (its job ended: out at once)
ROUTER_HEALTH_NEVER = 1_000_000_000
#: added before ``extra_args`` (argparse: a later repeat of an option wins, so callers can override each).
#: ``--cb-failure-threshold`` below the attempts: vllm-router's default, 10, let a request's attempts all land on a
#: replica killed a moment before (power_of_two between two idle workers picks either: a 500 for the client,
#: tests/test_router.py), and so did 5, equal to the attempts (1 run in 6 on 2 cores); the keeper takes such a
#: replica out only at its next look. A busy worker fails no request, so its circuit stays closed.
#: ``--health-failure-threshold``: the router's health checker (a 5 s timeout, 3 failures by default) took the one
#: replica of a service out while its ``/health`` answered 5 s late under overload, and 207 of 397 requests got 503
#: while the keeper kept it (issue 41): it now never does.
DEFAULT_ARGS: tuple[str, ...] = (
    "--retry-max-retries", str(ROUTER_RETRIES),
    "--cb-failure-threshold", str(ROUTER_CB_FAILURES),
    "--health-check-interval-secs", "5",
    "--health-failure-threshold", str(ROUTER_HEALTH_NEVER),
    "--worker-startup-timeout-secs", "20",
    "--worker-startup-check-interval", "1",
)
#: policies vllm-router 0.1.17 refuses to start with fewer than 2 workers ("Power-of-two policy requires at least 2
#: workers"), although they route any number once started (measured: 2, 1, 0, then 1 again after an add). Such a
#: router starts with its own Prometheus port (bound before the router waits for its workers; ``/health`` answers
#: 200) given twice as its workers, and that seed is removed before the router's URL is handed to anyone.
SEEDED_POLICIES = ("power_of_two",)


def reach_address(bind: str) -> str:
    """The address to connect to on the router's own host for a router bound to ``bind`` (``start_router.sh``
    has the same rule)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind, bind)


def seed_url(bind: str, prometheus_port: int | str) -> str:
    """The router's own Prometheus endpoint as a worker URL: the seed of a ``SEEDED_POLICIES`` router."""
    host = reach_address(bind)
    return f"http://[{host}]:{prometheus_port}" if ":" in host else f"http://{host}:{prometheus_port}"


def router_argv(command: Sequence[str], *, policy: str, bind: str, port: int | str, prometheus_port: int | str,
                worker_urls: Sequence[str] = (), extra_args: Sequence[str] = (),
                front: tuple[str, str] | None = None) -> tuple[list[str], str | None]:
    """The command line that starts a router: the one place it is built (:func:`render_start_script` renders it
    with slots for the ports the script chooses on its host, and the front's Python).

    ``front``: (its Python, the path of ``router_front.py``) to run the router behind the front, which binds
    ``bind``'s ports and gives the router its own inside a private network namespace; ``None``: the router binds
    them itself. Returns (argv, seed): ``seed`` is the worker URL a ``SEEDED_POLICIES`` router with fewer than 2
    workers starts with (twice) and that must be removed once it answers, else ``None``."""
    router = [*command, "--policy", policy, *DEFAULT_ARGS, *extra_args]
    seed = seed_url(bind, prometheus_port) if policy in SEEDED_POLICIES and len(worker_urls) < 2 else None
    if worker_urls or seed:
        router += ["--worker-urls", *worker_urls, *([seed, seed] if seed else [])]
    if front is not None:
        return [front[0], front[1], bind, str(port), str(prometheus_port), "--", *router], seed
    return [*router, "--host", bind, "--port", str(port), "--prometheus-port", str(prometheus_port),
            "--prometheus-host", bind], seed


@dataclass(frozen=True)
class ScriptSettings:
    """What differs between two routers' ``start_router.sh``: the header's settings."""

    run_dir: str
    command: Sequence[str]
    policy: str
    bind: str
    isolate: bool
    #: the address clients use; "" = this host's as ``address_mode`` names it (a profile's ``address`` key)
    advertise: str = ""
    address_mode: str = "hostname"
    address_suffix: str = ""
    worker_urls: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    venv: str = ""
    start_wait_s: int = START_WAIT_S
    stop_wait_s: int = STOP_WAIT_S
    #: the header's first comment: what this router is for
    about: str = "a router"


def render_start_script(settings: ScriptSettings) -> str:
    """``start_router.sh``: a header of quoted settings, the free-port rule, then the static body (shellcheck
    reads both as they run)."""
    s = settings
    front = (PYTHON_SLOT, f"{s.run_dir}/{FRONT_FILE}") if s.isolate else None
    argv, seed = router_argv(s.command, policy=s.policy, bind=s.bind, port=PORT_SLOT, prometheus_port=PROM_PORT_SLOT,
                             worker_urls=s.worker_urls, extra_args=s.extra_args, front=front)
    lines = [
        "#!/bin/bash",
        f"# Generated by pbstk {__version__}: {s.about}.",
        "# shellcheck disable=SC2034  # settings the body below reads",
        f"RUN_DIR={sh_path(s.run_dir)}",
        f"ROUTER_CMD={_array(s.command)}",
        "# the router's command line (services/router/script.py router_argv): the body puts in the",
        f"# ports it picks ({PORT_SLOT}, {PROM_PORT_SLOT}) and the front's Python ({PYTHON_SLOT})",
        f"ROUTER_ARGV={_array(argv)}",
        f"BIND_HOST={shlex.quote(s.bind)}",
        f"ADVERTISE={shlex.quote(s.advertise)}",
        f"ADDRESS_MODE={shlex.quote(s.address_mode)}",
        f"ADDRESS_SUFFIX={shlex.quote(s.address_suffix)}",
        f"POLICY={shlex.quote(s.policy)}",
        f"# the start-up worker to remove once the router answers ('': none; {PROM_PORT_SLOT} as above)",
        f"SEED_URL={shlex.quote(seed or '')}",
        f"VENV={sh_path(s.venv) if s.venv else shlex.quote('')}",
        f"START_WAIT_S={int(s.start_wait_s)}",
        f"STOP_WAIT_S={int(s.stop_wait_s)}",
        f"ISOLATE={1 if s.isolate else 0}",
    ]
    return "\n".join(lines) + "\n" + FREE_PORT_PART.read_text(encoding="utf-8") + _BODY.read_text(encoding="utf-8")


def _array(values: Sequence[str]) -> str:
    return "(" + " ".join(shlex.quote(v) for v in values) + ")"


def read_started(runner: Runner, run_dir: str) -> dict[str, Any] | None:
    """``router.json`` as the script wrote it once its router answered, or None while there is none (or a
    partial one: the script renames a complete file in, a partial read is retried)."""
    try:
        data = json.loads(runner.read_bytes(f"{run_dir}/{INFO_FILE}"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
