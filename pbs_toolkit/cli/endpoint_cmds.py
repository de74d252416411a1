"""``pbstk update-endpoint``, ``env``, ``tunnel``."""

from __future__ import annotations

import shlex
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_job
from pbs_toolkit.cli.lazy import LazyChoice, registry_formats
from pbs_toolkit.cli.options import LOCAL_PORT, SECONDS, SECONDS_OR_ZERO, echo_json
from pbs_toolkit.cli.progress import interrupt_hint, progress_printer


@click.command("update-endpoint")
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--registry", type=click.Path(),  # a directory, device or FIFO is refused by the registry (exit 8)
              help="Registry file (default: pbstk's own endpoints.yaml in the XDG data dir).")
@click.option("--format", "fmt", type=LazyChoice(registry_formats), default="auto",
              show_default=True, help="py = verifiers endpoints.py, toml = verifiers endpoints.toml.")
@click.option("--force-format", is_flag=True, help="Allow a --format that disagrees with the file's suffix.")
@click.option("--follow-symlink", is_flag=True,
              help="Edit the regular file a symlinked registry points to, even outside the registry's directory.")
@click.option("--alias", help="Entry name (default: the job's --name).")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--via-tunnel", is_flag=True,
              help="Register a local tunnel's URL and keep the tunnel open; the entry goes when the tunnel closes.")
@click.option("--local-port", type=LOCAL_PORT, default=0, help="Local port for --via-tunnel (default: any free one).")
@click.option("--keep-after-end", is_flag=True,
              help="Leave the entry in the registry when the job ends or is cancelled (default: removed then).")
@click.option("--remove", is_flag=True,
              help="Remove the entry named JOB (an alias), or every entry job JOB wrote, instead of adding one.")
@click.option("--json", "as_json", is_flag=True)
def update_endpoint(job: str | None, registry: str | None, fmt: str, force_format: bool, follow_symlink: bool,
                    alias: str | None, timeout: float, via_tunnel: bool, local_port: int, keep_after_end: bool,
                    remove: bool, as_json: bool) -> None:
    """Wait until JOB (default: the newest) is ready, then write its endpoint into a registry.

    The entry is removed again when the job ends or is cancelled (unless --keep-after-end).
    With --remove: take out the entry whose alias is JOB, or every entry job JOB wrote
    (absent: a note, exit 0).
    """
    from pbs_toolkit.client import Client

    if remove:  # `--remove --alias NAME` reads as well as `--remove NAME`
        _remove(alias or job, registry, fmt, force_format, follow_symlink, as_json)
        return
    with Client() as c:  # one connection (one MFA prompt) waits, forwards and registers
        svc = c.service(job)
        if svc is not None and svc.models and not alias:  # one entry per model (docs/multi-model.md)
            _model_entries(c, svc, registry, fmt, follow_symlink, force_format, keep_after_end, via_tunnel, as_json)
            return
        if svc is not None:  # a service: the router's URL and the service's key (docs/services.md)
            result = c.update_service_endpoint(svc, registry, fmt=fmt, alias=alias, follow_symlink=follow_symlink,
                                               force_format=force_format, keep_after_end=keep_after_end,
                                               via_tunnel=via_tunnel, local_port=local_port)
            _finish(c, result, svc.name, as_json, via_tunnel)
            return
        record = c.record(job)
        resume = shlex.join(["pbstk", "update-endpoint", record.job_id,  # the same registration, picked up again
                             *(["--registry", registry] if registry else []), *(["--alias", alias] if alias else []),
                             *(["--format", fmt] if fmt != "auto" else []),
                             *(["--keep-after-end"] if keep_after_end else []),
                             *(["--via-tunnel"] if via_tunnel else [])])
        with interrupt_hint(record.job_id, resume), progress_printer(as_json) as show:
            result = c.update_endpoint(record, registry, fmt=fmt, alias=alias, timeout=timeout,
                                       follow_symlink=follow_symlink, force_format=force_format,
                                       via_tunnel=via_tunnel, local_port=local_port, on_progress=show,
                                       keep_after_end=keep_after_end)
        _finish(c, result, record.job_id, as_json, via_tunnel)


def _model_entries(c: Any, svc: Any, registry: str | None, fmt: str, follow_symlink: bool, force_format: bool,
                   keep_after_end: bool, via_tunnel: bool, as_json: bool) -> None:
    """A multi-model service's entries, one per model (``--json``: a list of them)."""
    from pbs_toolkit.errors import UsageError

    if via_tunnel:
        raise UsageError("--via-tunnel with a multi-model service is planned, not running yet: register it "
                         "without, or one model with --alias NAME")
    results = c.update_model_endpoints(svc, registry, fmt=fmt, follow_symlink=follow_symlink,
                                       force_format=force_format, keep_after_end=keep_after_end)
    if as_json:
        echo_json([r.to_dict() for r in results])
        return
    for k, each in enumerate(results, 1):
        _show_update(each, svc.name, as_json, hint=k == len(results))  # one key for all: said once


