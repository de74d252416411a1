"""``pbstk presets``, ``pbstk profiles``, ``pbstk render``."""

from __future__ import annotations

import os
import shlex
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_preset
from pbs_toolkit.cli.options import GPUS_PER_NODE, NODES, build_request, echo_json, render_options, table


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def presets(ctx: click.Context, as_json: bool) -> None:
    """List presets (shipped and ~/.config/pbstk/presets/*.yaml)."""
    if ctx.invoked_subcommand:
        return
    from pbs_toolkit.settings.presets import list_presets

    items = list_presets()
    if as_json:
        echo_json([p.to_dict() for p in items])
        return
    rows = [[p.name, "auto" if p.auto else p.layout(), "-" if p.auto else str(p.gpus),
             "eager" if p.eager else "graphs", p.summary] for p in items]
    click.echo(table(rows, ["NAME", "LAYOUT", "GPUS", "MODE", "SUMMARY"]))


@presets.command("show")
@click.argument("name", shell_complete=complete_preset)
@click.option("--json", "as_json", is_flag=True, help="Print the preset object.")
@click.option("--model", "-m", help="Resolve the layout for this model (auto: sized from its parameters, dtype and "
                                    "the profile's gpu_memory_gb) and show the nodes it spans.")
@click.option("--profile", "-P", help="Profile the layout is resolved for (with --model).")
@click.option("--nodes", type=NODES, help="Nodes asked for (with --model).")
@click.option("--gpus-per-node", type=GPUS_PER_NODE, help="GPUs per node (with --model).")
@click.option("--vllm-version", help="vLLM version the layout must run on (with --model).")
def presets_show(name: str, as_json: bool, model: str | None, **settings: Any) -> None:
    """Show a preset: layout, the flags it renders, and why; with --model, the layout chosen for that model
    on the profile's nodes (``presets show auto --model M --profile polaris`` explains auto's numbers)."""
    import textwrap

    from pbs_toolkit.settings.presets import load_preset

    p = load_preset(name)
    if model is not None:
        _show_plan(name, model, settings, as_json)
        return
    if as_json:
        echo_json(p.to_dict())
        return
    click.echo(f"{p.name}: {p.summary}")
    click.echo(f"  layout:  {'chosen from model size and GPUs' if p.auto else p.layout()}"
               f"{'' if p.auto else f' ({p.gpus} GPUs)' if p.device == 'gpu' else ''}")
    mode = "eager (--enforce-eager)" if p.eager else "CUDA graphs (eager fallback if capture fails)"
    click.echo(f"  mode:    {mode}")
    flags = p.flag_args()
    click.echo(f"  flags:   {' '.join(flags) if flags else '(none)'}")
    if p.env:
        click.echo(f"  env:     {' '.join(f'{k}={v}' for k, v in p.env.items())}")
    click.echo(f"  source:  {p.source}")
    click.echo("")
    click.echo(textwrap.fill(p.rationale, width=100))


def _show_plan(name: str, model: str, flags: dict[str, Any], as_json: bool) -> None:
    """``presets show NAME --model M``: the concrete layout, its nodes and engine, and (auto) why."""
    from pbs_toolkit.client import Client

    preset, plan, params = Client().plan_layout(model, name, **flags)
    if as_json:
        echo_json({**preset.to_dict(), "model": model, "params_b": params, "plan": plan.to_dict()})
        return
    nodes = f"{plan.nnodes} node(s), engine {plan.engine}" + (f", launcher {plan.launcher}" if plan.nnodes > 1 else "")
    click.echo(f"{preset.name}: {preset.layout()} = {preset.gpus} GPU(s) on {nodes}")
    click.echo(f"  model:   {model} ({f'{params:.1f}B parameters' if params is not None else 'size unknown'})")
    click.echo(f"  why:     {preset.summary}")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def profiles(ctx: click.Context, as_json: bool) -> None:
    """List site profiles (shipped and ~/.config/pbstk/profiles/*.yaml)."""
    if ctx.invoked_subcommand:
        return
    from pbs_toolkit.settings.profiles import list_profiles

    items = list_profiles()
    if as_json:
        echo_json([p.to_dict() for p in items])
        return
    rows = [[p.name, p.scheduler, p.queue or "-", str(p.gpus_per_node), p.ssh_host or "-", p.description]
            for p in items]
    click.echo(table(rows, ["NAME", "SCHEDULER", "QUEUE", "GPUS/NODE", "SSH HOST", "DESCRIPTION"]))


