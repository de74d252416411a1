"""``pbstk metrics``, ``doctor``, ``bench``, ``tune``."""

from __future__ import annotations

import time
from typing import Any

import click

from pbs_toolkit.cli.complete import complete_job
from pbs_toolkit.cli.options import SECONDS, BoundedInt, build_request, echo_json, render_options, table, writable_file

#: bounds that keep a typo (``-1``, ``1e9``) from running a useless or endless benchmark
_COUNT, _PROMPTS = BoundedInt(0, 10**9), BoundedInt(1, 10**6)
_ROUNDS, _TOKENS = BoundedInt(1, 10**4), BoundedInt(1, 10**7)
_IMAGES = BoundedInt(0, 64)
MAX_CONCURRENCY = 10000


def _ready_status(c: Any, job: str | None, wait: bool, timeout: float) -> Any:
    """JOB's READY status through the command's client (``--wait``: wait for it, printing progress)."""
    from pbs_toolkit.cli.progress import progress_printer

    return c.ready_status(job, wait=wait, timeout=timeout, on_progress=progress_printer(),
                          hint="pass --wait to wait for it")


def _int_list(text: str) -> list[int]:
    from pbs_toolkit.errors import UsageError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(not 1 <= v <= MAX_CONCURRENCY for v in values):
        raise UsageError(f"{text!r}: concurrencies must be integers from 1 to {MAX_CONCURRENCY}")
    return values


def _show_summary(s: dict[str, Any]) -> None:
    def fmt(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    r = s.get("rates") or {}
    click.echo(f"{time.strftime('%H:%M:%S', time.localtime(s['timestamp']))}  running {fmt(s['running'])}  "
               f"waiting {fmt(s['waiting'])}  KV cache {fmt(s['kv_cache_usage_pct'], '%')}  "
               f"prefix hits {fmt(s['prefix_cache_hit_rate_pct'], '%')}  "
               f"prompt {fmt(r.get('prompt_tokens_per_s'))} tok/s  gen {fmt(r.get('generation_tokens_per_s'))} tok/s  "
               f"req {fmt(r.get('requests_per_s'))}/s")
    t = s.get("totals") or {}
    click.echo(f"          since start: {fmt(t.get('requests_success'))} requests, "
               f"{fmt(t.get('prompt_tokens'))} prompt + {fmt(t.get('generation_tokens'))} generated tokens")
    click.echo(f"          TTFT p50/p90/p99 {fmt(s.get('ttft_p50_ms'))}/{fmt(s.get('ttft_p90_ms'))}/"
               f"{fmt(s.get('ttft_p99_ms'))} ms  ITL p50 {fmt(s.get('itl_p50_ms'))} ms  "
               f"e2e p50/p99 {fmt(s.get('e2e_p50_ms'))}/{fmt(s.get('e2e_p99_ms'))} ms ({s['window']})")


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--watch", "watch", type=SECONDS, default=None, is_flag=False, flag_value=5.0,
              help="Scrape again every N seconds (default 5) and show rates between scrapes.")
@click.option("--count", type=_COUNT, default=0, help="With --watch: stop after this many scrapes (0: until Ctrl-C).")
@click.option("--export", "export_path", type=click.Path(dir_okay=False), callback=writable_file,
              help="Append JSON lines to FILE.")
@click.option("--interval", type=SECONDS, default=1.0, show_default=True,
              help="Without --watch: seconds between the two scrapes used for rates.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--wait", "wait_ready", is_flag=True, help="Wait for the job to be ready first.")
@click.option("--timeout", type=SECONDS, default=3600.0)
@click.option("--model", default=None, metavar="M",
              help="JOB names a multi-model service: its model M (a served name) only.")
