"""``pbstk serve`` (several replicas behind one router), ``pbstk service resume``, the hidden ``_keeper``, and
the service lines ``status``/``cancel``/``update-endpoint``/``env`` print for a service name."""

from __future__ import annotations

from typing import Any

import click

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


def _handover(ctx: click.Context, param: click.Parameter, value: str) -> float:
    from pbs_toolkit.durations import parse

    return parse(value, "--handover")


@click.command()
@click.argument("models", nargs=-1, metavar="MODEL...")
@click.option("--models", "models_file", metavar="FILE.yaml", help="The models of the service, listed in a YAML "
              "file instead of MODEL arguments (docs/multi-model.md).")
@click.option("--dry-run", is_flag=True, help="Print where each model would run (job, GPUs, memory share, port); "
              "write and queue nothing.")
@click.option("--max-awake", type=BoundedInt(1, 64), metavar="K",
              help="Several models: those that fit nowhere awake share GPUs by vLLM's sleep mode, at most K awake "
                   "on one GPU set; a request for a sleeping model waits while it wakes (docs/multi-model.md "
                   "\"Swapping\").")
@click.option("--sleep-after", metavar="DURATION", help="With --max-awake: a swapping model idle this long sleeps "
              "even when no other model waits for its GPUs (90s, 10m; default: it sleeps only for another model).")
@click.option("--replicas", "-n", type=Count("replicas"),
              help="How many replica jobs serve behind the one URL (a fixed count; default 1).")
@click.option("--nodes-per-replica", type=BoundedInt(1, 10000), help="Nodes of each replica job (--nodes).")
@click.option("--keep-alive", is_flag=True, help="Keep a successor queued for every replica across walltimes.")
@click.option("--handover", default="10m", show_default=True, callback=_handover, metavar="DURATION",
              help="With --keep-alive: the successor becomes eligible this long before the walltime ends "
                   "(90s, 10m, 1h30m; docs/settings.md#durations).")
@click.option("--policy", help="Router policy (default: the profile's router_policy, power_of_two): "
              "power_of_two (fewer requests in flight), consistent_hash (session-affine: multi-turn), "
              "round_robin, ... (docs/services.md \"Policies\").")
@click.option("--api-key-env", help="Take the service's API key from this environment variable.")
@click.option("--wait/--no-wait", "wait_ready", default=False,
              help="Wait until every replica is READY in the router and a request with the key gets through.")
@click.option("--timeout", type=SECONDS, default=3600.0, show_default=True, help="Seconds to wait with --wait.")
@click.option("--max-restarts", type=BoundedInt(0, 1000), metavar="K",
              help="Replace a failed replica at most K times within --restart-window, then leave its slot down "
              "(default: the profile's max_restarts, 3; 0: never).")
@click.option("--restart-window", metavar="D", help="The window --max-restarts counts in (default: the profile's "
              "restart_window, 30m).")
@click.option("--restart-backoff", metavar="D", help="Wait before replacing a failed replica, doubled for each "
              "restart in the window, at most 5m (default: the profile's restart_backoff, 10s).")
