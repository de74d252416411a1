"""The ``pbstk ...`` examples of README.md and docs/*.md, as tests/test_docs_run.py runs them (CONTRIBUTING.md
"Examples in the docs run").

An example is a line of a code block (fenced, or indented by four spaces after a blank line) that starts with
``pbstk `` (or ``$ pbstk ``), with any ``\\``-continued lines joined to it; ``eval "$(pbstk env)"`` counts as
``pbstk env``. On the line, ``# ...`` is a comment, ``a; b`` two examples, and ``| jq ...`` a pipe the test
leaves out. Lines that start ``pbstk:`` are what pbstk printed, not examples.

``<!-- doc-test: ... -->`` comments on the lines just before a block say what its examples need or promise:

* ``skip (REASON)``: not run here, for REASON (it is still parsed: its command and options must exist);
* ``exit N``: exits N (not 0); ``prints "TEXT"``: TEXT is in what it prints (``exit 2, prints "..."``);
* ``job NAME``: the stand-in job the examples talk to is called NAME (default ``qwen``);

each for every example of the block, or, after a quoted text (``"logs -f" skip (follows the log)``), for the
examples that contain that text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOTE = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->", re.DOTALL)
DIRECTIVE = re.compile(r'^(?:"(?P<only>[^"]+)"\s+)?(?P<body>.+)$', re.DOTALL)


@dataclass
class Example:
    """One command of a doc, with what the doc says about it."""

    doc: str  # README.md or docs/x.md
    line: int  # where its block starts (1-based)
    text: str  # the command as written, comment, pipe and continuations removed
    skip: str | None = None  # the reason it is not run
    exit: int = 0
    prints: list[str] = field(default_factory=list)
    job: str = "qwen"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


@dataclass
class Block:
    line: int
    body: list[str]
    notes: list[str]


def blocks(text: str) -> list[Block]:
    """The code blocks of a markdown text with the ``doc-test`` notes just before each."""
    lines = text.splitlines()
    found: list[Block] = []
    i, blank_before = 0, True
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            found.append(Block(i + 1, lines[i + 1:end], notes_before(lines, i)))
            i, blank_before = end + 1, False
            continue
        if line.startswith("    ") and blank_before:
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip() and
                                        end + 1 < len(lines) and lines[end + 1].startswith("    ")):
                end += 1
            found.append(Block(i + 1, [body[4:] for body in lines[i:end]], notes_before(lines, i)))
            i, blank_before = end, False
            continue
        blank_before = not line.strip()
        i += 1
    return found


def notes_before(lines: list[str], start: int) -> list[str]:
    """The ``doc-test`` notes on the lines before ``start`` (blank lines between them are fine)."""
    j = start - 1
    while j >= 0:
        if not lines[j].strip():
            j -= 1
        elif lines[j].rstrip().endswith("-->"):
            while j >= 0 and "<!--" not in lines[j]:
                j -= 1
            j -= 1
        else:
            break
    return NOTE.findall("\n".join(lines[j + 1:start]))


def commands(body: list[str]) -> list[str]:
    """The ``pbstk`` commands of a block's lines."""
    joined: list[str] = []
    for line in body:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line.strip())
    found = []
    for line in joined:
        line = line.removeprefix("$ ")
        if "$(pbstk " in line:
            line = line[line.index("$(pbstk ") + 2:].split(")")[0]
        if not line.startswith("pbstk "):
            continue
        for part in split_outside_quotes(strip_comment(line), ";"):
            part = split_outside_quotes(part, "|")[0].strip()
            if part.startswith("pbstk "):
                found.append(part)
    return found


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    return split_outside_quotes(line.replace(" #", " \0"), "\0")[0].rstrip()


def split_outside_quotes(line: str, sep: str) -> list[str]:
    parts, current, quote = [], "", ""
    for char in line:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == sep:
            parts.append(current)
            current = ""
            continue
        current += char
    return [*parts, current]


def apply(example: Example, note: str) -> None:
    """One ``doc-test`` note's promises on ``example`` (already known to be one it applies to)."""
    body = DIRECTIVE.match(note.strip())
    assert body is not None, note
    text = body["body"]
    if text.startswith("skip"):
        reason = re.match(r"skip\s*\((.+)\)\s*$", text, re.DOTALL)
        assert reason, f"{example.where}: a skip needs its reason in parentheses: {note!r}"
        example.skip = " ".join(reason[1].split())
        return
    if text.startswith("job "):
        example.job = text.split()[1]
        return
    for part in re.findall(r'exit \d+|prints "[^"]*"', text):
        if part.startswith("exit"):
            example.exit = int(part.split()[1])
        else:
            example.prints.append(part[len('prints "'):-1])
    assert re.fullmatch(r'\s*((exit \d+|prints "[^"]*")\s*,?\s*)+', text), f"{example.where}: bad note {note!r}"


def examples(path: Path) -> list[Example]:
    """Every example of one doc file, with its notes applied."""
    doc = str(path.relative_to(ROOT))
    found = []
    for block in blocks(path.read_text()):
        for text in commands(block.body):
            example = Example(doc, block.line, text)
            for note in block.notes:
                only = DIRECTIVE.match(note.strip())
                if only is not None and (only["only"] is None or only["only"] in text):
                    apply(example, note)
            found.append(example)
    return found


def stray_notes(path: Path) -> list[str]:
    """Notes that apply to no example (a typo in the quoted text, a block that moved away)."""
    stray = []
    for block in blocks(path.read_text()):
        texts = commands(block.body)
        for note in block.notes:
            only = DIRECTIVE.match(note.strip())
            if only is None or not texts or only["only"] is not None and not any(only["only"] in t for t in texts):
                stray.append(f"{path.name}:{block.line}: {note}")
    return stray
