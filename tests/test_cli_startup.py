"""``pbstk --help`` stays cheap: registering the commands imports the CLI layer only, never the schedulers,
transports, job store or client (they are imported inside the command that needs them). How fast it is, is
measured by benchmarks/cpu/bench_cli.py; this test pins what may be imported, which does not depend on the machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pbs_toolkit.cli.main import cli

#: what ``pbstk --help`` may import from the package: the CLI modules and leaf helpers (``version``: the
#: version string alone, which ``--version`` prints)
ALLOWED = {"pbs_toolkit", "pbs_toolkit.errors", "pbs_toolkit.durations", "pbs_toolkit.textutil", "pbs_toolkit.version"}
#: stdlib modules that only a running command needs (sockets, JSON, logging, temporary files)
HEAVY_STDLIB = {"socket", "ssl", "json", "logging", "tempfile", "subprocess", "secrets", "hashlib"}

PROBE = """
import sys
sys.argv = ["pbstk", "--help"]
from pbs_toolkit.cli.main import main
try:
    main()
except SystemExit:
    pass
print("\\n".join(sorted(sys.modules)), file=sys.stderr)
"""


def test_help_imports_no_backend_transport_or_client() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)  # noqa: S603
    assert "Usage: pbstk" in result.stdout
    loaded = set(result.stderr.split())
    ours = {m for m in loaded if m.startswith("pbs_toolkit")}
    extra = {m for m in ours - ALLOWED if not m.startswith("pbs_toolkit.cli")}
    assert extra == set(), f"pbstk --help imported {sorted(extra)}: import them inside the command"
    assert loaded & HEAVY_STDLIB == set()
    commands = sorted(m for m in ours if m.endswith("_cmds"))
    assert commands == [], f"pbstk --help imported command modules {commands}: cli/index.py lists them"


def test_the_index_names_each_commands_module_and_help() -> None:
    """cli/index.py is what --help lists and where a command is looked up: it must match the commands."""
    import inspect

    from pbs_toolkit.cli.index import INDEX
    from pbs_toolkit.cli.main import load_all

    group = load_all()
    assert set(INDEX) == set(group.commands)
    for name, command in group.commands.items():
        entry = INDEX[name]
        assert command.callback is not None and command.callback.__module__ == f"pbs_toolkit.cli.{entry.module}"
        assert command.hidden == entry.hidden, name
        if not command.hidden:
            first = inspect.cleandoc(command.short_help or command.help or "").split("\n\n")[0]
            assert entry.summary == " ".join(first.split()), f"{name}: cli/index.py's summary is not its help's"


def test_the_lazy_listing_is_clicks_own() -> None:
    """``pbstk --help`` from the index reads exactly as click's listing of the imported commands."""
    probe = """
import click
from click.testing import CliRunner
from pbs_toolkit.cli.main import cli, load_all
lazy = CliRunner().invoke(cli, ["--help"], prog_name="pbstk").output
load_all()
eager = click.Group("pbstk", commands=dict(cli.commands), help=cli.help, params=cli.params,
                    context_settings=cli.context_settings)
print(lazy == CliRunner().invoke(eager, ["--help"], prog_name="pbstk").output and "Commands:" in lazy)
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)  # noqa: S603
    assert result.stdout.strip() == "True", result.stderr


def test_lazy_choices_still_list_and_check_the_backends_and_streams() -> None:
    from pbs_toolkit.jobs.logs import streams
    from pbs_toolkit.schedulers import BACKENDS, stream_aliases

    shown = CliRunner().invoke(cli, ["logs", "--help"]).stdout
    for name in streams():
        assert name in shown, name
    assert set(stream_aliases()) <= set(streams())
    refused = CliRunner().invoke(cli, ["logs", "--stream", "nosuch"])
    assert refused.exit_code == 2 and "nosuch" in refused.output
    for name in BACKENDS:
        assert name in CliRunner().invoke(cli, ["launch", "--help"]).stdout


#: what ``pbstk logs JOB -n N`` may import from the package, beyond what ``--help`` does, for a job on this machine
#: that JOB names by id or name: the job store, the local files (not the runner: it runs commands) and the log
#: reader. Its bar is 1.5x ``pbstk --version`` on a 1 GB log (benchmarks/cpu/bench_logs.py); the client, the
#: service code, the scheduler backends, the registries, status and HTTP are not needed to read a file.
LOGS_ALLOWED = ALLOWED | {
    "pbs_toolkit.paths", "pbs_toolkit.envvars",
    "pbs_toolkit.jobs", "pbs_toolkit.jobs.store", "pbs_toolkit.jobs.store_sql", "pbs_toolkit.jobs.records",
    "pbs_toolkit.jobs.spec", "pbs_toolkit.jobs.launcher", "pbs_toolkit.jobs.run_markers", "pbs_toolkit.jobs.logs",
    "pbs_toolkit.jobs.nodes",
    "pbs_toolkit.transports", "pbs_toolkit.transports.base", "pbs_toolkit.transports.local_files",
}
#: never needed to print the end of a local file: running commands (subprocess, the command log's logging),
#: temporary files (tempfile, with shutil and the compressors), and on Linux with the XDG directories set (as
#: here) platformdirs, which pbs_toolkit/paths.py need not ask then
LOGS_FORBIDDEN = {"ssl", "http.client", "hashlib", "secrets", "jinja2", "yaml", "paramiko", "httpx", "requests",
                  "rich", "filelock", "prometheus_client", "socket", "subprocess", "logging", "tempfile", "shutil",
                  *(["platformdirs"] if sys.platform == "linux" else [])}


def test_logs_imports_only_what_reading_a_log_needs(tmp_path: Path) -> None:
    from pbs_toolkit.jobs.store import JobRecord, JobStore

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "vllm.log").write_text("".join(f"line {i}\n" for i in range(1000)))
    JobStore().add(JobRecord(job_id="7.local", scheduler="local", profile="local", model="m",
                             served_model_name="m", preset="cpu", name="tail", run_dir=str(run_dir)))
    probe = PROBE.replace('["pbstk", "--help"]', '["pbstk", "logs", "7.local", "-n", "3"]')
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)  # noqa: S603
    assert result.stdout == "line 997\nline 998\nline 999\n"
    loaded = set(result.stderr.split())
    ours = {m for m in loaded if m.startswith("pbs_toolkit") and not m.startswith("pbs_toolkit.cli")}
    assert ours - LOGS_ALLOWED == set(), f"pbstk logs imported {sorted(ours - LOGS_ALLOWED)}: only what it reads with"
    assert loaded & LOGS_FORBIDDEN == set()
    commands = sorted(m for m in loaded if m.endswith("_cmds"))
    assert commands == ["pbs_toolkit.cli.logs_cmds"], commands
