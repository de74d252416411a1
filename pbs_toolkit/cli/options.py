"""Options shared by several commands (render/launch/tune) and small output helpers."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_preset, complete_profile
from pbs_toolkit.cli.output import table
from pbs_toolkit.errors import UsageError

__all__ = [
    "GPUS_PER_NODE", "LOCAL_PORT", "NODES", "SECONDS", "SECONDS_OR_ZERO", "BoundedInt", "Seconds",
    "build_request", "check_display_name", "check_writable_file", "echo_json", "parse_port", "read_key_env",
    "render_options", "scale_options", "scale_spec", "table", "writable_file",
]

F = Callable[..., Any]

#: bounds for counts a job script requests; far above any real node, far below what overflows a scheduler
MAX_NODES = 10000
MAX_GPUS_PER_NODE = 64


#: timeouts and intervals (``--timeout``, ``--interval``, ``--watch``) may be fractions of a second, down to this
TIMEOUT_MIN_S = 0.001


class Seconds(click.ParamType):
    """A timeout or interval in the one duration grammar (durations.py: ``45``, ``0.5``, ``90s``, ``1h30m``): > 0
    (``allow_zero``: or 0), at most a year. ``nan`` would wait forever, ``-1`` never.

    Errors are our ``UsageError`` so the CLI prints its one ``pbstk: error:`` line, not click's usage block.
    """

    name = "seconds"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        from pbs_toolkit.durations import parse

        # the one duration grammar (plain seconds, or 90s, 5m, 1h30m); fractions of a second are fine here
        return parse(value, _flag(param), zero=self.allow_zero, minimum=TIMEOUT_MIN_S)


class BoundedInt(click.ParamType):
    """An integer in ``[low, high]``, refused with one ``pbstk: error:`` line (``1e20`` and ``70000`` included)."""

    name = "integer"

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        flag = _flag(param)
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not text.lstrip("+-").isdigit() or len(text) > 20:
                raise UsageError(f"{flag} {value!r} is not an integer between {self.low} and {self.high}")
            number = int(text)
        if not self.low <= number <= self.high:
            raise UsageError(f"{flag} {number} is out of range: must be between {self.low} and {self.high}")
        return number


class Count(click.ParamType):
    """A whole number for ``--replicas``: text that is not one is refused without advertising bounds nobody means
    (the library refuses counts below 1 and above its own limit, in its own words)."""

    name = "integer"

    def __init__(self, what: str) -> None:
        self.what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        if not text.lstrip("+-").isdigit() or len(text) > 20:
            raise UsageError(f"{_flag(param)} {value!r} is not a whole number of {self.what}")
        return int(text)


def _flag(param: click.Parameter | None) -> str:
    """``--timeout`` for an option (its longest name), ``value`` without one."""
    if param is None:
        return "value"
    names = [n for n in getattr(param, "opts", []) if n.startswith("--")] or [param.name or "value"]
    return max(names, key=len)


SECONDS = Seconds()
SECONDS_OR_ZERO = Seconds(allow_zero=True)
NODES = BoundedInt(1, MAX_NODES)
GPUS_PER_NODE = BoundedInt(0, MAX_GPUS_PER_NODE)
LOCAL_PORT = BoundedInt(0, 65535)  # 0: any free port


def render_options(f: F) -> F:
    """Options that become a ``RenderRequest``."""
    options = [
        click.option("--preset", "-p", shell_complete=complete_preset,
                     help="Preset name or YAML file (default: auto; cpu on GPU-less profiles)."),
        click.option("--profile", "-P", shell_complete=complete_profile,
                     help="Site profile name or YAML file (default: local)."),
        click.option("--name", help="Job name and endpoint alias (default: a slug of the model)."),
        click.option("--served-model-name", help="Model name clients send (default: the model id or --name)."),
        click.option("--queue", "-q"),
        click.option("--account", "-A"),
        click.option("--walltime", "-t", help="HH:MM:SS"),
        click.option("--nodes", type=NODES),
        click.option("--gpus-per-node", type=GPUS_PER_NODE),
        click.option("--port", help="Port on the node: a number (must be free) or 'auto' (a free one above it)."),
        click.option("--venv", help="Python environment with vLLM on the compute node (activated in the job)."),
        click.option("--runs-root", help="Where run directories go (shared filesystem)."),
        click.option("--vllm-version", help="vLLM version on the cluster; decides which flags are valid."),
        click.option("--hf-home", help="HF_HOME on the compute node (model cache); overrides the profile."),
        click.option("--vllm-cache-root", help="VLLM_CACHE_ROOT on the compute node (compile cache)."),
        click.option("--eager/--no-eager", default=None, help="Override the preset's eager mode."),
        click.option("--text-only/--no-text-only", default=None,
                     help="A vision-language model serves text only: vLLM gets no image or video budget (more KV "
                          "cache, no vision profiling at start). Refused for a text-only model (docs/settings.md)."),
        click.option("--vllm-arg", "vllm_args", multiple=True,
                     help="Extra vLLM argument (repeat; use --vllm-arg=--flag=value); it replaces the "
                          "preset's value of that flag."),
        click.option("--env", "env", multiple=True, help="K=V exported in the job (repeat)."),
        click.option("--idle-cancel", callback=_idle_duration, metavar="DURATION",
                     help="Stop the server after this long without a request (30m, 1h30m; off). Default: the "
                          "profile's idle_cancel (off). On serve: ends the whole service (docs/idle.md; "
                          "durations: docs/settings.md#durations)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _idle_duration(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--idle-cancel``: checked now (one error line), passed on as written (``off`` switches a default off)."""
    from pbs_toolkit.durations import parse

    if value is not None:
        parse(value, "--idle-cancel", off=True)
    return value


