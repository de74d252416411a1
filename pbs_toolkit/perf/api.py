"""``Client``'s performance methods (``Client`` inherits them): ``metrics``, ``watch_metrics``, ``doctor``,
``bench``, ``tune``, each a delegation to perf/observe.py or perf/tune.py with the job's runner.

The class is a piece of the facade, kept beside the capability it fronts; what it uses of the rest of ``Client``
is declared below (``Client`` provides it), so this module never imports the client."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pbs_toolkit.jobs.render import RenderRequest
    from pbs_toolkit.jobs.status import JobStatus
    from pbs_toolkit.jobs.store import JobRecord, JobStore
    from pbs_toolkit.perf.images import ImageLoad
    from pbs_toolkit.perf.observe import BenchResult, Diagnosis, Metrics
    from pbs_toolkit.perf.tune import TuneReport
    from pbs_toolkit.results import Job
    from pbs_toolkit.settings.launch_settings import LaunchSettings
    from pbs_toolkit.transports import Runner


class PerfMethods:
    """Looking at and measuring READY jobs; ``Client`` provides the members declared here."""

    store: JobStore
    runner: Callable[[str], Runner]
    record: Callable[..., JobRecord]
    status: Callable[..., list[JobStatus]]
    ready_status: Callable[..., JobStatus]
    request: Callable[..., RenderRequest]
    _request_runner: Callable[[LaunchSettings], Runner]

    def metrics(self, job: Job | JobRecord | JobStatus | str | None = None, interval: float = 1.0) -> Metrics:
        """Two ``/metrics`` scrapes ``interval`` s apart: rates over the interval, latencies since start, and
        the last ``Engine`` lines of the log. A ``JobStatus`` is taken as READY (after ``wait``)."""
        from pbs_toolkit.perf.observe import metrics

        st = self._ready(job)
        return metrics(self.runner(st.record.transport), st, interval)

    def watch_metrics(self, job: Job | JobRecord | JobStatus | str | None = None, every: float = 5.0,
                      count: int = 0) -> Iterator[Metrics]:
        """A scrape every ``every`` s, each with the rates and latencies since the scrape before it; ``count``
        looks (0: until the caller stops iterating). One scrape is taken first as the starting point."""
        from pbs_toolkit.perf.observe import watch_metrics

        st = self._ready(job)
        return watch_metrics(self.runner(st.record.transport), st, every, count)

    def _ready(self, job: Job | JobRecord | JobStatus | str | None) -> JobStatus:
        """``job``'s READY status; a ``JobStatus`` is taken as it is (the caller has just waited for it)."""
        from pbs_toolkit.jobs.status import JobStatus

        return job if isinstance(job, JobStatus) else self.ready_status(job)

    def doctor(self, job: Job | JobRecord | JobStatus | str | None = None) -> Diagnosis:
        """Findings from the job's flags, log and metrics, and the preset to use instead (a ``JobStatus``: as
        it is, no status query of its own)."""
        from pbs_toolkit.jobs.status import JobStatus
        from pbs_toolkit.perf.observe import diagnose

        st = job if isinstance(job, JobStatus) else self.status(self.record(job))[0]
        return diagnose(self.runner(st.record.transport), st)

    def bench(self, job: Job | JobRecord | JobStatus | str | None = None, concurrencies: Sequence[int] = (1, 8, 64),
              *, input_len: int = 128, output_len: int = 256, num_prompts: int | None = None,
              client: str = "auto", notice: Callable[[str], None] | None = None,
              images: ImageLoad | None = None, server_time: bool | Sequence[JobStatus] = True) -> BenchResult:
        """Drive load against a READY job's endpoint, each concurrency in turn (``notice``: hears which load
        generator runs and why). A ``JobStatus`` is taken as READY (after ``wait``). ``images``: every request
        also carries these images (``perf.images.image_load``). ``server_time``: read vLLM's own time of each
        level from the server's ``/metrics``, or from these servers' together (a router's replicas: its own
        ``/metrics`` is not one vLLM's); ``False``: not at all."""
        from pbs_toolkit.perf.observe import bench

        st = self._ready(job)
        servers = server_time if isinstance(server_time, bool) else [
            (self.runner(s.record.transport), s) for s in server_time]
        return bench(self.runner(st.record.transport), st, concurrencies, input_len=input_len,
                     output_len=output_len, num_prompts=num_prompts, client=client, notice=notice or _info,
                     images=images, server_time=servers)

    def tune(self, model: str | RenderRequest, presets: Sequence[str], *, profile: str | None = None,
             concurrencies: Sequence[int] = (1, 8, 64), input_len: int = 128, output_len: int = 256,
             num_prompts: int | None = None, rounds: int = 4, client: str = "auto", timeout: float = 3600.0,
             baseline: str | None = None, progress: Callable[[str], None] | None = None,
             save: bool = False, output: str | None = None, append: bool = False,
             images: ImageLoad | None = None, **options: Any) -> TuneReport:
        """Launch, wait, benchmark and cancel each preset in turn; the report (``tune.run_tune``), whose
        ``to_dict`` is the JSON ``pbstk tune`` saves.

        ``save``: save the document under pbstk's data dir; ``output``: save it there instead, after each preset
        too, so an interrupted tune keeps what it measured; ``append``: merge into the runs already in
        ``output``. ``progress`` hears each step, and ``saved PATH`` at the end."""
        from pbs_toolkit.perf.tune import tune
        from pbs_toolkit.settings.launch_settings import resolve_launch_settings

        settings = resolve_launch_settings(self.request(model, None, profile, **options))
        return tune(settings, presets, store=self.store, runner=self._request_runner(settings),
                    progress=progress or _info,
                    save=save, output=output, append=append, baseline=baseline, concurrencies=list(concurrencies),
                    input_len=input_len, output_len=output_len, num_prompts=num_prompts, rounds=rounds,
                    client=client, timeout=timeout, images=images)

    @staticmethod
    def set_default_preset(model: str, preset: str) -> str:
        """Make ``preset`` the default for ``model`` in the user's config (``tune``'s winner, say); the file."""
        from pbs_toolkit.settings.config import save_default_preset

        return str(save_default_preset(model, preset))

    @staticmethod
    def tune_report(reports: Sequence[str], baseline: str | None = None, output: str | None = None,
                    progress: Callable[[str], None] | None = None) -> TuneReport:
        """Saved tune results merged into one document (same method), compared against ``baseline``; saved
        to ``output`` when given (``progress`` hears ``saved PATH``)."""
        from pbs_toolkit.perf.tune import merged_report

        return merged_report(reports, baseline, output, progress or _info)


def _info(message: str) -> None:
    """The default ``notice``/``progress``: a log line (the CLI passes its own)."""
    logging.getLogger("pbs_toolkit").info("%s", message)