def _finish(c: Any, result: Any, ref: str, as_json: bool, via_tunnel: bool) -> None:
    """Show the entry; with ``--via-tunnel`` keep the tunnel open until Ctrl-C or SIGTERM, which close it and take
    the entry back (``Client.update_endpoint``)."""
    tunnel = c.tunnels[-1] if via_tunnel else None
    _show_update(result, ref, as_json, tunnel.url if tunnel else None)
    if tunnel is not None:
        click.echo(f"tunnel open on {tunnel.url}; Ctrl-C (or SIGTERM) closes it and removes the entry", err=True)
        tunnel.serve_forever()


def _show_update(result: Any, ref: str, as_json: bool, local_url: str | None = None, hint: bool = True) -> None:
    if as_json:
        echo_json(result.to_dict())
        return
    click.echo(f"{result.registry}: {result.alias} -> {result.url} (model {result.model}, "
               f"key in ${result.key_env or '-'})")
    if result.key_env and hint:  # the tunnel's URL too: the node's is the one this machine cannot reach
        env = shlex.join(["pbstk", "env", ref, *(["--local-url", local_url] if local_url else [])])
        click.echo(f"set the key with: eval \"$({env})\"")


def _remove(ref: str | None, registry: str | None, fmt: str, force_format: bool, follow_symlink: bool,
            as_json: bool) -> None:
    """``update-endpoint --remove REF``: one line per entry on stdout; a failed removal is exit 8."""
    from pbs_toolkit.client import Client
    from pbs_toolkit.endpoints.retire import ABSENT, FAILED, REMOVED
    from pbs_toolkit.errors import RegistryError, UsageError

    if not ref:
        raise UsageError("update-endpoint --remove needs the ALIAS (or JOB) to remove")
    with Client() as c:
        removals = c.remove_endpoints(ref, registry, fmt=fmt, follow_symlink=follow_symlink,
                                      force_format=force_format)
    if as_json:
        echo_json([r.to_dict() for r in removals])
    for r in [] if as_json else removals:
        if r.outcome == REMOVED:
            click.echo(f"{r.registry}: removed {r.alias} -> {r.url}")
        elif r.outcome == ABSENT:
            click.echo(f"pbstk: note: no entry {r.alias!r} in {r.registry}; nothing removed", err=True)
        elif r.outcome != FAILED:
            click.echo(r.message(), err=True)
    failed = [r for r in removals if r.outcome == FAILED]
    if failed:
        raise RegistryError(f"could not remove {failed[0].alias!r} from {failed[0].registry}: {failed[0].detail}")


@click.command("env")
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--local-url", help="Use this base URL (e.g. a tunnel's) instead of the node's.")
@click.option("--timeout", type=SECONDS_OR_ZERO, default=0.0,
              help="Wait up to this many seconds for readiness (0: no wait).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the endpoint object, with the key and the variables (it is a secret: keep it so).")
def env_cmd(job: str | None, local_url: str | None, timeout: float, as_json: bool) -> None:
    """Print `export` lines (OPENAI_BASE_URL, OPENAI_API_KEY, the registry's key variable) for JOB.

    \b
      eval "$(pbstk env)"
    """
    from pbs_toolkit.client import Client

    with Client() as c:
        svc = c.service(job)
        if svc is not None:  # a service: the router's URL and the service's key
            ep = c.service_endpoint(svc, local_url)
        else:
            ep = c.endpoint(job, local_url, timeout=timeout, on_progress=progress_printer(True),
                            hint="use --timeout S to wait, or `pbstk wait`")
    if as_json:
        echo_json(ep.to_dict(secrets=True))
        return
    for line in ep.exports():
        click.echo(line)


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--local-port", type=LOCAL_PORT, default=0, help="Local port (default: any free one).")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--json", "as_json", is_flag=True, help="Once the tunnel is open, print its tunnel object as one line.")
def tunnel(job: str | None, local_port: int, timeout: float, as_json: bool) -> None:
    """Forward a local port to JOB's server through the SSH connection; runs until Ctrl-C."""
    from pbs_toolkit.client import Client

    with Client() as c:  # the same connection waits and forwards; closing the client closes the tunnel
        with progress_printer(as_json) as show:
            st, t = c.tunnel(job, local_port, timeout=timeout, on_progress=show)
        if as_json:
            echo_json(t.to_dict(st), line=True)
        else:
            click.echo(f"{t.url}/v1 -> {st.url} (model {st.record.served_model_name}); Ctrl-C to stop")
            click.echo(f"clients: eval \"$(pbstk env {st.record.job_id} --local-url {t.url})\"")
        t.serve_forever()


COMMANDS = [update_endpoint, env_cmd, tunnel]
