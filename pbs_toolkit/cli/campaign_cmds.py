"""``pbstk run`` (a server for as long as a command needs it) and ``pbstk usage`` (what jobs and services used).
The work is in campaigns/; docs/campaigns.md."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import click

from pbs_toolkit.cli.lazy import LazyChoice, backend_names, registry_formats
from pbs_toolkit.cli.options import (
    SECONDS,
    STAGE_OPTION,
    BoundedInt,
    Count,
    build_request,
    echo_json,
    read_key_env,
    render_options,
    scale_options,
    scale_spec,
    table,
)

_RUN_EPILOG = """\b
Exit status: COMMAND's own (128+N when signal N ended it); with --each the worst (largest) of the runs', 128+N
when signal N interrupted them. Before COMMAND runs, pbstk's own codes: 2 bad input
(COMMAND not found too), 3 scheduler, 4 SSH, 5 server failed, 6 timeout, 7 unknown --reuse name, 8 registry
(a bad --registry is refused before anything is launched), 11 weights not staged (--stage stages them first);
130 (Ctrl-C) or 143 (SIGTERM) when interrupted while waiting (what was launched is cancelled).
"""


class _RunCommand(click.Command):
    """Click drops ``--``; ``run`` keeps where it was: the words before it are MODELs, those after it COMMAND
    (``ctx.meta["pbstk_command"]``; without ``--``, the first word is MODEL and the rest COMMAND, as before)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            ctx.meta["pbstk_command"] = list(args[args.index("--") + 1:])
            args = args[:args.index("--")]
        return super().parse_args(ctx, args)


@click.command("run", cls=_RunCommand, epilog=_RUN_EPILOG, context_settings={"ignore_unknown_options": False})
@click.argument("words", nargs=-1, type=click.UNPROCESSED, metavar="MODEL [MODEL...] -- COMMAND [ARGS]...")
@click.option("--models", "models_file", metavar="FILE.yaml", help="The models, listed in a YAML file instead of "
              "MODEL arguments: one multi-model service (docs/multi-model.md).")
@click.option("--each", is_flag=True, help="Run COMMAND once per model, {model} and {alias} replaced in its "
              "arguments (PBSTK_MODEL, PBSTK_ALIAS in its environment); a summary table at the end.")
@click.option("--parallel", type=BoundedInt(1, 1000), metavar="N", help="With --each: up to N runs at once, "
              "each one's output in a log file (default: one after the other, on this terminal).")
@click.option("--max-awake", type=BoundedInt(1, 64), metavar="K", help="Several models: those that fit nowhere "
              "awake take turns on shared GPUs by vLLM's sleep mode, at most K awake (`serve --max-awake`).")
@click.option("--sleep-after", metavar="DURATION", help="With --max-awake: a swapping model idle this long sleeps "
              "(`serve --sleep-after`).")
@render_options
@click.option("--scheduler", type=LazyChoice(backend_names), help="Override the profile's scheduler.")
@click.option("--ssh", "ssh_host", help="Submit through this SSH host; COMMAND still runs here.")
@click.option("--accept-new-host-key", is_flag=True, help="Trust an SSH host key not yet in known_hosts.")
@click.option("--api-key-env", help="Take the server's API key from this environment variable.")
@click.option("--no-api-key", is_flag=True, help="Serve without an API key (anyone on the network can use it).")
@click.option("--replicas", "-n", type=Count("replicas"),
              help="More than 1: a service (`pbstk serve`) of that many replicas behind one router (default 1).")
@click.option("--nodes-per-replica", type=BoundedInt(1, 10000), help="With --replicas: nodes of each replica.")
@click.option("--policy", help="With --replicas: the router's policy (docs/services.md).")
@click.option("--keep-alive", is_flag=True, help="With --replicas or several models: a successor queued for every "
              "job across walltimes (`serve --keep-alive`, handover 10m before the end), for runs longer than one "
              "walltime.")
@scale_options
@click.option("--reuse", metavar="NAME",
              help="Use the job or service NAME (waited for until READY) instead of launching; it stays up.")
