"""Options shared by several commands (render/launch/tune) and small output helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from pbs_toolkit.errors import UsageError
from pbs_toolkit.textutil import table

__all__ = ["build_request", "echo_json", "parse_port", "render_options", "table"]

F = Callable[..., Any]


def render_options(f: F) -> F:
    """Options that become a ``RenderRequest``."""
    options = [
        click.option("--preset", "-p", help="Preset name or YAML file (default: auto; cpu on GPU-less profiles)."),
        click.option("--profile", "-P", help="Site profile name or YAML file (default: local)."),
        click.option("--name", help="Job name and endpoint alias (default: a slug of the model)."),
        click.option("--served-model-name", help="Model name clients send (default: the model id or --name)."),
        click.option("--queue", "-q"),
        click.option("--account", "-A"),
        click.option("--walltime", "-t", help="HH:MM:SS"),
        click.option("--nodes", type=int),
        click.option("--gpus-per-node", type=int),
        click.option("--port", help="Port on the node: a number (must be free) or 'auto' (first free from it)."),
        click.option("--venv", help="Python environment with vLLM on the compute node (activated in the job)."),
        click.option("--runs-root", help="Where run directories go (shared filesystem)."),
        click.option("--vllm-version", help="vLLM version on the cluster; decides which flags are valid."),
        click.option("--eager/--no-eager", default=None, help="Override the preset's eager mode."),
        click.option("--vllm-arg", "vllm_args", multiple=True,
                     help="Extra vLLM argument, passed through exactly (repeat; use --vllm-arg=--flag=value)."),
        click.option("--env", "env", multiple=True, help="K=V exported in the job (repeat)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


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
    from pbs_toolkit.render import RenderRequest

    env: dict[str, str] = {}
    for item in kw.pop("env", ()) or ():
        if "=" not in item:
            raise UsageError(f"--env {item!r} is not K=V")
        key, value = item.split("=", 1)
        env[key] = value
    kw["port"] = parse_port(kw.get("port"))
    kw["vllm_args"] = list(kw.get("vllm_args") or ())
    return RenderRequest(model=model, env=env, **kw)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
