"""``pbstk presets``, ``pbstk profiles``, ``pbstk render``."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_preset
from pbs_toolkit.cli.options import build_request, echo_json, render_options, table


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
def presets_show(name: str, as_json: bool) -> None:
    """Show a preset: layout, the flags it renders, and why."""
    import textwrap

    from pbs_toolkit.settings.presets import load_preset

    p = load_preset(name)
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


@click.command()
@click.option("--json", "as_json", is_flag=True)
def profiles(as_json: bool) -> None:
    """List site profiles (shipped and ~/.config/pbstk/profiles/*.yaml)."""
    from pbs_toolkit.settings.profiles import list_profiles

    items = list_profiles()
    if as_json:
        echo_json([p.to_dict() for p in items])
        return
    rows = [[p.name, p.scheduler, p.queue or "-", str(p.gpus_per_node), p.ssh_host or "-", p.description]
            for p in items]
    click.echo(table(rows, ["NAME", "SCHEDULER", "QUEUE", "GPUS/NODE", "SSH HOST", "DESCRIPTION"]))


@click.command()
@click.argument("model")
@render_options
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="Write the job script and start_vllm.sh into this directory instead of printing them.")
@click.option("--run-dir", help="Run directory the scripts refer to (default: a new one under runs_root).")
@click.option("--json", "as_json", is_flag=True, help="Print the render object (with -o: without the scripts).")
def render(model: str, out_dir: str | None, run_dir: str | None, as_json: bool, **kw: Any) -> None:
    """Render the job script and start_vllm.sh for MODEL (nothing is submitted)."""
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError

    req = build_request(model, run_dir=run_dir, **kw)
    job = Client().render(req, connect=False)  # nothing is submitted: no SSH login
    for note in job.notes:
        click.echo(f"pbstk: note: {note}", err=True)
    if out_dir is None and as_json:
        echo_json(job.to_dict())
        return
    if out_dir is None:
        click.echo(f"# ===== {job.script_name} (run directory {job.run_dir}) =====")
        click.echo(job.job_script, nl=False)
        click.echo("# ===== start_vllm.sh =====")
        click.echo(job.start_script, nl=False)
        return
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir} exists and is not a directory")
    try:
        _write_scripts(out_dir, {job.script_name: job.job_script, "start_vllm.sh": job.start_script})
    except OSError as exc:
        raise UsageError(f"cannot write the scripts into {out_dir}: {exc.strerror or exc}") from None
    if as_json:
        echo_json({**job.to_dict(scripts=False), "written": [os.path.join(out_dir, job.script_name),
                                                              os.path.join(out_dir, "start_vllm.sh")]})
        return
    click.echo(f"wrote {out_dir}/{job.script_name} and {out_dir}/start_vllm.sh (preset {job.preset.name}, "
               f"{job.preset.layout()})")


def _write_scripts(out_dir: str, scripts: dict[str, str]) -> None:
    """Write every script or none: each goes to a temporary name first, and all are renamed only once all
    are written (a full disk or a read-only directory must not leave one new script next to an old one)."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    temps: dict[str, str] = {}
    try:
        for name, text in scripts.items():
            temps[name] = tmp = os.path.join(out_dir, f".{name}.pbstk-tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.chmod(tmp, 0o755)
        for name, tmp in temps.items():
            os.replace(tmp, os.path.join(out_dir, name))
    except OSError:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        raise


COMMANDS = [presets, profiles, render]