@click.option("--json", "as_json", is_flag=True)
@STAGE_OPTION
@scale_options
@render_options
def serve(models: tuple[str, ...], models_file: str | None, dry_run: bool, replicas: int | None,
          nodes_per_replica: int | None, keep_alive: bool, handover: float,
          policy: str | None, api_key_env: str | None, wait_ready: bool, timeout: float, max_restarts: int | None,
          restart_window: str | None, restart_backoff: str | None, as_json: bool, stage_weights: bool,
          **kw: Any) -> None:
    """Serve MODEL as a service: N replica jobs behind one vllm-router, one URL and one key.

    Several models (MODEL[:preset=P][:name=SERVED] each, or --models FILE.yaml): one URL and one key, the
    request's model picks the model; packed into as few jobs as fit, or swapped on shared GPUs with --max-awake;
    --dry-run prints the plan (docs/multi-model.md).

    \b
      pbstk serve Qwen/Qwen3-VL-2B-Instruct --replicas 2 --name qwen --wait
      pbstk serve MODEL --min-replicas 1 --max-replicas 4 --idle-cancel 2h   # autoscaled, ends unused
      pbstk serve Qwen/Qwen3-0.6B Qwen/Qwen3-1.7B:name=q17 --name evals --dry-run
      pbstk serve Qwen/Qwen3-8B Qwen/Qwen3-14B Qwen/Qwen3-4B --name evals --max-awake 1
      pbstk update-endpoint qwen        # registers the router's URL
      pbstk cancel qwen                 # replicas, router and keeper
    """
    import os

    from pbs_toolkit.cli.multi_model import single_or_plan
    from pbs_toolkit.client import Client

    single = single_or_plan(models, models_file, dry_run, as_json, {**kw, "replicas": replicas})
    if single is None:
        return
    model, kw = single
    kw.pop("replicas")
    planned = kw.pop("models", ())
    name = kw.pop("name", None)
    scale = scale_spec(replicas, kw.pop("min_replicas"), kw.pop("max_replicas"), kw.pop("scale_up_waiting"),
                       kw.pop("scale_down_idle"))
    req = build_request(model, **kw)
    with Client() as c:
        rec = c.serve(req, replicas=1 if replicas is None else replicas, name=name, scale=scale, keep_alive=keep_alive,
                      handover_s=handover, policy=policy, nodes_per_replica=nodes_per_replica,
                      api_key=read_key_env(api_key_env, os.environ), stage=stage_weights,
                      max_restarts=max_restarts, restart_window=restart_window, restart_backoff=restart_backoff,
                      models=planned)
        if note := c.shared_name_note(rec.name, "service"):  # a job of that name too: say which one NAME means
            click.echo(f"pbstk: note: {note}", err=True)
        if not as_json and planned:
            click.echo(f"service {rec.name}: {len(planned)} models in {rec.replicas} job(s) submitted, router at "
                       f"{rec.url}")
        elif not as_json:
            click.echo(f"service {rec.name}: {rec.replicas} replica(s) submitted, router at {rec.url}")
            click.echo("next:")
            click.echo(f"  pbstk status {rec.name}")
            click.echo(f"  pbstk update-endpoint {rec.name}")
            click.echo(f"  pbstk cancel {rec.name}")
        st = c.wait_service(rec, timeout) if wait_ready else c.service_status(rec)
    if as_json:
        echo_json(st.to_dict())
    elif wait_ready:
        click.echo(f"ready: {rec.url}  ({st.summary}, model {rec.served_model_name})")


@click.group()
def service() -> None:
    """Services started with `pbstk serve` (status, cancel, update-endpoint and env take a service name too)."""


@service.command("resume")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the service object once the keeper runs.")
def resume(name: str, as_json: bool) -> None:
    """Start the service's keeper again (after a reboot or a kill); a running keeper is left alone."""
    from pbs_toolkit.client import Client

    with Client() as c:
        pid = c.resume_service(name)
        if as_json:
            echo_json(c.service_status(name).to_dict())
            return
    click.echo(f"service {name}: keeper {'already running' if not pid else f'started (pid {pid})'}")


@click.command("_keeper", hidden=True)
@click.argument("name")
def keeper(name: str) -> None:
    """The detached keeper of service NAME (started by `serve` and `service resume`)."""
    from pbs_toolkit.client import Client

    with Client(on_removal=lambda r: None) as c:
        raise SystemExit(c.keep_service(name))


# -- what status / cancel print for services ------------------------------------------------------------------


def keeper_note(st: Any) -> str | None:
    if st.record.active and st.record.ended is not None:
        return (f"pbstk: warning: service {st.record.name} is not stopped yet (an interrupted cancel?): its router "
                f"or replicas may still run; `pbstk cancel {st.record.name}` finishes it")
    if st.keeper_stuck:
        from pbs_toolkit.services.keeper_process import service_dir

        return (f"pbstk: warning: the keeper of service {st.record.name} runs but makes no progress "
                f"({st.keeper_stuck}); see {service_dir(st.record.name) / 'keeper.log'}")
    if st.record.ended is None and not st.keeper_running:
        return (f"pbstk: warning: the keeper of service {st.record.name} is not running (replicas are not "
                f"added to or removed from the router); restart it with `pbstk service resume {st.record.name}`")
    return None


