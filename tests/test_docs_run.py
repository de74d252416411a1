"""Docs that run (issue 44 item 3): every ``pbstk ...`` example of README.md and docs/*.md runs here, in this
process, against the stand-ins, and does what its doc says; one test per doc file, naming the examples that
failed. How examples are found and marked: tests/doc_examples.py and CONTRIBUTING.md "Examples in the docs run".

How an example runs: ``launch`` and ``serve`` with ``--dry-run`` added (every setting resolved and checked,
nothing submitted or connected to: a cluster's profile works here too); every other command as written, in a
directory with ``configs/`` and a ``models.yaml``, against a stand-in job (local scheduler, stand-in vLLM) that
is launched, as ``qwen`` unless a note names it, before the first example that needs one and again after a
``cancel``. Placeholders are filled: ``JOB``/``ID`` with that job's id, ``MODEL``/``M1``/``M2`` with models;
``[...]`` (an optional part) is left out."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from doc_examples import DOC_FILES, ROOT, Example, examples, stray_notes

from pbs_toolkit.cli.main import cli, load_all
from pbs_toolkit.jobs.store import JobStore

DRY_RUN = {"launch", "serve"}  # run with --dry-run added
NO_JOB = {"launch", "serve", "presets", "profiles", "config", "render", "adopt", "stage", "ssh", "clean", "run",
          "tune", "service"}  # every other command talks to the stand-in job
FOLLOWS = re.compile(r"(^|\s)(-f|--follow|--watch|--via-tunnel|tunnel)(\s|$)")
MODELS = {"MODEL": "Qwen/Qwen3-1.7B", "M1": "Qwen/Qwen3-0.6B", "M2": "Qwen/Qwen3-1.7B"}


def argv(text: str, job_id: str | None) -> list[str]:
    """The example's arguments after ``pbstk``, placeholders filled and optional parts left out."""
    words = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", text))[1:]
    fill = {**MODELS, **({"JOB": job_id, "ID": job_id} if job_id else {})}
    return [fill.get(word, word) for word in words]


def command_of(words: list[str]) -> str:
    return next((w for w in words if not w.startswith("-")), "")


class World:
    """One doc's examples in turn, sharing a working directory and the stand-in job."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.job_id: str | None = None
        self.job_name = ""

    def job(self, name: str) -> str:
        """The id of an active stand-in job called ``name``, launched when there is none."""
        if self.job_id and self.job_name == name and not JobStore().find(self.job_id).final_state:
            return self.job_id
        result = invoke(["launch", MODELS["MODEL"], "--profile", "local-gpu", "--name", name, "--port", "auto",
                         "--wait", "--timeout", "120"])
        assert result.exit_code == 0, f"the stand-in job {name} did not start: {result.output}"
        self.job_id, self.job_name = result.stdout.split()[1], name
        return self.job_id

    def run(self, example: Example) -> str | None:
        """Run one example; what went wrong, or None."""
        words = argv(example.text, None)
        command = command_of(words)
        if FOLLOWS.search(example.text):
            return ("runs until stopped (follows, watches or holds a tunnel): mark it "
                    "<!-- doc-test: skip (...) --> naming a test that covers it")
        job_id = None if command in NO_JOB else self.job(example.job)
        words = argv(example.text, job_id)
        if command in DRY_RUN and "--dry-run" not in words:
            words = [*words[:words.index("--") if "--" in words else len(words)], "--dry-run"]
        result = invoke(words)
        if command == "cancel" and result.exit_code == 0:
            self.job_id = None  # the next example that needs a job gets a new one
        return judge(example, result)


def invoke(words: list[str]) -> Result:
    return CliRunner().invoke(cli, words, prog_name="pbstk")


def judge(example: Example, result: Result) -> str | None:
    output = result.stdout + result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"raised {result.exception!r}"
    if result.exit_code != example.exit:
        return f"exit {result.exit_code}, the doc says {example.exit}: {output.strip()[-600:]}"
    missing = [text for text in example.prints if text not in output]
    if missing:
        return f"does not print {missing}: {output.strip()[-600:]}"
    return None


def parses(example: Example) -> str | None:
    """A skipped example's command, options and arguments exist (Click parses them; nothing runs)."""
    words = argv(example.text, "1.vm.local")
    command: click.Command = load_all()
    name, ctx = "pbstk", None
    try:
        while isinstance(command, click.Group):
            ctx = command.make_context(name, words, parent=ctx)
            rest = [*(ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args), *ctx.args]
            found, sub, words = command.resolve_command(ctx, rest)
            assert found is not None and sub is not None, rest
            name, command = found, sub
        command.make_context(name, words, parent=ctx)
    except click.UsageError as exc:
        return f"does not parse: {exc.format_message()}"
    return None


@pytest.fixture
def world(isolated_user: Path, standins: Path, fakepbs: Path, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> World:
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    (work / "models.yaml").write_text("models:\n  - Qwen/Qwen3-0.6B\n  - {model: Qwen/Qwen3-1.7B, name: q17}\n")
    monkeypatch.chdir(work)
    return World(work)


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_the_examples_of_a_doc_run_as_it_says(doc: Path, world: World) -> None:
    failures = []
    for example in examples(doc):
        problem = parses(example) if example.skip else world.run(example)
        if problem:
            failures.append(f"{example.where}\n    {problem}")
    failures += [f"{note}\n    applies to no example" for note in stray_notes(doc)]
    assert not failures, f"{doc.relative_to(ROOT)}: {len(failures)} example(s) fail:\n" + "\n".join(failures)