@click.option("--registry", type=click.Path(), help="Write the endpoint into this registry first; removed after.")
@click.option("--alias", help="With --registry: the entry's name (default: the job's or service's name).")
@click.option("--format", "fmt", type=LazyChoice(registry_formats), default="auto",
              show_default=True, help="With --registry: as `update-endpoint --format`.")
@click.option("--keep", is_flag=True, help="Leave the server up when COMMAND ends (default: drained, cancelled).")
@click.option("--lease", metavar="DURATION",
              help="The job (a service: its keeper ends it) ends itself once pbstk run has not renewed its lease "
                   "for this long (pbstk killed, its machine asleep, its SSH connection gone): 90s, 5m, off "
                   "(default 5m, PBSTK_RUN_LEASE).")
@click.option("--via-tunnel", is_flag=True,
              help="Reach the server through a tunnel over the SSH connection even when the node answers here "
                   "(default: only when it does not).")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait for READY.")
@STAGE_OPTION
def run_cmd(words: tuple[str, ...], models_file: str | None, each: bool, parallel: int | None,
            scheduler: str | None, ssh_host: str | None, accept_new_host_key: bool,
            api_key_env: str | None, no_api_key: bool, replicas: int | None, nodes_per_replica: int | None,
            policy: str | None, keep_alive: bool, reuse: str | None, registry: str | None, alias: str | None,
            fmt: str, keep: bool, lease: str | None, via_tunnel: bool, timeout: float, stage_weights: bool,
            **kw: Any) -> None:
    """Launch MODEL (or --reuse a READY job or service), wait until READY, run COMMAND against it, then drain
    and cancel the server; pbstk exits with COMMAND's exit status.

    \b
      pbstk run Qwen/Qwen3-1.7B --preset dp4 -- python eval.py
      pbstk run --reuse qwen --registry configs/endpoints.py -- vf-eval my-env -m qwen
      pbstk run Qwen/Qwen3-1.7B Qwen/Qwen3-4B --each --parallel 2 -- vf-eval my-env -m {model}

    Several MODELs (MODEL[:preset=P][:name=N] each, or --models FILE.yaml): one multi-model service (`pbstk
    serve M1 M2`), named run-YYYYmmdd-HHMMSS-PID unless --name; COMMAND gets PBSTK_MODELS, or with --each runs
    once per model (docs/campaigns.md "Several models").

    COMMAND gets OPENAI_BASE_URL, OPENAI_API_KEY (only in its environment), NO_PROXY and the rest of what
    `pbstk env` exports; its stdout and stderr are its own, pbstk's lines go to stderr. Ctrl-C and SIGTERM go to
    COMMAND first (killed 10 s later, PBSTK_RUN_GRACE_S), then the server is cancelled.
    """
    from pbs_toolkit.campaigns.run import RunHooks, RunPlan, check_plan, run
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError

    models, command = _split_words(words, click.get_current_context().meta.get("pbstk_command"),
                                   bool(reuse or models_file), each)
    launching = any(v not in (None, (), False) for v in kw.values()) or bool(
        scheduler or ssh_host or replicas not in (None, 1) or keep_alive or policy or nodes_per_replica
        or stage_weights)
    several = _refuse(reuse, launching, models, models_file, each or parallel is None, alias)
    check_plan(RunPlan(command=command, registry=registry, alias=alias, fmt=fmt, each=each,
                       parallel=parallel or 1))  # COMMAND and the registry before the models are sized
    model, kw, order = _models(models, models_file, several, {**kw, "scheduler": scheduler, "ssh_host": ssh_host,
                                                              "replicas": replicas}) if not reuse else (None, kw, [])
    scale = scale_spec(replicas, kw.pop("min_replicas"), kw.pop("max_replicas"), kw.pop("scale_up_waiting"),
                       kw.pop("scale_down_idle"))  # autoscaling: a service, as `serve --min/--max-replicas`
    replicas = 1 if replicas is None else replicas
    serve: dict[str, Any] = {k: v for k, v in (("nodes_per_replica", nodes_per_replica), ("policy", policy),
                                               ("keep_alive", keep_alive or None), ("scale", scale),
                                               ("models", kw.pop("models", None))) if v is not None}
    if replicas > 1 or serve:
        serve["name"] = kw.pop("name", None)
    plan = RunPlan(command=command, reuse=reuse, replicas=replicas, serve=serve,
                   api_key=read_key_env(api_key_env, os.environ), use_api_key=not no_api_key,
                   registry=registry, alias=alias, fmt=fmt, keep=keep, tunnel=via_tunnel, timeout=timeout,
                   stage=stage_weights, each=each, parallel=parallel or 1, order=order)
    check_plan(plan)  # COMMAND and the registry, before anything renders, connects or is queued
    if model is not None:
        from pbs_toolkit.campaigns.lease import run_lease

        plan.request = replace(build_request(model, **kw), lease_s=run_lease(lease, keep=keep))
    elif lease is not None:
        raise UsageError("--lease is for a server pbstk run launches: a --reuse'd one has no lease")
    with Client(accept_new_host_key=accept_new_host_key) as c:
        code = run(c, plan, RunHooks(notice=_notice, wait_job=_wait_job, wait_service=_wait_service,
                                     each_done=_each_table))
    raise SystemExit(code)