def metrics(job: str | None, watch: float | None, count: int, export_path: str | None, interval: float,
            as_json: bool, wait_ready: bool, timeout: float, model: str | None) -> None:
    """Throughput, queue, KV cache and latency percentiles of JOB's server (from /metrics and its log).

    JOB may name a service (`pbstk serve`): each serving replica, their sum, and the router's own figures; of a
    multi-model service, each model too (--model M: that one)."""
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError

    with Client() as c:
        svc = service_cmds.named_service(c, job)  # docs/services.md
        if model is not None and svc is None:
            raise UsageError(f"--model {model}: {job or 'the newest job'} is no service; --model picks a model of "
                             "a multi-model service")
        if svc is not None:
            sst = service_cmds.wait_service(c, svc, timeout, as_json) if wait_ready else svc
            looks: Any = (c.watch_service_metrics(sst, watch, count, model) if watch
                          else [c.service_metrics(sst, interval, model)])
            show = lambda m: service_cmds.show_metrics(m, _show_summary)  # noqa: E731
        else:
            st = _ready_status(c, job, wait_ready, timeout)
            looks = c.watch_metrics(st, watch, count) if watch else [c.metrics(st, interval)]
            show = _show_job_metrics
        for m in looks:
            _show_metrics(m, export_path, as_json, show)


def _show_metrics(m: Any, export_path: str | None, as_json: bool, show: Any) -> None:
    """One look: a JSON line (``--export``, ``--json``: the metrics object) or ``show``'s text."""
    if export_path:
        import json

        _append_line(export_path, json.dumps(m.to_dict(), default=str))
    if as_json:
        echo_json(m.to_dict(), line=True)
        return
    show(m)


def _show_job_metrics(m: Any) -> None:
    """A job's look: three lines of text and the last Engine line."""
    summary = m.summary
    _show_summary(summary)
    if summary.get("engine_log"):
        last = summary["engine_log"][-1]
        click.echo(f"          last Engine line: gen {last.get('generation_throughput')} tok/s, "
                   f"running {last.get('running')}, KV {last.get('kv_cache_usage_pct')}%")


def _append_line(path: str, line: str) -> None:
    """Append ``line`` to ``--export`` FILE; a disk that fills up mid-run is one error line, not a traceback."""
    from pbs_toolkit.errors import UsageError

    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    except OSError as exc:
        raise UsageError(f"--export {path}: cannot write: {exc.strerror or exc}") from None


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--replica", type=int, default=None, metavar="K", help="JOB names a service: replica K only.")
@click.option("--json", "as_json", is_flag=True)
def doctor(job: str | None, replica: int | None, as_json: bool) -> None:
    """Diagnose JOB's server from its flags, log and metrics; end with the preset to use and how.

    A finding that a new launch fixes comes with the `pbstk launch` command that relaunches JOB with that fix.

    JOB may name a service (`pbstk serve`): the router's and keeper's state, then each replica (or --replica K)."""
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client
    from pbs_toolkit.jobs.status_types import ServerState

    with Client() as c:
        svc = service_cmds.named_service(c, job, replica)  # docs/services.md
        if svc is not None:
            sd = c.service_doctor(svc, replica)
            if as_json:
                echo_json(sd.to_dict())
            else:
                service_cmds.show_doctor(sd, _show_findings)
            return
        record = c.record(job)
        d = c.doctor(record)
    if as_json:
        echo_json(d.to_dict())
        return
    click.echo(f"{d.job_id} ({record.preset}, {d.state}): {len(d.findings)} finding(s)")
    _show_findings(d.findings)
    if d.recommended_preset:
        click.echo(f"\nrecommended preset: {d.recommended_preset} ({d.why})\n  {d.launch}")
    elif not d.findings:
        click.echo("nothing to report")
    if (d.launch or any(f.relaunch for f in d.findings)) and not ServerState(d.state).final:
        click.echo(f"\n(the job holds its name {record.name} while it runs: `pbstk cancel {d.job_id}` first)")


def _show_findings(findings: Any) -> None:
    """Each finding's lines; its relaunch command, where a launch applies the fix, on a line of its own."""
    for f in findings:
        click.echo(f"\n[{f.severity}] {f.title}\n  evidence: {f.evidence}\n  fix:      {f.fix}")
        if f.relaunch:
            click.echo(f"  relaunch: {f.relaunch}")