def setting_options(f: Any) -> Any:
    """The flags that set profile keys (as on render/launch), for ``config show``."""
    from pbs_toolkit.cli.options import parse_port

    options = [
        click.option("--queue", "-q"), click.option("--account", "-A"), click.option("--walltime", "-t"),
        click.option("--nodes", type=NODES), click.option("--gpus-per-node", type=GPUS_PER_NODE),
        click.option("--port", callback=lambda c, p, v: parse_port(v) if v != "auto" else None),
        click.option("--venv"), click.option("--runs-root"), click.option("--vllm-version"),
        click.option("--hf-home"), click.option("--vllm-cache-root"),
        click.option("--scheduler"), click.option("--ssh", "ssh_host"),
        click.option("--text-only/--no-text-only", default=None),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@profiles.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: every key's value and source.")
@setting_options
def profiles_show(name: str, as_json: bool, **flags: Any) -> None:
    """Show profile NAME as a launch would use it: every key, its value and where it came from."""
    _show_resolved({"profile": name, **flags}, as_json, profile_source="argument NAME")


@click.group("config")
def config() -> None:
    """Your settings (flags, PBSTK_*, ~/.config/pbstk/config.yaml, profile) as pbstk resolves them."""


@config.command("show")
@click.option("--profile", "-P", help="Profile to resolve (default: PBSTK_PROFILE, config.yaml's profile, local).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: every key's value and source.")
@setting_options
def config_show(profile: str | None, as_json: bool, **flags: Any) -> None:
    """Print every resolved setting and where it came from (package default / profile NAME /
    config.yaml (global|profiles.NAME) / PBSTK_X / flag)."""
    _show_resolved({"profile": profile, **flags}, as_json)


def _show_resolved(flags: dict[str, Any], as_json: bool, profile_source: str | None = None) -> None:
    from dataclasses import replace

    from pbs_toolkit.settings.launch_settings import RenderRequest, resolve_launch_settings

    resolved = resolve_launch_settings(RenderRequest(model="", **flags))  # no model: no default_presets entry
    if profile_source:
        resolved = replace(resolved, profile_source=profile_source)
    if as_json:
        echo_json(resolved.to_dict())
        return
    problems = resolved.problems()
    click.echo(f"profile: {resolved.profile.name}  ({resolved.profile_source}; "
               f"file {resolved.profile.source.split(' with ', 1)[0]})")
    click.echo(f"preset:  {resolved.preset_name}  ({resolved.preset_source})")
    rows = []
    for key, (value, source, template) in resolved.values().items():
        shown = _shown(value)
        rows.append([key, shown, source + (f" (written {_shown(template)})" if template is not None else "")])
    click.echo(table(rows, ["KEY", "VALUE", "SOURCE"]))
    for problem in problems:
        click.echo(f"pbstk: warning: a launch would be refused: {problem}", err=True)


def _shown(value: Any) -> str:
    """One line for a setting's value: lists joined with `` ; ``, mappings as ``K=V``, unset as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ; ".join(value) if value else "(none)"
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) if value else "(none)"
    return str(value)


@click.command()
@click.argument("model")
@render_options
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="Write the job script, start_vllm.sh, the job's API key (DIR/api_key, 0600) and its record "
                   "(DIR/pbstk-job.json) into this directory, which becomes the run directory: submit DIR's job "
                   "script by hand, then `pbstk adopt JOBID DIR`.")
@click.option("--run-dir", help="Run directory the scripts refer to (default: -o DIR, else a new one under "
                                "runs_root).")
@click.option("--api-key-env", help="With -o: take the server's API key from this environment variable.")
@click.option("--no-api-key", is_flag=True, help="With -o: serve without an API key (anyone on the network can "
                                                 "use it).")
@click.option("--json", "as_json", is_flag=True, help="Print the render object (with -o: without the scripts).")
def render(model: str, out_dir: str | None, run_dir: str | None, api_key_env: str | None, no_api_key: bool,
           as_json: bool, **kw: Any) -> None:
    """Render the job script and start_vllm.sh for MODEL (nothing is submitted, nothing is connected to)."""
    from pbs_toolkit.cli.options import read_key_env
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError
    from pbs_toolkit.jobs.handmade import write_render_dir

    if out_dir is not None and run_dir is None:
        run_dir = os.path.abspath(out_dir)  # the scripts run from where they are written
    req = build_request(model, run_dir=run_dir, **kw)
    key = read_key_env(api_key_env, os.environ)
    job = Client().render(req, connect=False)  # nothing is submitted: no SSH login
    for note in job.notes:
        click.echo(f"pbstk: note: {note}", err=True)
    if out_dir is None and as_json:
        echo_json(job.to_dict())
        return
    if out_dir is None:
        spread = f"{job.preset.name}: {layout_text(job)}; " if job.plan and job.plan.nnodes > 1 else ""
        click.echo(f"# ===== {job.script_name} ({spread}run directory {job.run_dir}) =====")
        click.echo(job.job_script, nl=False)
        click.echo("# ===== start_vllm.sh =====")
        click.echo(job.start_script, nl=False)
        return
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir} exists and is not a directory")
    try:
        written = write_render_dir(out_dir, job, req, use_api_key=not no_api_key, api_key=key)
    except OSError as exc:
        raise UsageError(f"cannot write the scripts into {out_dir}: {exc.strerror or exc}") from None
    if as_json:
        echo_json({**job.to_dict(scripts=False), "written": written})
        return
    click.echo(f"wrote {out_dir}/{job.script_name} and {out_dir}/start_vllm.sh (preset {job.preset.name}, "
               f"{layout_text(job)})")
    if not no_api_key:
        click.echo(f"API key: {out_dir}/api_key (0600; the server requires it); for clients: "
                   f"export PBSTK_API_KEY=\"$(cat {shlex.quote(os.path.join(out_dir, 'api_key'))})\"")
    click.echo(f"after submitting {out_dir}/{job.script_name} by hand: pbstk adopt JOBID {shlex.quote(out_dir)} "
               "(then status, wait, update-endpoint ... work on it)")


def layout_text(job: Any) -> str:
    """``DP4``, or ``DP4 on 2 nodes x 2 GPUs`` when the layout spans nodes: the first line says so."""
    return job.preset.layout() + (job.plan.spread() if job.plan else "")


@click.command()
@click.argument("job_id")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--ssh", "ssh_host", help="Read RUN_DIR on this login node (the job's transport from then on).")
@click.option("--json", "as_json", is_flag=True, help="Print the job object.")
def adopt(job_id: str, run_dir: str, ssh_host: str | None, as_json: bool) -> None:
    """Record JOB_ID, a job submitted by hand from RUN_DIR (written by `pbstk render -o RUN_DIR`), so that
    status, wait, logs, update-endpoint and cancel work on it; its API key is read from RUN_DIR/api_key."""
    from pbs_toolkit.client import Client

    with Client() as c:
        record = c.adopt(job_id, run_dir, ssh_host)
    if as_json:
        echo_json(record.to_dict())
        return
    click.echo(f"adopted {record.job_id} ({record.name}, {record.model}) from {record.run_dir}; "
               f"`pbstk wait {record.job_id}` waits for it")


COMMANDS = [presets, profiles, config, render, adopt]