def service_lines(statuses: list[Any]) -> list[str]:
    """One line per service above the jobs table: ``NAME  READY 3/4 replicas  URL``."""
    rows = [[st.record.name, st.summary, st.url or "-"] for st in statuses]
    return table(rows, ["SERVICE", "STATE", "URL"]).splitlines() if rows else []


def status_services(c: Any, jobs: tuple[str, ...], show_all: bool, as_json: bool) -> tuple[list[Any], list[Any]] | None:
    """``status``'s services and jobs, from one scheduler query per transport (the services' replica jobs join
    the jobs' batch): every service when no JOB is named; each in full when every JOB names a service (printed
    here: ``None`` returned); none when jobs are named."""
    if not jobs:
        return c.service_statuses(c.services(all=show_all), c.records(all=show_all))  # type: ignore[no-any-return]
    named = [c.service(j) for j in jobs]  # a service name (no job of that name): docs/services.md
    if not all(named):
        return [], c.status(*jobs, all=show_all)
    services = c.service_statuses(named)[0]
    if as_json:
        echo_json([s.to_dict() for s in services])
    else:
        for st in services:
            show_service(st)
    return None


def print_service_lines(services: list[Any], jobs_follow: bool) -> bool:
    """The service lines (and a keeper warning per service whose keeper is gone); ``True`` if any."""
    for line in service_lines(services):
        click.echo(line)
    for st in services:
        for note in (keeper_note(st), restart_note(st)):
            if note:
                click.echo(note, err=True)
    if services and jobs_follow:
        click.echo("")
    return bool(services)


def _router_job(rec: Any, st: Any) -> str:
    """`` (job ID, running)`` for a router inside a job (profile ``router: job``)."""
    if not rec.router_job:
        return ""
    return f" (job {rec.router_job['job_id']}, {st.router_job_state or 'unknown'})"


def show_service(st: Any) -> None:
    """``status NAME`` of a service: its line, then each replica."""
    from pbs_toolkit.cli.output import state_cell, time_cells
    from pbs_toolkit.jobs.startup_phases import startup_text

    rec = st.record
    click.echo(f"service {rec.name}: {st.summary}  {st.url or '-'}")
    models = f"models {', '.join(m['served_model_name'] for m in rec.models)}" if rec.models else \
        f"model {rec.served_model_name}"
    click.echo(f"{models}, profile {rec.profile}, policy {rec.policy}, "
               f"keep-alive {'on (handover ' + format(rec.handover_s, 'g') + ' s)' if rec.keep_alive else 'off'}, "
               f"router {'running' if st.router_running else 'not running'}{_router_job(rec, st)}"
               f"{f' ({st.route.text})' if st.route is not None else ''}, "
               f"keeper {'running' if st.keeper_running else 'not running'}")
    scaling_line(st)
    restart_lines(rec)
    model_table(st)
    by_id = {s.record.job_id: s for s in st.replicas}
    rows = []
    for slot in rec.slots:
        for role, job in (("current", slot.current), ("successor", slot.successor), ("draining", slot.draining)):
            s = by_id.get(job or "")
            if s is None:
                continue
            uptime, left = time_cells(s)
            detail = s.comment if s.state.value == "PENDING" else (s.phase if s.state.value == "STARTING" else s.reason)
            if s.state.value == "STARTING" and (took := startup_text(s.startup)):  # docs/coldstart.md
                detail = f"{detail} ({took})" if detail else took
            detail = f"{s.busy}; {detail}" if s.busy and detail else (s.busy or detail)
            rows.append([f"r{slot.index}", role, s.record.job_id, s.record.name, state_cell(s), uptime, left,
                         s.url or "-", detail or ""])
    if rows:
        click.echo(table(rows, ["REPLICA", "ROLE", "JOB", "NAME", "STATE", "UPTIME", "WALLTIME-LEFT", "URL",
                                "DETAIL"]))
    note = keeper_note(st)
    if note:
        click.echo(note, err=True)