def image_options(command: Any) -> Any:
    """``--images N --image-size WxH``: a vision-language model's image+text load (bench and tune)."""
    command = click.option("--image-size", default="512x512", show_default=True, metavar="WxH",
                           help="Pixels of each image sent with --images.")(command)
    return click.option("--images", type=_IMAGES, default=0, show_default=True,
                        help="Images sent with every request (a vision-language model; chat endpoint, "
                             "vllm bench serve's random-mm dataset). 0: text only.")(command)


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("--concurrency", "-c", default="1,8,64", show_default=True, help="Comma-separated levels.")
@click.option("--input-len", type=_TOKENS, default=128, show_default=True)
@click.option("--output-len", type=_TOKENS, default=256, show_default=True, help="Fixed (ignore_eos) output tokens.")
@click.option("--num-prompts", type=_PROMPTS, help="Requests per level (default: 4 x concurrency, at least 8).")
@click.option("--client", type=click.Choice(["auto", "vllm", "builtin"]), default="auto", show_default=True,
              help="vllm: `vllm bench serve` in the profile's environment; builtin: pbstk's async client; "
                   "auto: vllm where it can run, else builtin.")
@image_options
@click.option("--json", "as_json", is_flag=True)
@click.option("--wait", "wait_ready", is_flag=True, help="Wait for the job to be ready first.")
@click.option("--timeout", type=SECONDS, default=3600.0)
def bench(job: str | None, concurrency: str, input_len: int, output_len: int, num_prompts: int | None,
          client: str, images: int, image_size: str, as_json: bool, wait_ready: bool, timeout: float) -> None:
    """Drive load against JOB's endpoint: output tokens/s, requests/s, TTFT and TPOT per concurrency.

    JOB may name a service (`pbstk serve`): the load goes through its router's URL, with the service's key."""
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client
    from pbs_toolkit.perf.images import image_load

    levels = _int_list(concurrency)
    load = image_load(images, image_size)
    run: Any
    with Client() as c:
        svc = service_cmds.named_service(c, job)  # docs/services.md
        if svc is not None:
            target, run = (service_cmds.wait_service(c, svc, timeout, as_json) if wait_ready else svc), c.service_bench
        else:
            target, run = _ready_status(c, job, wait_ready, timeout), c.bench
        measured = run(target, levels, input_len=input_len, output_len=output_len, num_prompts=num_prompts,
                       client=client, notice=lambda m: click.echo(f"pbstk: note: {m}", err=True), images=load)
    for level in measured.results:  # a level that measured the client more than the server (perf/server_time.py)
        if note := level.outside_note():
            click.echo(f"pbstk: note: {note}", err=True)
    if as_json:
        echo_json(measured.to_dict())
        return
    results = [r.to_dict() for r in measured.results]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows = [[str(r["concurrency"]), str(r["completed"]), str(r["failed"]), f(r["output_throughput"]),
             f(r["request_throughput"]), f(r["median_ttft_ms"]), f(r["p99_ttft_ms"]), f(r["median_tpot_ms"]),
             f(r["p99_tpot_ms"])] for r in results]
    shape = f" + {load.describe()}" if load else ""
    click.echo(f"{measured.job_id} ({measured.preset}), {input_len} in{shape} / {output_len} out tokens")
    click.echo(table(rows, ["CONC", "OK", "FAILED", "OUT TOK/S", "REQ/S", "TTFT P50", "TTFT P99",
                            "TPOT P50", "TPOT P99"]))
    for r in results:
        for err in r.get("errors", [])[:3]:
            click.echo(f"c={r['concurrency']}: {err}", err=True)


#: what ``tune`` compares without ``--presets``/``-p``
TUNE_PRESETS = "dp4,tp4,tp2dp2,baseline-eager"


