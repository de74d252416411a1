"""``tune``: launch each preset, benchmark it identically, compare against the eager baseline.

One job per preset, one after another (each frees its GPUs before the next starts). Results are JSON, so
``pbstk tune --report FILE`` can re-render a table or a bar chart later.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.jobs.launch import cancel, launch
from pbs_toolkit.jobs.plan import slug
from pbs_toolkit.jobs.readiness import wait_until_ready
from pbs_toolkit.jobs.render import render
from pbs_toolkit.jobs.startup_phases import ready_seconds
from pbs_toolkit.jobs.status import status
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.perf.benchjob import LevelResult, benchmark_ready_job
from pbs_toolkit.perf.images import ImageLoad
from pbs_toolkit.schema import STAMP_KEYS, stamp
from pbs_toolkit.settings.launch_settings import LaunchSettings, RenderRequest, settings_of
from pbs_toolkit.textutil import table
from pbs_toolkit.transports import Runner, open_runner
from pbs_toolkit.version import __version__

Progress = Callable[[str], None]


@dataclass
class TuneRun:
    """One preset's run: launched as ``job_id``, ready after ``ready_s``, measured at each concurrency, or
    ``error`` when it failed. ``ready_s``/``eager_fallback`` stay ``None`` (and out of the JSON) when the
    server never became ready, as in reports saved before these classes existed."""

    preset: str
    layout: str = "?"
    eager: bool = False
    job_id: str = ""
    run_dir: str = ""
    ready_s: float | None = None
    eager_fallback: bool | None = None
    results: list[LevelResult] = field(default_factory=list)
    error: str | None = None
    #: keys this version does not know, kept so that re-saving a report loses nothing
    other: dict[str, Any] = field(default_factory=dict)

    _KEYS = ("preset", "layout", "eager", "job_id", "run_dir", "ready_s", "eager_fallback", "results", "error")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"preset": self.preset, "layout": self.layout, "eager": self.eager,
                                "job_id": self.job_id, "run_dir": self.run_dir}
        for key in ("ready_s", "eager_fallback"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        if self.results or (self.ready_s is not None and self.error is None):
            data["results"] = [r.to_dict() for r in self.results]
        if self.error is not None:
            data["error"] = self.error
        return {**data, **self.other}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneRun:
        ready, fallback, error = data.get("ready_s"), data.get("eager_fallback"), data.get("error")
        return cls(preset=str(data["preset"]), layout=str(data.get("layout", "?")), eager=bool(data.get("eager")),
                   job_id=str(data.get("job_id") or ""), run_dir=str(data.get("run_dir") or ""),
                   ready_s=float(ready) if isinstance(ready, (int, float)) else None,
                   eager_fallback=bool(fallback) if fallback is not None else None,
                   results=[LevelResult.from_dict(r) for r in data.get("results") or [] if isinstance(r, dict)],
                   error=str(error) if error is not None else None,
                   other={k: v for k, v in data.items() if k not in cls._KEYS})

    def throughput(self, concurrency: int) -> float | None:
        """Output tokens/s at ``concurrency``, ``None`` when that level was not measured or nothing completed."""
        for r in self.results:
            if r.concurrency == concurrency and r.completed:
                return float(r.output_throughput)
        return None


@dataclass
class TuneReport:
    """What ``tune`` saves (JSON, read back by ``tune --report``): the method, each preset's run, the
    baseline and the recommendation."""

    model: str
    concurrencies: list[int]
    runs: list[TuneRun] = field(default_factory=list)
    input_len: int = 0
    output_len: int = 0
    profile: str | None = None
    pbstk_version: str = __version__
    started: float = 0.0
    duration_s: float = 0.0
    vllm_args: list[str] = field(default_factory=list)
    baseline: str | None = None
    recommended: str | None = None
    other: dict[str, Any] = field(default_factory=dict)

    _KEYS = ("pbstk_version", "model", "profile", "started", "duration_s", "input_len", "output_len",
             "concurrencies", "vllm_args", "baseline", "runs", "recommended")

    def to_dict(self) -> dict[str, Any]:
        """The saved document, also ``tune --json``: a ``tune_report`` object (docs/json.md)."""
        data = {key: getattr(self, key) for key in self._KEYS}
        data["runs"] = [run.to_dict() for run in self.runs]
        return stamp("tune_report", {**data, **self.other})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneReport:
        return cls(model=str(data.get("model") or ""), concurrencies=[int(c) for c in data["concurrencies"]],
                   runs=[TuneRun.from_dict(r) for r in data["runs"]], input_len=int(data.get("input_len") or 0),
                   output_len=int(data.get("output_len") or 0), profile=data.get("profile"),
                   pbstk_version=str(data.get("pbstk_version") or ""), started=float(data.get("started") or 0),
                   duration_s=float(data.get("duration_s") or 0), vllm_args=list(data.get("vllm_args") or []),
                   baseline=data.get("baseline"), recommended=data.get("recommended"),
                   other={k: v for k, v in data.items() if k not in cls._KEYS and k not in STAMP_KEYS})

    def run(self, preset: str | None) -> TuneRun | None:
        return next((r for r in self.runs if r.preset == preset), None)


def check_presets(base: LaunchSettings, presets: Sequence[str], runner: Runner) -> None:
    """Render every preset first: unknown presets or GPU mismatches are refused before anything is submitted.

    Through ``runner``, as launch will render: the model may be a directory on the login node. ``base`` is
    resolved once for all of them (only the preset differs).
    """
    if not presets:
        raise UsageError("tune needs at least one preset")
    problems = []
    for name in presets:
        try:
            render(base.with_request(preset=name, run_dir="/tmp/pbstk-tune-check"), runner)
        except PbstkError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise UsageError("cannot tune: " + "; ".join(problems))


def run_tune(
    base: LaunchSettings | RenderRequest,
    presets: Sequence[str],
    *,
    concurrencies: Sequence[int] = (1, 8, 64),
    input_len: int = 128,
    output_len: int = 256,
    num_prompts: int | None = None,
    rounds: int = 4,
    client: str = "auto",
    timeout: float = 3600.0,
    baseline: str | None = None,
    progress: Progress = lambda _msg: None,
    store: JobStore | None = None,
    checkpoint: Callable[[TuneReport], None] | None = None,
    runner: Runner | None = None,
    images: ImageLoad | None = None,
) -> TuneReport:
    """Launch, wait, benchmark and cancel each preset in turn. Returns the report.

    ``images``: every request also carries these images (a vision-language model's image+text load).
    ``checkpoint`` receives the report after every preset, so a run cut short keeps what it measured.
    Everything goes through one transport: over SSH one connection (one MFA prompt) serves the whole run.
    ``base`` (a ``RenderRequest`` is resolved first) is resolved once for every preset.
    """
    base = settings_of(base)
    store = store or JobStore()
    # ``runner``: the caller's open transport (``Client``), kept open; else one of our own for the run
    with nullcontext(runner) if runner else open_runner(base.written.ssh_host) as runner:
        check_presets(base, presets, runner)
        started = time.time()
        runs: list[TuneRun] = []
        for name in presets:
            runs.append(_tune_one(base, name, runner, store, concurrencies, input_len, output_len, num_prompts,
                                  rounds, client, timeout, progress, images))
            doc = _document(base, started, input_len, output_len, concurrencies, baseline, runs)
            if images:
                doc.other["images"] = images.to_dict()
            if checkpoint is not None:
                checkpoint(doc)
    return doc


def _tune_one(base: LaunchSettings, name: str, runner: Runner, store: JobStore, concurrencies: Sequence[int],
              input_len: int, output_len: int, num_prompts: int | None, rounds: int, client: str,
              timeout: float, progress: Progress, images: ImageLoad | None = None) -> TuneRun:
    """Launch one preset, wait, benchmark, cancel; the run's entry (with ``error`` when it failed)."""
    def show_note(message: str) -> None:
        progress(f"[{name}] {message}")

    def show(s: Any, elapsed: float) -> None:
        progress(f"[{name}] {elapsed:5.0f}s {s.state.value} {s.phase or s.comment or ''}")

    job_name = f"{base.request.name or slug(base.model)}-{slug(name)}"[:63]
    progress(f"[{name}] launching")
    result = launch(base.with_request(preset=name, name=job_name), store=store, runner=runner)
    record = result.record
    entry = TuneRun(name, layout=result.rendered.preset.layout(), eager=result.rendered.preset.eager,
                    job_id=record.job_id, run_dir=record.run_dir)
    try:
        t0 = time.monotonic()
        st = wait_until_ready(record, timeout=timeout, store=store, runner=runner, on_progress=show)
        # the start's own seconds, without the queue, as status --json's startup phases count them
        entry.ready_s = ready_seconds(st.startup) or round(time.monotonic() - t0, 1)
        if st.startup:
            entry.other["startup"] = st.startup["phases"]
        entry.eager_fallback = st.eager_fallback
        progress(f"[{name}] ready after {entry.ready_s} s; benchmarking at {list(concurrencies)}")
        entry.results = benchmark_ready_job(st, concurrencies, input_len=input_len, output_len=output_len,
                                            num_prompts=num_prompts, rounds=rounds, client=client,
                                            notice=show_note, runner=runner, images=images)
    except PbstkError as exc:
        entry.error = str(exc)
        progress(f"[{name}] failed: {exc}")
    finally:
        cancel(record, runner=runner)
        _wait_gone(record, store, runner)
    return entry


def _document(base: LaunchSettings, started: float, input_len: int, output_len: int,
              concurrencies: Sequence[int], baseline: str | None, runs: list[TuneRun]) -> TuneReport:
    doc = TuneReport(model=base.model, profile=base.request.profile, started=started,
                     duration_s=round(time.time() - started, 1), input_len=input_len, output_len=output_len,
                     concurrencies=list(concurrencies), vllm_args=list(base.request.vllm_args),
                     baseline=baseline or pick_baseline(runs), runs=list(runs))
    doc.recommended = recommend(doc)
    return doc


def _wait_gone(record: Any, store: JobStore, runner: Runner, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if status([record], store, runners={record.transport: runner})[0].state.final:
            return
        time.sleep(1.0)


def merge(earlier: TuneReport, later: TuneReport, baseline: str | None = None) -> TuneReport:
    """Add ``later``'s runs to ``earlier`` (runs split over several allocations); same method required."""
    for key in ("model", "input_len", "output_len", "concurrencies"):
        if getattr(earlier, key) != getattr(later, key):
            raise UsageError(f"cannot append: {key} differs ({getattr(earlier, key)!r} vs {getattr(later, key)!r})")
    if earlier.other.get("images") != later.other.get("images"):
        raise UsageError(f"cannot append: images differ ({earlier.other.get('images')!r} vs "
                         f"{later.other.get('images')!r})")
    doc = replace(earlier, runs=earlier.runs + later.runs,
                  duration_s=round(earlier.duration_s + later.duration_s, 1))
    doc.baseline = baseline or pick_baseline(doc.runs)
    doc.recommended = recommend(doc)
    return doc


def pick_baseline(runs: Sequence[TuneRun]) -> str | None:
    """The eager preset if one ran (the seed baseline), else the first."""
    for run in runs:
        if run.eager and run.results:
            return run.preset
    return runs[0].preset if runs else None


def recommend(doc: TuneReport) -> str | None:
    """Highest output tokens/s at the highest concurrency measured."""
    top = max(doc.concurrencies) if doc.concurrencies else None
    best, best_value = None, -1.0
    for run in doc.runs:
        value = run.throughput(top) if top is not None else None
        if value is not None and value > best_value:
            best, best_value = run.preset, value
    return best


def _row(run: TuneRun, baseline: TuneRun | None, concurrencies: list[int]) -> list[str]:
    """One preset's table row: its tokens/s and ratio to the baseline per level, then TTFT at the lowest."""
    row = [run.preset + (" (baseline)" if run is baseline else ""), run.layout,
           str(run.ready_s) if run.ready_s is not None else "-"]
    for c in concurrencies:
        value = run.throughput(c)
        base = baseline.throughput(c) if baseline else None
        row.append(f"{value:.1f}" if value is not None else "failed" if run.error else "-")
        row.append(f"{value / base:.2f}" if value is not None and base else "-")
    first = [r for r in run.results if r.concurrency == min(concurrencies)]
    ttft = first[0].median_ttft_ms if first else None
    row.append(f"{ttft:.1f}" if isinstance(ttft, (int, float)) else "-")
    return row


def render_table(doc: TuneReport) -> str:
    """Side-by-side table: ready time, output tok/s per concurrency, ratio against the baseline."""
    concurrencies = doc.concurrencies
    baseline = doc.run(doc.baseline)
    headers = ["preset", "layout", "ready s"]
    for c in concurrencies:
        headers += [f"c={c} tok/s", f"c={c} x"]
    headers += ["TTFT p50 ms (c=1)"]
    rows = [_row(run, baseline, concurrencies) for run in doc.runs]

    shape = doc.other.get("images")
    with_images = (f" + {ImageLoad(**shape).describe()} a request" if isinstance(shape, dict) else "")
    lines = [f"model {doc.model}, {doc.input_len} in{with_images} / {doc.output_len} out tokens, "
             f"output tokens/s (single runs); x = ratio to {doc.baseline or '-'}", "",
             table(rows, headers)]
    lines += [f"{run.preset}: {run.error}" for run in doc.runs if run.error]
    lines += [f"{run.preset}: {note}" for run in doc.runs for level in run.results if (note := level.outside_note())]
    if doc.recommended:
        lines += ["", f"recommended: {doc.recommended} (highest output tokens/s at c={max(concurrencies)})"]
    return "\n".join(lines)


def save_result(doc: TuneReport, path: str | None) -> Path:
    if path is None:
        out_dir = paths.user_data_dir() / "tune"
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / f"{slug(doc.model)}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    else:
        target = Path(path)
    target.write_text(json.dumps(doc.to_dict(), indent=2) + "\n", encoding="utf-8")
    return target


def merged_report(reports: Sequence[str], baseline: str | None, output: str | None,
                  progress: Callable[[str], None]) -> TuneReport:
    """Saved results merged into one document (same method), compared against ``baseline``; saved to ``output``
    when given (``progress`` hears ``saved PATH``): ``tune --report``."""
    if not reports:
        raise UsageError("tune_report needs at least one saved result")
    doc = load_result(reports[0])
    for extra in reports[1:]:
        doc = merge(doc, load_result(extra), baseline)
    if baseline:
        doc.baseline = baseline
    if output:
        progress(f"saved {save_result(doc, output)}")
    return doc


def load_result(path: str) -> TuneReport:
    """A report saved by ``tune`` (any version so far). Raises ``UsageError`` when it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a tune result: {exc}") from exc
    if not isinstance(doc, dict) or "runs" not in doc or "concurrencies" not in doc:
        raise UsageError(f"{path}: not a tune result (no 'runs')")
    try:
        return TuneReport.from_dict(doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: not a tune result: bad field {exc}") from exc


def require_matplotlib() -> None:
    """Refuse ``--png`` before anything is launched when matplotlib cannot be imported: a chart that fails only
    after an hour of tuning wastes the hour's allocation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        raise UsageError("--png needs matplotlib: pip install 'pbs-toolkit[plot]'") from None


def plot(doc: TuneReport, out: str) -> str:
    """A grouped bar chart of output tokens/s per preset and concurrency (needs matplotlib)."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    runs = doc.runs
    concurrencies = doc.concurrencies
    width = 0.8 / max(1, len(runs))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        values = [run.throughput(c) or 0.0 for c in concurrencies]
        ax.bar([x + i * width for x in range(len(concurrencies))], values, width, label=run.preset)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(concurrencies))])
    ax.set_xticklabels([f"c={c}" for c in concurrencies])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{doc.model} ({doc.input_len} in / {doc.output_len} out)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def tune(req: LaunchSettings | RenderRequest, presets: Sequence[str], *, store: JobStore, runner: Runner,
         progress: Callable[[str], None], save: bool = False, output: str | None = None, append: bool = False,
         baseline: str | None = None, **options: Any) -> TuneReport:
    """``run_tune`` saved as ``Client.tune`` promises: ``save`` under pbstk's data dir; ``output`` there instead,
    after each preset too (an interrupted tune keeps what it measured); ``append`` merges into the runs already
    in ``output``. ``progress`` hears each step, and ``saved PATH`` at the end. ``options``: ``run_tune``'s."""
    earlier = load_result(output) if append and output and os.path.exists(output) else None

    def checkpoint(partial: TuneReport) -> None:
        save_result(merge(earlier, partial, baseline) if earlier else partial, output)

    doc = run_tune(req, list(presets), baseline=baseline, progress=progress,
                   checkpoint=checkpoint if output else None, store=store, runner=runner, **options)
    if earlier is not None:
        doc = merge(earlier, doc, baseline)
    if save or output:
        progress(f"saved {save_result(doc, output)}")
    return doc
