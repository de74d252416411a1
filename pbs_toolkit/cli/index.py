"""Which module holds each ``pbstk`` command, and the line ``pbstk --help`` lists for it.

``pbstk --help`` (and every single command) imports only what it shows or runs: the group looks a command up
here and imports its module when it is called (click's lazily loaded subcommands), and lists the commands from
the summaries below without importing any. ``tests/test_cli_startup.py`` checks this index against the commands
themselves, so a summary that drifts from its command's help fails a test.
"""

from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    module: str  #: under ``pbs_toolkit.cli``
    summary: str  #: the first paragraph of the command's help, as click shortens it for the listing
    hidden: bool = False


INDEX: dict[str, Entry] = {
    "presets": Entry("render_cmds", (
        "List presets (shipped and ~/.config/pbstk/presets/*.yaml)."
    )),
    "profiles": Entry("render_cmds", (
        "List site profiles (shipped and ~/.config/pbstk/profiles/*.yaml)."
    )),
    "config": Entry("render_cmds", (
        "Your settings (flags, PBSTK_*, ~/.config/pbstk/config.yaml, profile) as pbstk resolves them."
    )),
    "render": Entry("render_cmds", (
        "Render the job script and start_vllm.sh for MODEL (nothing is submitted, nothing is connected to)."
    )),
    "adopt": Entry("render_cmds", (
        "Record JOB_ID, a job submitted by hand from RUN_DIR (written by `pbstk render -o RUN_DIR`), so that "
        "status, wait, logs, update-endpoint and cancel work on it; its API key is read from RUN_DIR/api_key."
    )),
    "stage": Entry("weights_cmds", (
        "Download MODEL (a Hub id) into the profile's hf_home on the login node and verify every file."
    )),
    "launch": Entry("job_cmds", (
        "Render, submit and record a vLLM server job for MODEL."
    )),
    "status": Entry("job_cmds", (
        "State of jobs: PENDING, STARTING, READY, FAILED, FINISHED, CANCELLED, LOST."
    )),
    "jobs": Entry("job_cmds", (
        "Jobs pbstk launched (from the local job store; no scheduler query)."
    )),
    "cancel": Entry("job_cmds", (
        "Stop jobs (or services) through their scheduler. Already-ended jobs are not an error."
    )),
    "logs": Entry("logs_cmds", (
        "The realtime vLLM log of JOB (default: the newest job), locally or over SSH."
    )),
    "wait": Entry("job_cmds", (
        "Wait until JOB's server answers; fail fast with the cause if it cannot."
    )),
    "serve": Entry("service_cmds", (
        "Serve MODEL as a service: N replica jobs behind one vllm-router, one URL and one key."
    )),
    "service": Entry("service_cmds", (
        "Services started with `pbstk serve` (status, cancel, update-endpoint and env take a service name "
        "too)."
    )),
    "_keeper": Entry("service_cmds", "", hidden=True),
    "update-endpoint": Entry("endpoint_cmds", (
        "Wait until JOB (default: the newest) is ready, then write its endpoint into a registry."
    )),
    "env": Entry("endpoint_cmds", (
        "Print `export` lines (OPENAI_BASE_URL, OPENAI_API_KEY, the registry's key variable) for JOB."
    )),
    "tunnel": Entry("endpoint_cmds", (
        "Forward a local port to JOB's server through the SSH connection; runs until Ctrl-C."
    )),
    "metrics": Entry("observe_cmds", (
        "Throughput, queue, KV cache and latency percentiles of JOB's server (from /metrics and its log)."
    )),
    "doctor": Entry("observe_cmds", (
        "Diagnose JOB's server from its flags, log and metrics; end with the preset to use and how."
    )),
    "bench": Entry("observe_cmds", (
        "Drive load against JOB's endpoint: output tokens/s, requests/s, TTFT and TPOT per concurrency."
    )),
    "tune": Entry("observe_cmds", (
        "Launch each preset for MODEL, benchmark them identically, and recommend the fastest."
    )),
    "clean": Entry("clean_cmds", (
        "Remove run directories and job records of jobs that ended (locally and over SSH)."
    )),
    "ssh": Entry("ssh_cmds", (
        "SSH connections pbstk keeps open between commands (one login, one MFA prompt, per working day)."
    )),
    "run": Entry("campaign_cmds", (
        "Launch MODEL (or --reuse a READY job or service), wait until READY, run COMMAND against it, then "
        "drain and cancel the server; pbstk exits with COMMAND's exit status."
    )),
    "usage": Entry("campaign_cmds", (
        "Nodes, GPUs, wall time (from the scheduler's own accounting), node- and GPU-hours, requests and "
        "tokens (from the server's counters, recorded before each cancel) per job and per service, with "
        "totals."
    )),
}
