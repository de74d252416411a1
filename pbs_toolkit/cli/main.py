"""``pbstk``: the group, the error boundary, and command registration.

Every ``PbstkError`` becomes one line on stderr (plus any detail lines) and its documented exit code, and so does
every Click usage error (exit 2);
Ctrl-C exits 130. Heavy modules are imported inside commands so ``pbstk --help`` stays fast.
"""

from __future__ import annotations

from typing import Any

import click

from pbs_toolkit.cli.index import INDEX
from pbs_toolkit.errors import PbstkError
from pbs_toolkit.version import __version__


def one_line(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\r``, ``\\x1b``), as ``repr``
    writes it: a user value that reached a message (a path, a name with a newline) cannot split the error line
    or send terminal escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# a group called with nothing (``pbstk ssh``) shows its help, as Click does: that is no error line
HELP_NOT_ERROR: tuple[type[Exception], ...] = tuple(
    c for c in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if c is not None)


class OneLineUsageError(click.UsageError):
    """A usage error (missing argument, unknown command or option, bad value) shown as the one ``pbstk: error:``
    line every other error gets, instead of Click's ``Usage:`` / ``Try`` / ``Error:`` block; exit 2."""

    def __init__(self, error: click.UsageError) -> None:
        super().__init__(error.format_message(), error.ctx)

    def show(self, file: Any = None) -> None:
        hint = f" Try '{self.ctx.command_path} --help'." if self.ctx is not None else ""
        click.echo(f"pbstk: error: {one_line(self.format_message())}{hint}", err=True)


PASS_THROUGH: tuple[type[Exception], ...] = (OneLineUsageError, *HELP_NOT_ERROR)  # shown as they are


class PbstkGroup(click.Group):
    """The ``pbstk`` group: commands are imported when called (cli/index.py says where each one lives), the
    listing of ``pbstk --help`` comes from the index, and every ``PbstkError`` becomes one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(INDEX) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in INDEX:
            load(INDEX[cmd_name].module)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click lists commands, from the index's summaries, so ``--help`` imports no command module."""
        shown = [(name, INDEX[name].summary) for name in self.list_commands(ctx)
                 if name in INDEX and not INDEX[name].hidden]
        if shown:
            limit = formatter.width - 6 - max(len(name) for name, _ in shown)
            with formatter.section("Commands"):
                # a bare Command shortens the summary exactly as the real command's help would be
                formatter.write_dl([(name, click.Command(name, help=text).get_short_help_str(limit))
                                    for name, text in shown])

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except PASS_THROUGH:
            raise
        except click.UsageError as exc:  # pbstk's own options (``pbstk --bogus``)
            raise OneLineUsageError(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PASS_THROUGH:
            raise
        except click.UsageError as exc:  # an unknown command, a subcommand's arguments, options or values
            raise OneLineUsageError(exc) from None
        except PbstkError as exc:
            click.echo(f"pbstk: error: {one_line(exc.message)}", err=True)
            for line in exc.details:
                click.echo(f"  | {one_line(line)}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            _echo_notes(exc)
            click.echo("pbstk: interrupted", err=True)
            ctx.exit(130)
        except SystemExit as exc:  # a SIGTERM or SIGHUP that a launch held until its job was recorded
            _echo_notes(exc)
            raise


def _echo_notes(exc: BaseException) -> None:
    """The lines the library attached to an interrupt (``add_note``: which job was submitted meanwhile)."""
    for note in getattr(exc, "__notes__", ()):
        click.echo(one_line(note), err=True)


@click.group(cls=PbstkGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", prog_name="pbstk")
@click.option("-v", "--verbose", is_flag=True, envvar="PBSTK_VERBOSE",
              help="Show every scheduler and SSH command pbstk runs, on stderr (also PBSTK_VERBOSE=1).")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Serve models with vLLM on HPC clusters (or this machine) and point evaluations at them.

    \b
      pbstk launch Qwen/Qwen3-VL-2B-Instruct --preset dp4 --profile polaris
      pbstk logs -f                      # the newest job's realtime vLLM log
      pbstk update-endpoint              # wait until ready, then register it

    Settings come, in order, from flags, PBSTK_* variables, ~/.config/pbstk/config.yaml, the site profile,
    and package defaults. Exit codes: 0 ok, 1 error, 2 bad input, 3 scheduler, 4 SSH, 5 server failed,
    6 timeout, 7 unknown job, 8 registry, 9 scheduler did not answer, 10 job store unusable,
    11 weights not staged or corrupt.
    """
    if verbose:
        _show_commands(ctx)


def _show_commands(ctx: click.Context) -> None:
    """``-v``: the runners' command records go to stderr, as ``pbstk: ...`` lines, until this invocation ends."""
    import logging  # here, not at the top: pbstk --help need not pay for it

    from pbs_toolkit.transports.trace import COMMAND_LOG

    class EchoHandler(logging.Handler):
        """Log records on the stderr of the moment (Click's test runner swaps it)."""

        def emit(self, record: logging.LogRecord) -> None:
            try:
                click.echo(f"pbstk: {record.getMessage()}", err=True)
            except Exception:  # noqa: BLE001 - a log line must never break the command
                self.handleError(record)

    handler, level = EchoHandler(), COMMAND_LOG.level
    COMMAND_LOG.addHandler(handler)
    COMMAND_LOG.setLevel(logging.DEBUG)

    def restore() -> None:
        COMMAND_LOG.removeHandler(handler)
        COMMAND_LOG.setLevel(level)

    ctx.call_on_close(restore)


def load(module: str) -> None:
    """Import ``pbs_toolkit.cli.<module>`` and add its commands to the group (once)."""
    import importlib

    for command in importlib.import_module(f"pbs_toolkit.cli.{module}").COMMANDS:
        if command.name not in cli.commands:
            cli.add_command(command)


def load_all() -> click.Group:
    """Every command imported and registered (for what walks the whole tree: tests, documentation)."""
    for module in dict.fromkeys(entry.module for entry in INDEX.values()):
        load(module)
    return cli


def main() -> None:
    cli(prog_name="pbstk")


if __name__ == "__main__":  # pragma: no cover
    main()
