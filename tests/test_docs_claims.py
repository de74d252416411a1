"""What the docs claim in prose, checked where tests/test_docs_run.py cannot (issue 44 item 3): a dry run refuses
the durations a real serve refuses, and every long option of every command is documented somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.cli.main import load_all

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("value", ["0", "off", "1e3", "0.4"])
def test_a_dry_run_refuses_the_scale_down_idle_a_serve_refuses(value: str) -> None:
    """docs/settings.md "Durations": ``--scale-down-idle`` has no zero or off; ``--dry-run`` took them before."""
    for extra in ((), ("--dry-run",)):
        result = pbstk("serve", MODEL, "--profile", "local-gpu", "--min-replicas", "1", "--max-replicas", "2",
                       "--scale-down-idle", value, *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert result.stderr.startswith("pbstk: error: --scale-down-idle"), (extra, result.stderr)


def test_a_dry_run_takes_a_scale_down_idle_duration() -> None:
    result = pbstk("serve", MODEL, "--profile", "local-gpu", "--min-replicas", "1", "--max-replicas", "2",
                   "--scale-down-idle", "90s", "--dry-run")
    assert result.exit_code == 0, result.output


def long_options(group: click.Group, path: str = "pbstk") -> dict[str, set[str]]:
    """``--name`` -> the commands that take it, for every command of ``group`` (hidden ones too: a user may
    meet them in an error line)."""
    found: dict[str, set[str]] = {}
    ctx = click.Context(group, info_name=path)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            for option, where in long_options(command, f"{path} {name}").items():
                found.setdefault(option, set()).update(where)
        for param in command.params:
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--") and opt != "--help":
                    found.setdefault(opt, set()).add(f"{path} {name}")
    return found


def test_every_long_option_of_every_command_is_documented() -> None:
    """Each long option ``--help`` lists appears in README.md or docs/*.md (a new one must be documented)."""
    text = "\n".join(path.read_text() for path in DOCS)
    options = long_options(load_all())
    assert "--dry-run" in options and "--scale-down-idle" in options  # the walk reaches the commands
    missing = {option: sorted(where) for option, where in options.items()
               if not re.search(re.escape(option) + r"(?![\w-])", text)}
    assert not missing, f"options in --help that no doc names: {missing}"
