"""`pbstk logs`: the last lines of a job's (or a service's) log, and follow mode; a module of its own so that
`pbstk logs -n 100` imports only what it reads with (tests/test_cli_startup.py keeps the list short)."""

from __future__ import annotations

import click

from pbs_toolkit.cli.complete import complete_job
from pbs_toolkit.cli.lazy import LazyChoice, log_streams
from pbs_toolkit.jobs.logs import SERVER_STREAMS


@click.command()
@click.argument("job", required=False, shell_complete=complete_job)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines from the end to show first.")
@click.option("--stream", type=LazyChoice(log_streams, known=SERVER_STREAMS), default="vllm", show_default=True,
              help="vllm, or the scheduler's job output (sched-out, sched-err; a scheduler's older names in the list, "
              "such as pbs-out, still work).")
@click.option("--node", type=int, default=None, metavar="K",
              help="On a job over several nodes: node K's vLLM log (0, the head's, is the default).")
@click.option("--replica", type=int, default=None, metavar="K",
              help="JOB names a service: replica K's job log instead of the router's.")
@click.option("--model", default=None, metavar="M",
              help="JOB names a multi-model service: the vLLM log of its model M (a served name), of the job "
              "holding it.")
def logs(job: str | None, follow: bool, lines: int, stream: str, node: int | None, replica: int | None,
         model: str | None) -> None:
    """The realtime vLLM log of JOB (default: the newest job), locally or over SSH.

    JOB may name a service (`pbstk serve`): its router's log, with --replica K that replica's (of a multi-model
    service: that job's first model's), with --model M that model's."""
    from pbs_toolkit.errors import UsageError

    if lines < 0:
        raise UsageError("-n must not be negative")
    if not follow and replica is None and model is None and _print_local_job_log(job, lines, stream, node):
        return
    from pbs_toolkit.cli import service_cmds
    from pbs_toolkit.client import Client

    notice = lambda m: click.echo(f"pbstk: {m}", err=True)  # noqa: E731
    with Client() as c:
        svc = service_cmds.named_service(c, job, replica)  # docs/services.md
        if model is not None and svc is None:
            raise UsageError(f"--model {model}: {job or 'the newest job'} is no service; --model picks a model of "
                             "a multi-model service (pbstk serve M1 M2 ... --name NAME)")
        if not follow:
            # -n 1000000: no second full copy of the text
            for piece in (c.service_log(svc, lines, replica=replica, pieces=True, stream=stream, node=node,
                                        model=model) if svc
                          else c.log_text(job, lines, stream=stream, node=node)):
                click.echo(piece, nl=False)
            return
        for line in (c.service_log(svc, lines, True, replica=replica, stream=stream, node=node, notice=notice,
                                   model=model)
                     if svc else c.logs(job, lines, follow=True, stream=stream, node=node, notice=notice)):
            click.echo(line)


def _print_local_job_log(job: str | None, lines: int, stream: str, node: int | None) -> bool:
    """``logs -n`` of a job on this machine that JOB names by id or name (or the newest job), without the
    client and the service code: half of the command's start (benchmarks/cpu/bench_logs.py). ``False``: anything
    else (an id prefix or a service's name, a run directory, a job over SSH), for the client to answer."""
    from pbs_toolkit.jobs.nodes import job_log_text
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.transports.local_files import LocalFiles  # reading a file needs no LocalRunner (subprocess)

    store = JobStore()
    record = None if job and "/" in job else store.job_named(job)
    if record is None or record.transport or (job and record.final_state and store.service_rows(job)):
        return False  # an ended job under a service's name: the client decides which one NAME means
    files = LocalFiles()
    for piece in job_log_text(record, lambda: files, lines, stream, node):
        click.echo(piece, nl=False)
    return True

COMMANDS = [logs]
