"""Start, check and stop one ``vllm-router`` and add or remove its workers.

The router runs on the machine a :class:`Runner` reaches (this one, or a login node over SSH), detached in its own
session (``setsid -f``), so it outlives pbstk and the SSH connection. Its pid, ports and an identity token live in
``RUN_DIR/router.json`` (mode 0600); the token is also in the environment (``PBSTK_ROUTER_TOKEN``) of the small bash
wrapper that leads the router's process group (the recorded pid), and that group is only signalled while
``/proc/PID/environ`` still carries it, so a pid recycled by another process after the router died is never killed.
(The router itself cannot carry it: it renames itself ``vllm::router``, which overwrites its /proc/PID/environ.)
Linux only: without /proc (macOS) a router is never taken for alive, nor stopped. Ports are chosen free on the
router's host (never the defaults 30000/29000: two services on one login node would collide); a bind race that is
lost is retried with new ports.

What vllm-router 0.1.17 does (measured on loopback with tests/standins/vllm and a header-logging worker; see
docs/services.md "## The router"):

* **API key**: the router forwards the client's ``Authorization`` header to the worker unchanged and checks no key
  itself. A service's replicas share one key (in ``--config``); clients send it to the router URL and the replicas
  check it (no or a wrong key -> the replica's own 401, passed through). ``--api-key`` is only "the key for
  authorization with workers" for data-parallel routing; in regular mode it is neither required from clients nor
  added to forwarded requests, so pbstk never passes it (and a secret never goes in argv anyway). There is no
  environment variable for it: the launcher is plain argparse, and ``OPENAI_API_KEY`` in the router's environment
  is not added to forwarded requests either.
* **Admin endpoints are not authenticated** (``/add_worker``, ``/remove_worker``, ``/list_workers``), with or
  without ``--api-key``: anyone who reaches the router's port can add a worker of theirs and receive prompts with
  the clients' ``Authorization`` header (the service's key). So by default (``isolate``) the router listens only
  inside its own network namespace, behind ``server/router_front.py``, which passes on service traffic and wants
  the router's token (``RouterInfo.admin_token``, sent by :class:`RouterAdmin`) for everything else.
* **Health checks** are ``GET /health`` without any ``Authorization`` header, also with ``--api-key``: fine for
  vLLM, whose ``/health`` needs no key. ``/add_worker`` waits until the worker's ``/health`` answers
  (``--worker-startup-timeout-secs``, default 600 s, checked every ``--worker-startup-check-interval`` = 30 s):
  an unreachable URL used to hold the admin call for minutes, so pbstk starts the router with 20 s / 1 s.
* **Add / remove**: adding a URL already there is ``400 ... already exists``; removing one that is not there is
  ``200`` (logged as skipped). :class:`RouterAdmin` makes both idempotent.
* **No workers**: chat requests get ``503 No available workers (all circuits open or unhealthy)``.
* **A worker killed under load**: requests that fail to reach it (connection refused or reset, also a
  non-streaming request in flight when it died) are retried on another worker (``--retry-max-retries`` 5,
  backoff 50 ms x1.5); after 5 failures its circuit breaker opens and it gets no traffic for 60 s, then one probe
  (vllm-router's default is 10: a request's 6 attempts could all pick a dead worker; pbstk sets 5,
  ``script.py`` ``DEFAULT_ARGS``).
  Measured: 3 workers, 8 clients, one worker SIGKILLed, 4907 requests, 0 failed with the router's defaults
  (tests/test_router.py keeps that measurement). A streaming response already under way is not retried: when its
  worker dies the stream just ends (HTTP 200, no ``data: [DONE]``), so streaming clients should check for a
  ``finish_reason``.
  pbstk adds ``--health-check-interval-secs 5`` (default 60) so a dead worker is marked unhealthy within ~15 s
  (3 failed checks) instead of 3 minutes; the service removes a replica from the router when its job ends anyway.
* An unhealthy worker stays in ``/list_workers`` (the router's ``/health`` names it: ``Unhealthy servers: [...]``)
  and returns to rotation after 2 good checks: the worker list is what was added, not what is up.
* ``/remove_worker`` does not cut requests already sent to that worker: they complete there (a handover removes
  the predecessor, then drains it by watching its own ``/metrics``; the router does not count them any more).
* ``SIGTERM`` starts a graceful shutdown that can take up to a minute while connections drain: ``stop_router``
  waits ``timeout`` seconds, then kills the process group.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pbs_toolkit.services.router.admin import (
    ADD_WAIT_S,
    ADMIN_HEADER,
    RouterAdmin,
    RouterError,
    http_request,
    http_status,
    list_workers,
    open_admin,
)
from pbs_toolkit.services.router.script import (
    DEFAULT_ARGS,
    ENTRY_SCRIPT,
    FRONT_FILE,
    INFO_FILE,
    SEEDED_POLICIES,
    TOKEN_FILE,
    ScriptSettings,
    reach_address,
    read_started,
    render_start_script,
    router_argv,
    seed_url,
)
from pbs_toolkit.transports.base import Runner

#: the admin client lives in ``admin.py``, the start script in ``script.py``; callers may import
#: them from here with the rest of the router
__all__ = [
    "ADD_WAIT_S", "ADMIN_HEADER", "DEFAULT_ARGS", "SEEDED_POLICIES", "RouterAdmin", "RouterError", "RouterInfo",
    "http_request", "http_status", "list_workers", "load_info", "open_admin", "reach_address", "router_alive",
    "router_argv", "seed_url", "start_router", "stop_router",
]

TOKEN_ENV = "PBSTK_ROUTER_TOKEN"
LOG_FILE = "router.log"
FRONT_SOURCE = Path(__file__).resolve().parent.parent.parent / "server" / FRONT_FILE
#: every file the front needs on the router's host (its data path is a module of its own), copied side by side
#: the front and the modules it imports, copied side by side into the router's run directory
FRONT_SOURCES = tuple(FRONT_SOURCE.with_name(name) for name in (FRONT_FILE, "router_relay.py", "router_models.py"))
_WILDCARDS = ("0.0.0.0", "::", "")

# Constant scripts; every value arrives as a positional parameter, never spliced into the text.
_LAUNCH = r"""
d=$1; shift
exec </dev/null >>"$d/router.log" 2>&1
echo "$$" >"$d/router.pid.tmp" && mv -f "$d/router.pid.tmp" "$d/router.pid"
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
while :; do
  wait "$child"
  kill -0 "$child" 2>/dev/null || break