def model_table(st: Any) -> None:
    """A multi-model service's models, a row each: served name, state, job, GPUs, memory share, its server's URL
    (clients use the service's URL with this ``model``; docs/multi-model.md)."""
    swapping = any("swap" in m for m in st.models)
    rows = []
    for m in st.models:
        row = [m["served_model_name"], m["state"], m["job"] or "-", ",".join(str(g) for g in m["gpus"]) or "cpu",
               "-" if m["gpu_memory_utilization"] is None else f"{m['gpu_memory_utilization']:.2f}"]
        if swapping:
            row += swap_cells(m)
        rows.append([*row, m["server"] or "-"])
    headers = ["MODEL", "STATE", "JOB", "GPUS", "MEMORY", *(["AWAKE", "LAST WAKE/SLEEP"] if swapping else []),
               "SERVER"]
    if rows:
        click.echo(table(rows, headers))


def swap_cells(row: dict[str, Any]) -> list[str]:
    """A swapping service's model row: ``AWAKE`` (awake, asleep; ``always``: this model does not swap; ``-``: its
    swapper has not said yet) and the last wake's and sleep's seconds with the count of wakes (``0.50s/0.05s x3``)."""
    if "swap" not in row:
        return ["always", "-"]
    swap = row["swap"]
    if not swap:
        return ["-", "-"]
    wake, asleep = swap.get("last_wake_s"), swap.get("last_sleep_s")
    times = "-" if wake is None and asleep is None else "{}/{} x{}".format(
        "-" if wake is None else f"{wake:.2f}s", "-" if asleep is None else f"{asleep:.2f}s", swap.get("wakes", 0))
    return ["awake" if swap.get("awake") else "asleep", times]


def scaling_line(st: Any) -> None:
    """Autoscaling (target, routable replicas, the last change and its reason), the service's idle cancel and
    lease, and an end the keeper chose."""
    from pbs_toolkit.services.scaler import summary

    rec = st.record
    text = summary(rec.scale, rec.replicas, st.ready)
    if text:
        click.echo(text)
    said = ([f"idle cancel: after {format(rec.idle_cancel_s, 'g')} s without a request"] if rec.idle_cancel_s else []) \
        + ([f"lease of pbstk run: {format(rec.lease_s, 'g')} s"] if rec.lease_s else []) \
        + ([f"ended: {rec.end_reason}"] if rec.end_reason else [])
    if said:
        click.echo("; ".join(said))


def restart_lines(rec: Any) -> None:
    """The restart policy, each slot's restarts and last failure, and why the service is short for good."""
    from pbs_toolkit.services import restarts

    click.echo(f"restarts: {restarts.RestartPolicy.from_dict(rec.restart).text}")
    for slot in rec.slots:
        if text := restarts.slot_text(slot):
            click.echo(f"  {text}")
    if why := restarts.reason(rec):
        click.echo(f"not restarted: {why}")


def restart_note(st: Any) -> str | None:
    """``status``'s one line for a service short of a replica for good (services/restarts.py)."""
    from pbs_toolkit.services import restarts

    why = restarts.reason(st.record) if st.record.ended is None else None
    return f"pbstk: warning: service {st.record.name} is {st.state}: {why}" if why else None


COMMANDS = [serve, service, keeper]


# -- a service name where a job name would do: wait, metrics, doctor, bench, logs ------------------------------


def named_service(c: Any, job: str | None, replica: int | None = None) -> Any:
    """The service JOB names (``Client.service``: no job has that id or name), else ``None``; ``--replica K``
    is refused for a job."""
    from pbs_toolkit.errors import UsageError

    svc = c.service(job)
    if svc is None and replica is not None:
        raise UsageError(f"--replica {replica}: {job or 'the newest job'} is a job, not a service")
    return svc