def _refuse(reuse: str | None, launching: bool, models: list[str], models_file: str | None, parallel_ok: bool,
            alias: str | None) -> bool:
    """What ``run`` refuses before anything is sized or queued; whether several models are given."""
    from pbs_toolkit.errors import UsageError

    if reuse and (models or models_file):
        raise UsageError("--reuse takes no MODEL or --models: it runs COMMAND against the job or service NAME")
    if reuse and launching:
        raise UsageError("--reuse takes no launch or serve options: the job or service runs already")
    if not reuse and not models and not models_file:
        raise UsageError("run needs MODEL, `--` and COMMAND (or --reuse NAME -- COMMAND)")
    if not parallel_ok:
        raise UsageError("--parallel N runs COMMAND for several models at once: give --each too")
    several = len(models) > 1 or models_file is not None
    if several and alias is not None:
        raise UsageError("--alias names one entry; with several models each entry's alias is its served name")
    return several


def _split_words(words: tuple[str, ...], after: list[str] | None, no_model: bool, each: bool
                 ) -> tuple[list[str], list[str]]:
    """MODELs and COMMAND: the words before and after ``--``; without ``--``, the first word is MODEL (none with
    --reuse or --models) and the rest COMMAND; ``--each`` needs the ``--``."""
    from pbs_toolkit.errors import UsageError

    if after is not None:
        return list(words), after
    if each:
        raise UsageError("--each needs `--` between the MODELs and COMMAND: pbstk run M1 M2 --each -- COMMAND")
    return ([], list(words)) if no_model else (list(words[:1]), list(words[1:]))


def _models(models: list[str], models_file: str | None, several: bool, kw: dict[str, Any]
            ) -> tuple[str, Any, list[str]]:
    """The model to launch, the launch options and the served names in the order given: one model as before
    (its ``:preset=``/``:name=`` applied), several as `serve M1 M2` plans them (``kw["models"]``, the plan's
    rows, largest first; the service named ``run-YYYYmmdd-HHMMSS-PID`` unless --name)."""
    from pbs_toolkit.cli.multi_model import single_or_plan
    from pbs_toolkit.services.models.spec import parse_models

    if several and not kw.get("name"):
        import time

        kw["name"] = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    single = single_or_plan(tuple(models), models_file, False, False, kw)
    assert single is not None  # no dry run here
    model, kw = single
    kw.pop("replicas", None)
    return model, kw, [s.served_model_name for s in parse_models(tuple(models), models_file)] if several else []


def _each_table(runs: list[Any]) -> None:
    """``run --each``'s summary, on stderr with pbstk's other lines (COMMAND's stdout stays its own)."""
    from pbs_toolkit.durations import short

    rows = [[r.model, r.alias, "-" if r.child.code is None else str(r.child.code),
             "-" if r.child.seconds is None else short(r.child.seconds),
             f"not run: {r.child.why}" if r.child.why else str(r.child.log or "-")] for r in runs]
    click.echo(table(rows, ["MODEL", "ALIAS", "EXIT", "DURATION", "LOG"]), err=True)