def tune_presets(preset_list: str | None, preset: str | None) -> list[str]:
    """The presets ``tune`` runs: ``--presets``, or ``-p``/``--preset`` (one name, or several with commas: a
    user who names one preset means that one, not the four defaults), else :data:`TUNE_PRESETS`."""
    from pbs_toolkit.errors import UsageError

    if preset_list is not None and preset is not None:
        raise UsageError("tune takes --presets or -p/--preset, not both")
    text = preset_list if preset_list is not None else preset if preset is not None else TUNE_PRESETS
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError(f"tune needs at least one preset (got {text!r})")
    return names


@click.command()
@click.argument("model", required=False)
@click.option("--presets", "preset_list", default=None,
              help=f"Presets to compare, comma-separated (default: {TUNE_PRESETS}); -p NAME[,NAME] is the same.")
@render_options
@click.option("--concurrency", "-c", default="1,8,64", show_default=True)
@click.option("--input-len", type=_TOKENS, default=128, show_default=True)
@click.option("--output-len", type=_TOKENS, default=256, show_default=True)
@click.option("--num-prompts", type=_PROMPTS, help="Requests per level (default: --rounds x concurrency, at least 8).")
@click.option("--rounds", type=_ROUNDS, default=4, show_default=True, help="Requests per level = rounds x concurrency.")
@click.option("--client", type=click.Choice(["auto", "vllm", "builtin"]), default="auto", show_default=True,
              help="Load generator (see `pbstk bench --help`).")
@image_options
@click.option("--baseline", help="Preset to compare against (default: the eager one).")
@click.option("--timeout", type=SECONDS, default=3600.0, help="Seconds to wait for each server.")
@click.option("--output", "output", type=click.Path(dir_okay=False), callback=writable_file,
              help="Where to save the result JSON.")
@click.option("--append", is_flag=True, help="Add the runs to an existing --output file (same method).")
@click.option("--save-default", is_flag=True, help="Make the winner your default preset for MODEL.")
@click.option("--report", "reports", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Re-render a saved result (repeat to merge results of the same method).")
@click.option("--png", type=click.Path(dir_okay=False), callback=writable_file,
              help="Also draw a bar chart (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True)
def tune(model: str | None, preset_list: str, concurrency: str, input_len: int, output_len: int,
         num_prompts: int | None, rounds: int, client: str, images: int, image_size: str, baseline: str | None,
         timeout: float,
         output: str | None,
         append: bool, save_default: bool, reports: tuple[str, ...], png: str | None, as_json: bool,
         **kw: Any) -> None:
    """Launch each preset for MODEL, benchmark them identically, and recommend the fastest.

    \b
      pbstk tune MODEL -P polaris                  # dp4, tp4, tp2dp2, baseline-eager: four jobs
      pbstk tune MODEL -P polaris -p dp4           # one preset, one job
    """
    from pbs_toolkit.client import Client
    from pbs_toolkit.errors import UsageError
    from pbs_toolkit.perf.images import image_load
    from pbs_toolkit.perf.tune import plot, render_table, require_matplotlib

    if png:
        require_matplotlib()  # before launching anything, not after the whole tune
    load = image_load(images, image_size)

    def progress(message: str) -> None:
        click.echo(message, err=True)

    if reports:
        doc = Client.tune_report(reports, baseline, output, progress=progress)
    else:
        if not model:
            raise UsageError("tune needs a MODEL (or --report FILE)")
        names = tune_presets(preset_list, kw.pop("preset", None))
        with Client() as c:
            doc = c.tune(build_request(model, **kw), names, concurrencies=_int_list(concurrency),
                         input_len=input_len, output_len=output_len, num_prompts=num_prompts, rounds=rounds,
                         client=client, timeout=timeout, baseline=baseline, progress=progress, save=True,
                         output=output, append=append, images=load)
    if as_json:
        echo_json(doc.to_dict())
    else:
        click.echo(render_table(doc))
    if png:
        click.echo(f"chart: {plot(doc, png)}", err=True)
    if save_default and doc.recommended and not reports:
        click.echo(f"default preset for {doc.model} is now {doc.recommended} "
                   f"({Client.set_default_preset(doc.model, doc.recommended)})")


COMMANDS = [metrics, doctor, bench, tune]