class _ServiceLine:
    """What a wait's progress line shows of a service: its state and how many replicas (models, for a
    multi-model service) are READY."""

    def __init__(self, st: Any) -> None:
        import types

        self.record, self.comment, self.reason = st.record, None, None
        self.state = types.SimpleNamespace(value=st.state, final=st.record.ended is not None)
        router = f"router {'running' if st.router_running else 'not running'}"
        if st.record.models:  # a multi-model service counts its models (a job holds several)
            ready = sum(m["state"] == "READY" for m in st.models)
            self.phase = f"{ready}/{len(st.record.models)} models READY, {router}"
        else:
            self.phase = f"{st.ready}/{st.record.replicas} replicas READY, {router}"


def wait_service(c: Any, svc: Any, timeout: float, quiet: bool, *, hint: bool = True) -> Any:
    """``wait NAME`` (and ``--wait`` of metrics/bench): the service's wait, with the progress line of a job's.
    ``hint``: Ctrl-C says the service was left as it is (not for a caller that stops it then: ``pbstk run``)."""
    from contextlib import nullcontext

    from pbs_toolkit.cli.progress import interrupt_hint, progress_printer

    with interrupt_hint(svc.name) if hint else nullcontext(), progress_printer(quiet) as show:
        return c.wait_service(svc, timeout, lambda st, elapsed: show(_ServiceLine(st), elapsed))


def show_metrics(m: Any, show_summary: Any) -> None:
    """``metrics NAME``: one line per replica, the aggregate in the job's three lines, the router's line."""
    def fmt(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    models = "" if m.models is None else f", {m.aggregate.get('models', 0)} model(s)"
    click.echo(f"service {m.name}: {m.aggregate['replicas']} replica(s){models} scraped")
    rows = [(f"r{r['replica']} {r['job_id']}", r) for r in m.replicas]
    rows += [(f"model {r['model']} (r{r['replica']} {r['job_id']})", r) for r in m.models or []]
    for label, r in rows:
        if "error" in r:
            click.echo(f"  {label}: {r['error']}")
            continue
        rates = r.get("rates") or {}
        click.echo(f"  {label}: running {fmt(r['running'])}  waiting {fmt(r['waiting'])}  "
                   f"KV cache {fmt(r['kv_cache_usage_pct'], '%')}  gen {fmt(rates.get('generation_tokens_per_s'))} "
                   f"tok/s  req {fmt(rates.get('requests_per_s'))}/s")
    click.echo("all replicas:" if m.models is None else "all models:")
    show_summary(m.aggregate)
    rt = m.router
    if rt is None:
        click.echo(f"router: no figures ({m.router_error})")
        return
    healthy = sum(1 for w in rt["workers"] if w.get("healthy"))
    click.echo(f"router: {fmt(rt['requests_total'])} requests ({fmt(rt['requests_per_s'])}/s), "
               f"{fmt(rt['retries_total'])} retried, {fmt(rt['retries_exhausted_total'])} gave up; "
               f"workers {healthy}/{len(rt['workers'])} healthy; request time p50/p90/p99 "
               f"{fmt(rt['duration_p50_ms'])}/{fmt(rt['duration_p90_ms'])}/{fmt(rt['duration_p99_ms'])} ms "
               f"({rt['window']})")


def show_doctor(d: Any, show_findings: Any) -> None:
    """``doctor NAME``: the router's and keeper's findings, then each replica's diagnosis."""
    router = d.router
    workers = router.get("workers")
    click.echo(f"service {d.name} ({d.state}): router {'running' if router['running'] else 'not running'}"
               f"{'' if workers is None else f', {len(workers)} worker(s)'}, keeper "
               f"{'running' if router['keeper_running'] else 'not running'}: {len(d.findings)} finding(s)")
    show_findings(d.findings)
    for k, rd in d.replicas:
        click.echo(f"\nreplica r{k}: {rd.job_id} ({rd.state}): {len(rd.findings)} finding(s)")
        show_findings(rd.findings)