def _notice(message: str) -> None:
    click.echo(f"pbstk: {message}", err=True)


def _wait_job(c: Any, record: Any, timeout: float) -> Any:
    from pbs_toolkit.cli.job_cmds import progress_printer

    with progress_printer() as show:  # the live line of `launch --wait`, on stderr
        return c.wait(record, timeout, show)


def _wait_service(c: Any, svc: Any, timeout: float) -> Any:
    from pbs_toolkit.cli.service_cmds import wait_service

    return wait_service(c, svc, timeout, False, hint=False)  # Ctrl-C cancels it here: run says so


@click.command("usage")
@click.argument("refs", nargs=-1, metavar="[JOB|SERVICE]...")
@click.option("--since", help="Only jobs and services launched since then: 2026-11-25, 2026-11-25T10:00, 12h, 7d.")
@click.option("--json", "as_json", is_flag=True, help="Print one usage object (jobs, services, totals).")
def usage(refs: tuple[str, ...], since: str | None, as_json: bool) -> None:
    """Nodes, GPUs, wall time (from the scheduler's own accounting), node- and GPU-hours, requests and tokens
    (from the server's counters, recorded before each cancel) per job and per service, with totals.

    With no JOB or SERVICE: every job and service in this machine's job store (--since narrows it).
    A service's rows are its replicas (keep-alive successors included) and its router job.
    """
    from pbs_toolkit.campaigns.usage import parse_since
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError

    if since is not None and refs:
        raise UsageError("usage takes JOB/SERVICE names or --since, not both")
    start = parse_since(since) if since is not None else None
    with Client() as c:
        report = c.usage(*refs, since=start)
    for note in report.notes:
        click.echo(f"pbstk: note: {note}", err=True)
    if as_json:
        echo_json(report.to_dict())
        return
    if not report.jobs:
        click.echo("no jobs to report")
        return
    click.echo(usage_table(report))


def _n(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}f}"
    return str(int(value)) if isinstance(value, float) else str(value)


def usage_table(report: Any) -> str:
    """The table: one row per job (a service's under its name), a subtotal per service, the total last."""
    from pbs_toolkit.durations import short

    def cells(label: str, name: str, d: dict[str, Any], source: str) -> list[str]:
        wall = d.get("walltime_s")
        return [label, name, _n(d.get("nodes")), _n(d.get("gpus")), "-" if wall is None else short(wall),
                _n(d.get("node_hours"), 3), _n(d.get("gpu_hours"), 3), _n(d.get("requests")),
                _n(d.get("prompt_tokens")), _n(d.get("output_tokens")), _n(d.get("output_tokens_per_gpu_hour"), 0),
                source]

    rows = []
    for svc in report.services:
        for r in svc.rows:
            rows.append(cells(r.job_id, f"{r.name} ({r.kind} of {svc.label})", r.to_dict(), r.walltime_source or "-"))
        rows.append(cells(f"service {svc.label}", f"{len(svc.rows)} job(s)", svc.to_dict(), ""))
        for m in svc.models or []:  # a multi-model service: each model's part (docs/multi-model.md)
            awake = "" if m.get("awake_s") is None else f", awake {short(m['awake_s'])}"
            rows.append([f"  model {m['model']}", f"part of {m['jobs']} job(s){awake}", "-",
                         _n(len(m["gpus"]) or None), "-", _n(m.get("node_hours"), 3), _n(m.get("gpu_hours"), 3),
                         "-", "-", "-", "-", ""])
    for r in report.jobs:
        if r.service is None:
            rows.append(cells(r.job_id, r.name, r.to_dict(), r.walltime_source or "-"))
    rows.append(cells("TOTAL", f"{len(report.jobs)} job(s)", report.totals.to_dict(), ""))
    return table(rows, ["JOB", "NAME", "NODES", "GPUS", "WALLTIME", "NODE-H", "GPU-H", "REQUESTS", "PROMPT-TOK",
                        "OUTPUT-TOK", "OUT-TOK/GPU-H", "WALLTIME FROM"])


COMMANDS = [run_cmd, usage]