done
"""
# ours PID TOKEN: is PID (the wrapper above, leader of the router's process group) alive, not a zombie, and
# carrying the router's token? A pid recycled by another process, or one of another user (environ unreadable), is
# not ours. The wrapper stays because the router renames itself (``vllm::router``, setproctitle), which
# overwrites its own /proc/PID/environ: the token could not be read from the router itself.
_OURS = r"""
ours() {
  [ -n "$2" ] || return 1
  read -r st 2>/dev/null <"/proc/$1/stat" || return 1
  rest=${st##*) }
  [ "${rest%% *}" = Z ] && return 1
  tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qxF "PBSTK_ROUTER_TOKEN=$2"
}
"""
_ALIVE = _OURS + 'ours "$1" "$2"\n'
_STOP = _OURS + r"""
ours "$1" "$2" || exit 2
kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || exit 2
n=$(( $3 * 10 ))
while [ "$n" -gt 0 ]; do ours "$1" "$2" || exit 0; sleep 0.1; n=$((n - 1)); done
kill -KILL -- "-$1" 2>/dev/null || kill -KILL "$1" 2>/dev/null
exit 0
"""
# leader TOKEN: the pid of the process-group leader carrying the router's token (the wrapper, once ``setsid`` made it
# one), for a router recorded before its pid was known. A process carrying it that leads no group yet (``setsid -f``
# between fork and setsid) is waited for, a second at most: its group is still its starter's, never signalled.
_LEADER = r"""
for _ in 1 2 3 4 5 6 7 8 9 10; do
  young=
  for e in /proc/[0-9]*/environ; do
    tr '\0' '\n' 2>/dev/null <"$e" | grep -qxF "PBSTK_ROUTER_TOKEN=$1" || continue
    p=${e#/proc/}; p=${p%/environ}
    read -r st 2>/dev/null <"/proc/$p/stat" || continue
    read -r _ _ pgrp _ <<<"${st##*) }"
    if [ "$pgrp" = "$p" ]; then echo "$p"; exit 0; fi
    young=1
  done
  [ -n "$young" ] || exit 0
  sleep 0.1
done
"""
# the Python for the front, as start_router.sh finds it: the router's own (next to its command: a venv's, new
# enough), else python3 on PATH; asked before anything starts, for one clear error
_FRONT_PYTHON = r"""
r=$(command -v -- "$1") && [ -x "${r%/*}/python3" ] && [ "${r%/*}" != "$r" ] && { echo "${r%/*}/python3"; exit 0; }
command -v python3
"""


@dataclass
class RouterInfo:
    """Where a started router is and how to prove a pid is still it (``router.json``)."""

    host: str  # the address clients use (127.0.0.1 for a local router; the login node's address over ssh)
    port: int
    prometheus_port: int
    pid: int
    policy: str
    run_dir: str  # on the router's host: router.json (0600), router.log
    transport: str = ""  # "" = this machine, else the ssh host (as JobRecord.transport)
    #: identity token (in the router's environment) so a recycled pid is never killed; with the front, also
    #: its admin token: a secret, kept out of the repr
    token: str = field(default="", repr=False)
    #: the front's admin token (router_front.py): without it the admin API answers 403; "" = no front
    admin_token: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouterInfo:
        try:
            return cls(
                host=str(d["host"]), port=int(d["port"]), prometheus_port=int(d["prometheus_port"]),
                pid=int(d["pid"]), policy=str(d["policy"]), run_dir=str(d["run_dir"]),
                transport=str(d.get("transport") or ""), token=str(d.get("token") or ""),
                admin_token=str(d.get("admin_token") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RouterError(f"router record is incomplete or malformed: {exc}") from exc


def _where(runner: Runner) -> str:
    return "this machine" if runner.name == "local" else runner.name.split(":", 1)[-1]


def _transport(runner: Runner) -> str:
    return "" if runner.name == "local" else runner.name.split(":", 1)[-1]


def _check_command(runner: Runner, command: Sequence[str]) -> None:
    if not command:
        raise RouterError("the router command is empty (profile key router_command)")
    result = runner.run(["bash", "-c", 'command -v -- "$1"', "pbstk-which", command[0]], timeout=30)
    if not result.ok:
        raise RouterError(
            f"router command {command[0]!r} not found on {_where(runner)}: install it there "
            "(pip install vllm-router) or name it with the profile key router_command"
        )


def _log_tail(runner: Runner, run_dir: str, lines: int = 8) -> list[str]:
    path = f"{run_dir}/{LOG_FILE}"
    size = runner.size(path)
    if not size:
        return []
    data = runner.read_bytes(path, max(0, size - 8192)).decode(errors="replace")
    kept = [_plain(line) for line in data.splitlines() if line.strip() and not line.startswith("DEBUG:")]
    return kept[-lines:]


def _plain(line: str) -> str:
    """A log line without the ANSI colours the router writes even to a file."""
    return re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip()


def _read_pid(runner: Runner, run_dir: str, deadline: float) -> int:
    path = f"{run_dir}/router.pid"
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            text = runner.read_bytes(path).decode().strip()
            if text.isdigit():
                return int(text)
        time.sleep(0.05)
    raise RouterError(f"the router did not start on {_where(runner)} (no pid in {path})",
                      details=_log_tail(runner, run_dir))


def start_router(
    runner: Runner,
    run_dir: str,
    *,
    record: Callable[[RouterInfo], object] | None = None,
    command: Sequence[str] = ("vllm-router",),
    bind: str = "127.0.0.1",
    advertise: str | None = None,
    policy: str = "round_robin",
    worker_urls: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    isolate: bool = True,
) -> RouterInfo:
    """Start a router detached on the runner's host and return once it answers ``GET /list_workers``.

    It runs the router job's own start procedure, ``start_router.sh`` (``script.py``), under a small
    wrapper that leads its process group and carries the identity token: the script picks the ports, starts the
    router, retries a lost bind race, removes a seeded policy's start-up worker and writes ``router.json``.
    ``bind``: the address it listens on (its Prometheus endpoint too); ``advertise``: the address clients use
    (default: ``bind``, or for a wildcard bind 127.0.0.1 here / the host's name over SSH). ``run_dir/router.json``
    ends up with the token (0600); the router's output goes to ``run_dir/router.log``.
    ``isolate`` (the default): the router runs in a private network namespace behind ``router_front.py``, which
    holds ``bind``'s ports and passes on service traffic only; its admin API needs ``RouterInfo.admin_token``.
    False: the router itself binds ``bind``, and its admin API is open to whoever reaches that port.
    ``record`` hears the router before it is started (pid 0: :func:`stop_router` finds it by its token), once its
    pid is known (both before the wait: a caller interrupted meanwhile can stop what it recorded) and once it
    answers, with its ports.
    """
    _check_command(runner, command)
    runner.makedirs(run_dir, 0o700)
    _refuse_running(runner, run_dir)
    if isolate:
        _stage_front(runner, run_dir, command[0])
    token = secrets.token_hex(16)
    host = advertise or (bind if bind not in _WILDCARDS else _default_advertise(runner))
    script = render_start_script(ScriptSettings(
        run_dir=run_dir, command=command, policy=policy, bind=bind, isolate=isolate, advertise=host,
        worker_urls=worker_urls, extra_args=extra_args, start_wait_s=max(1, math.ceil(timeout)),
        about=f"a router started by pbstk on {_where(runner)}"))
    runner.write_bytes(f"{run_dir}/{ENTRY_SCRIPT}", script.encode(), 0o700)
    runner.write_bytes(f"{run_dir}/{TOKEN_FILE}", token.encode(), 0o600)
    info = RouterInfo(host=host, port=0, prometheus_port=0, pid=0, policy=policy, run_dir=run_dir,
                      transport=_transport(runner), token=token, admin_token=token if isolate else "")
    if record is not None:
        record(info)
    _launch(runner, run_dir, token)
    deadline = time.monotonic() + timeout + 10  # the script's own limit comes first: its words say more
    info.pid = _read_pid(runner, run_dir, deadline)
    if record is not None:
        record(info)
    started = _wait_started(runner, info, deadline)
    info.port, info.prometheus_port = int(started["port"]), int(started["prometheus_port"])
    runner.write_bytes(f"{run_dir}/{INFO_FILE}", json.dumps(info.to_dict(), indent=2).encode(), 0o600)
    if record is not None:
        record(info)
    return info


def _stage_front(runner: Runner, run_dir: str, router: str) -> None:
    """The front's sources into ``run_dir``, once a ``python3`` to run them is known to be there."""
    python = runner.run(["bash", "-c", _FRONT_PYTHON, "pbstk-python", router], timeout=30).stdout.strip()
    if not python:
        raise RouterError(f"python3 not found on {_where(runner)}: the router's front needs it "
                          "(or set router_isolation: none in the profile: the router's admin API is then open)")
    for source in FRONT_SOURCES:
        runner.write_bytes(f"{run_dir}/{source.name}", source.read_bytes(), 0o600)


def _launch(runner: Runner, run_dir: str, token: str) -> None:
    runner.run(["rm", "-f", "--", f"{run_dir}/router.pid", f"{run_dir}/{INFO_FILE}"], timeout=30)
    result = runner.run(["setsid", "-f", "bash", "-c", _LAUNCH, "pbstk-router", run_dir,
                         "bash", f"{run_dir}/{ENTRY_SCRIPT}"], env={TOKEN_ENV: token}, timeout=30)
    if not result.ok:
        raise RouterError(f"could not start the router on {_where(runner)}: {result.stderr.strip() or result.rc}")


def _wait_started(runner: Runner, info: RouterInfo, deadline: float) -> dict[str, Any]:
    """What the script wrote into ``router.json`` once its router answered; raises with the script's own words
    when it gave up (no command, no port, the router exited or hung), or when it did not get there in time."""
    delay = 0.05
    while True:
        started = read_started(runner, info.run_dir)
        if started is not None and str(started.get("port", "")).isdigit():
            return started
        if not router_alive(runner, info):
            words = _script_error(runner, info.run_dir) or "the router's start script ended"
            raise RouterError(f"the router did not start on {_where(runner)}: {words}",
                              details=_log_tail(runner, info.run_dir))
        if time.monotonic() > deadline:
            stop_router(runner, info, timeout=2)
            raise RouterError(f"the router on {_where(runner)} did not answer within the time allowed "
                              f"(log: {info.run_dir}/{LOG_FILE})", details=_log_tail(runner, info.run_dir))
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def _script_error(runner: Runner, run_dir: str) -> str:
    """The last ``pbstk-router: error: ...`` line the start script logged, without its prefix ("": none)."""
    for line in reversed(_log_tail(runner, run_dir, lines=40)):
        _, found, words = line.partition(" pbstk-router: error: ")
        if found:
            return words
    return ""


def load_info(runner: Runner, run_dir: str) -> RouterInfo | None:
    """The router recorded in ``run_dir/router.json``, or None when there is none."""
    try:
        data = runner.read_bytes(f"{run_dir}/{INFO_FILE}")
    except FileNotFoundError:
        return None
    try:
        return RouterInfo.from_dict(json.loads(data))
    except ValueError as exc:
        raise RouterError(f"{run_dir}/{INFO_FILE} is not a router record: {exc}") from exc


def _refuse_running(runner: Runner, run_dir: str) -> None:
    """One run directory, one router: a second start would overwrite the record of a router still running."""
    try:
        info = load_info(runner, run_dir)
    except RouterError:
        return  # an unreadable record proves nothing runs: the new start rewrites it
    if info is not None and router_alive(runner, info):
        raise RouterError(f"a router is already running from {run_dir} on {_where(runner)} (pid {info.pid}, "
                          f"{info.url}): stop it first")


def _default_advertise(runner: Runner) -> str:
    if runner.name == "local":
        return "127.0.0.1"
    result = runner.run(["hostname", "-f"], timeout=30)
    name = result.stdout.strip()
    return name if result.ok and name else _transport(runner)


def router_alive(runner: Runner, info: RouterInfo) -> bool:
    """Whether the router's pid is alive and still carries its token (a recycled pid is not the router)."""
    if info.pid <= 0 or not info.token:
        return False
    return runner.run(["bash", "-c", _ALIVE, "pbstk-router-alive", str(info.pid), info.token], timeout=30).ok


def _leader(runner: Runner, token: str) -> int:
    """The pid of the router's process-group leader, found by its token (0: none runs)."""
    found = runner.run(["bash", "-c", _LEADER, "pbstk-router-find", token], timeout=30).stdout.strip()
    return int(found) if found.isdigit() else 0


def stop_router(runner: Runner, info: RouterInfo, timeout: float = 10.0) -> bool:
    """Stop the router (TERM, then KILL after ``timeout`` s). False when it was already gone (or the pid is no
    longer the router's: then nothing is signalled). A router recorded before its pid was known (pid 0) is found
    by its token."""
    if not info.token:
        return False
    pid = info.pid if info.pid > 0 else _leader(runner, info.token)
    if pid <= 0:
        return False
    seconds = max(1, int(round(timeout)))
    result = runner.run(["bash", "-c", _STOP, "pbstk-router-stop", str(pid), info.token, str(seconds)],
                        timeout=seconds + 30)
    if result.rc == 0:
        return True
    if result.rc == 2:
        return False
    raise RouterError(f"could not stop the router (pid {info.pid}) on {_where(runner)}: "
                      f"{result.stderr.strip() or result.rc}")