#: ``launch``, ``serve`` and ``run``: stage the weights first (weights/preflight.py)
STAGE_OPTION = click.option(
    "--stage", "stage_weights", is_flag=True,
    help="Offline profile: download and verify the model's weights first if they are not staged.")


def scale_options(f: F) -> F:
    """Autoscaling options of a service (``serve``; services/keeper/autoscale.py); ``scale_spec`` makes them one."""
    options = [
        click.option("--min-replicas", type=BoundedInt(1, 1000), help="Autoscale: never fewer replicas (start here)."),
        click.option("--max-replicas", type=BoundedInt(1, 1000), help="Autoscale: never more replicas."),
        click.option("--scale-up-waiting", type=BoundedInt(0, 1_000_000), metavar="W",
                     help="Autoscale: add a replica when more than W requests wait for two ticks (default 1)."),
        click.option("--scale-down-idle", metavar="DURATION", help="Autoscale: remove one (drained first) after "
                     "DURATION (90s, 5m, 1h30m) with no request waiting and spare capacity (default 5m)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def scale_spec(replicas: int | None, min_replicas: int | None, max_replicas: int | None, up_waiting: float | None,
               down_idle: str | None) -> Any:
    """The ``ScaleSpec`` the autoscaling options ask for, or ``None`` (a fixed ``--replicas``)."""
    from pbs_toolkit.durations import parse
    from pbs_toolkit.services.keeper.autoscale import DEFAULT_DOWN_IDLE_S, DEFAULT_UP_WAITING, ScaleSpec

    if min_replicas is None and max_replicas is None:
        if up_waiting is not None or down_idle is not None:
            raise UsageError("--scale-up-waiting and --scale-down-idle need --max-replicas (autoscaling)")
        return None
    if replicas is not None:
        raise UsageError("--replicas N keeps a fixed N; to autoscale give --min-replicas/--max-replicas instead")
    if max_replicas is None:
        raise UsageError("--min-replicas needs --max-replicas (the most replicas autoscaling may start)")
    return ScaleSpec(min_replicas or 1, max_replicas, DEFAULT_UP_WAITING if up_waiting is None else up_waiting,
                     DEFAULT_DOWN_IDLE_S if down_idle is None else parse(down_idle, "--scale-down-idle"))


def parse_port(value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        port = int(value)
    except ValueError:
        raise UsageError(f"--port {value!r} is not a port number or 'auto'") from None
    if not 1 <= port <= 65535:
        raise UsageError(f"--port {port} is not between 1 and 65535")
    return port


def build_request(model: str, **kw: Any) -> Any:
    from pbs_toolkit.settings.launch_settings import RenderRequest

    env: dict[str, str] = {}
    for item in kw.pop("env", ()) or ():
        if "=" not in item:
            raise UsageError(f"--env {item!r} is not K=V")
        key, value = item.split("=", 1)
        env[key] = value
    kw["port"] = parse_port(kw.get("port"))
    kw["vllm_args"] = list(kw.get("vllm_args") or ())
    for flag, key in (("--name", "name"), ("--served-model-name", "served_model_name")):
        if kw.get(key) is not None:
            check_display_name(flag, kw[key])
    return RenderRequest(model=model, env=env, **kw)


def check_writable_file(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written, before a benchmark or a wait that may take an hour.

    An existing file must be a regular file we can append to (its content is not touched); a new one is
    probed by creating and removing a temporary file next to it (``/proc/x``, a missing or read-only directory,
    a full disk all fail here, also for root).
    """
    target = os.path.abspath(path)
    try:
        if os.path.lexists(target):
            if not stat.S_ISREG(os.stat(target).st_mode):
                raise UsageError(f"{flag} {path}: not a regular file")
            with open(target, "a", encoding="utf-8"):
                pass
        else:
            import tempfile  # here, not at the top: pbstk --help need not pay for it

            fd, probe = tempfile.mkstemp(prefix=".pbstk-probe-", dir=os.path.dirname(target))
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None


def writable_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback running :func:`check_writable_file` while the command line is parsed."""
    if value is not None:
        check_writable_file(_flag(param), value)
    return value


def check_display_name(flag: str, value: str) -> None:
    """Refuse a name the endpoint registry would refuse later (same character rule), before anything runs.

    The job name becomes the registry alias and the served name its model: catching a newline or an invisible
    character at launch beats a job that runs for an hour and then cannot be registered.
    """
    from pbs_toolkit.endpoints.entry import bad_character

    if not value.strip() or value != value.strip():
        raise UsageError(f"{flag} {value!r} must be non-empty, without leading or trailing whitespace")
    bad = bad_character(value)
    if bad is not None:
        raise UsageError(f"{flag} {value!r} contains the control character {bad}")


def read_key_env(name: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key from variable ``name`` of ``environ`` (``None``: none given), checked before anything is submitted.

    The key travels as an HTTP header (``Authorization: Bearer ...``): a newline or a character outside Latin-1
    cannot, so such a key would give a job that every later ``wait``/``update-endpoint`` crashes on.
    """
    if not name:
        return None
    value = environ.get(name)
    if not value:
        raise UsageError(f"--api-key-env {name!r}: that environment variable is empty or unset")
    if value != value.strip():
        raise UsageError(f"--api-key-env {name}: the key has leading or trailing whitespace")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        raise UsageError(f"--api-key-env {name}: the key holds characters that cannot be sent in an HTTP header "
                         "(only Latin-1 text is allowed)") from None
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UsageError(f"--api-key-env {name}: the key holds a control character (newline, tab, ...)")
    if value.startswith("-"):
        raise UsageError(f"--api-key-env {name}: the key starts with '-', which vLLM reads as an option "
                         "(`--api-key -...`) and refuses to start")
    return value


def echo_json(data: Any, *, line: bool = False) -> None:
    """Print one ``--json`` result: an object, or a list of objects for a list command (docs/json.md).

    Objects come from the library's ``to_dict`` methods, already stamped; a dictionary without
    ``schema_version`` (a command that has not got its own object yet) is given one, so every object printed
    carries it. ``line``: one compact line (streams: ``metrics --watch``, ``tunnel``), flushed at once.
    """
    import json

    from pbs_toolkit.schema import SCHEMA_VERSION

    def stamped(item: Any) -> Any:
        if isinstance(item, dict) and "schema_version" not in item:
            return {"schema_version": SCHEMA_VERSION, **item}
        return item

    data = [stamped(item) for item in data] if isinstance(data, list) else stamped(data)
    click.echo(json.dumps(data, default=str) if line else json.dumps(data, indent=2, default=str))
