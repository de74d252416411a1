"""The text form of ``qstat -x -f``: where a batched ``-F json`` answer lists only its first job.

OpenPBS built from its main branch since early 2025 (openpbs issue #2672; 23.06.06 is not affected) prints only
the first job that ``qstat -x -f -F json ID1 ID2 ...`` finds: qstat stats one id at a time, and the JSON ``Jobs``
object is created with the first answer only, so every later job is dropped (rc 0, nothing on stderr). The text
format of the same query lists every job. pbstk then asks again for the jobs left out, in that format, and
remembers for a day, per transport (one login node talks to one server), that this server's batched JSON is
broken: later polls ask in text at once, so a poll stays one ``qstat`` call there too (docs/pbs.md).

``-w`` prints each attribute on one line (without it long values wrap at 80 columns with a tab; those
continuation lines are joined too). Values are text: ``_job`` reads numbers from strings as from JSON numbers.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pbs_toolkit import paths

#: a remembered "batched JSON lists only the first job" is tried again after this long (servers get upgraded)
REMEMBER_S = 24 * 3600.0
_ATTR = re.compile(r"^    ([A-Za-z_][\w-]*)(?:\.([\w.-]+))? = (.*)$")


def text_argv(job_ids: Sequence[str]) -> list[str]:
    return ["qstat", "-x", "-f", "-w", *job_ids]


def parse_text(stdout: str) -> dict[str, dict[str, Any]]:
    """Jobs of ``qstat -f`` text, each as the JSON form's mapping (``Resource_List.walltime`` nested)."""
    jobs: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    last: tuple[str, str | None] | None = None
    for line in stdout.splitlines():
        if line.startswith("Job Id: "):
            current, last = jobs.setdefault(line[len("Job Id: "):].strip(), {}), None
            continue
        if current is None:
            continue
        if line.startswith("\t") and last is not None:  # a wrapped value goes on after a tab
            key, sub = last
            holder = current[key] if sub is not None else current
            holder[sub or key] += line[1:]
            continue
        match = _ATTR.match(line)
        if match is None:
            continue
        key, sub, value = match.groups()
        if sub is None:
            current[key] = value
        else:
            if not isinstance(current.get(key), dict):
                current[key] = {}
            current[key][sub] = value
        last = (key, sub)
    return jobs


def unknown_ids(stderr: str) -> set[str]:
    """The ids a ``qstat: Unknown Job Id X`` line names, by sequence number (qstat may add the server)."""
    return {m.group(1).split(".", 1)[0] for m in re.finditer(r"Unknown Job Id (\S+)", stderr)}


def _memory_path() -> Path:
    return paths.user_state_dir() / "pbs-json-batching.json"


def _memory() -> dict[str, Any]:
    try:
        data = json.loads(_memory_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def batching_broken(where: str) -> bool:
    """Whether the server behind ``where`` (a runner's name) was seen listing only the first job, lately."""
    seen = _memory().get(where)
    return isinstance(seen, dict) and isinstance(seen.get("since"), (int, float)) and \
        time.time() - seen["since"] < REMEMBER_S


def remember_broken(where: str, server: str) -> None:
    """Note that ``where``'s server (``server``: its name, for whoever reads the file) lists only the first job.
    A state directory that cannot be written only costs the next poll one more call."""
    memory = _memory()
    memory[where] = {"server": server, "since": time.time()}
    path = _memory_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memory, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def server_name(json_stdout: str) -> str:
    """``pbs_server`` of a ``-F json`` document (``""`` when it has none)."""
    try:
        return str(json.loads(json_stdout).get("pbs_server") or "")
    except (ValueError, AttributeError):
        return ""
