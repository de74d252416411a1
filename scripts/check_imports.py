#!/usr/bin/env python3
"""House rules for the package's shape (issue 22): what a newcomer should find, checked with ``ast`` alone.

Prints, and exits 1 when there is any:

* every module of ``pbs_toolkit`` over 500 lines (data files and templates are not modules: ``.py`` only), and
  every function or method over 60 lines (its ``def`` to its last line, docstring included);
* every import cycle between ``pbs_toolkit`` modules, counting EVERY import: top-level, inside a function,
  under ``if TYPE_CHECKING:``. A function-level import only hides a circle, it does not remove it.
  One line per strongly connected group of modules, with one concrete circle through it;
* every ``from X import _name`` (or ``import X._mod``) that takes a private name from another module;
* every import that goes UP a floor of ``LAYERS`` (below), at module level or inside a function, and every
  top-level module or package that ``LAYERS`` does not place (a new one is given its floor here).
  An import under ``if TYPE_CHECKING:`` counts too: to name the type of a value a caller above passes in,
  declare a ``Protocol`` of what is used (``services/cancel_all.py``'s ``Stopper``, ``services/api.py``);
* every import, counted the same way, that goes UP a rung of ``RUNGS`` (below): the subpackages of one package,
  ordered the way ``LAYERS`` orders packages (``services/router`` below ``services/models`` below
  ``services/keeper``).

An edge goes to the module an import names: ``from pbs_toolkit.jobs import store`` is an edge to
``pbs_toolkit.jobs.store``, ``from pbs_toolkit.jobs.store import JobStore`` too. The package ``__init__`` a
dotted import also runs is not counted (``pbs_toolkit/__init__.py``'s lazy ``Client`` would otherwise close
a circle through every module).

    python scripts/check_imports.py [PACKAGE_DIR]     # default: the pbs_toolkit beside this script
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_LINES = 500
MAX_FUNCTION_LINES = 60

#: The floors, CONTRIBUTING.md "Layout: read this first" in one table: the first name under the package -> its
#: floor. A module imports its own package and packages on LOWER floors only; packages sharing a floor are peers
#: that do not import each other. Floor 0 is the neutral modules: they import only one another, all may use them.
#: A dotted name places one module apart from its package (it then obeys its own floor, not its package's).
LAYERS: dict[str, int] = {
    "__init__": 14, "__main__": 14,  # the package's lazy facade (`pbs_toolkit.Client`...), `python -m pbs_toolkit`
    "cli": 13,
    "scoped": 12,  # `launched`: a `with` block over a Client
    "campaigns.run": 12,  # `pbstk run`: like scoped, a sequence over the Client the CLI hands it
    "client": 11,
    "campaigns": 10,  # `usage`, counters, the lease: what Client reads (run.py sits above Client, floor 12)
    "services": 9,
    "endpoints": 8, "perf": 8,
    "results": 7,  # what the Python API hands back about jobs
    "jobs": 6,
    "weights": 5,  # staging and the launch-time preflight: profiles and runners
    "settings": 4,  # profiles validate their scheduler section through the backend registry below
    "schedulers": 3,  # backends: argv builders and parsers over a Runner; they read no settings
    "transports": 2, "vllm": 2,  # how commands run; what vLLM's logs and /metrics say
    "server": 1,  # what runs inside the job: imports only the neutral modules
    "errors": 0, "paths": 0, "envvars": 0, "durations": 0, "schema": 0, "signal_scope": 0, "textutil": 0,
    "version": 0,
    "settings.yamlio": 0,  # the YAML loader and the user's config.yaml: neutral, kept beside its main users
}

#: Inside a package, its subpackages as ``LAYERS`` has the packages: ``package.subpackage`` -> its rung. A module of
#: one imports its own subpackage and those on LOWER rungs, never a peer or one above. The package's modules outside
#: every rung (``services``' own top level: the service's life, record to stop) are not ranked: they may import any
#: rung, and any rung may import them (the cycle check still holds between modules).
RUNGS: dict[str, int] = {
    "services.keeper": 3,  # the keeper's ticks: replicas routed, replaced, scaled; reads models and the router
    "services.models": 2,  # multi-model services: specs, plan, packing, one job's models; knows the router's policies
    "services.router": 1,  # the router: its process, its job, admin API, start script and figures
}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package directory ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted name a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """``id`` of every import node under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), not its ``else``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING":
            found.update(id(sub) for part in node.body for sub in ast.walk(part))
    return found


def imports(module: str, path: Path, known: dict[str, Path], tree: ast.AST) -> Iterator[tuple[str, str, int, bool]]:
    """(imported module, name taken from it or "", line, under ``if TYPE_CHECKING:``) for every import anywhere
    in ``path`` (parsed: ``tree``)."""
    is_package = path.name == "__init__.py"
    typing_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        hint = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno, hint
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:  # ``from pkg import submodule``
                    yield sub, "", node.lineno, hint
                else:
                    yield source, alias.name, node.lineno, hint


def _floor_name(module: str) -> str:
    """The name ``LAYERS`` knows a module by: the first name under the package (``__init__`` for the package), or
    a longer dotted name that ``LAYERS`` places apart from its package (``settings.yamlio``)."""
    parts = module.split(".")
    if ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` (both inside the package) leaves its floor for one not below it."""
    mine, theirs = _floor_name(module), _floor_name(target)
    if mine == theirs or theirs not in LAYERS or mine not in LAYERS:
        return False
    return LAYERS[theirs] >= LAYERS[mine] and not LAYERS[mine] == LAYERS[theirs] == 0


def _rung(module: str) -> str:
    """The ``RUNGS`` name of the subpackage a module is in, or "" for one outside every rung."""
    name = ".".join(module.split(".")[1:3])
    return name if name in RUNGS else ""


def _up_a_rung(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` goes to a peer subpackage of its own or one above it."""
    mine, theirs = _rung(module), _rung(target)
    return bool(mine and theirs) and mine != theirs and RUNGS[theirs] >= RUNGS[mine]


def _unplaced(known: dict[str, Path]) -> list[str]:
    """Top-level names the floors do not place, when the package is one ``LAYERS`` describes at all."""
    names = {_floor_name(m) for m in known} - {"__init__"}
    return [] if not names & LAYERS.keys() else sorted(names - LAYERS.keys())


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def check(root: Path) -> list[str]:
    """Every problem, one line each (sizes, then cycles, then private imports, then floors)."""
    known = modules(root)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in known}
    private: list[str] = []
    layers = [f"layer: {root.name}.{name} is on no floor: give it one in LAYERS (scripts/check_imports.py)"
              for name in _unplaced(known)]
    for module, path in known.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, str(path))
        lines = len(text.splitlines())
        if lines > MAX_LINES:
            problems.append(f"size: {path.relative_to(root.parent)} has {lines} lines (over {MAX_LINES})")
        problems += _long_functions(tree, path, root)
        for target, name, line, hint in imports(module, path, known, tree):
            if target in known and target != module:
                graph[module].add(target)
            where = f"{path.relative_to(root.parent)}:{line}"
            if target in known and _upward(module, target) and f"{where} imports {target} " not in (
                    layers[-1] if layers else ""):
                layers.append(f"layer: {where} imports {target} from floor {LAYERS[_floor_name(target)]} "
                              f"above its own {_floor_name(module)} (floor {LAYERS[_floor_name(module)]})"
                              + (" under TYPE_CHECKING: declare a Protocol instead" if hint else ""))
            if target in known and _up_a_rung(module, target) and f"{where} imports {target} " not in (
                    layers[-1] if layers else ""):
                layers.append(f"layer: {where} imports {target} from {_rung(target)} (rung {RUNGS[_rung(target)]}) "
                              f"above its own {_rung(module)} (rung {RUNGS[_rung(module)]})"
                              + (" under TYPE_CHECKING" if hint else ""))
            if target != module and name and _private(name):
                private.append(f"private: {where} imports {name} from {target}")
            elif not name and any(_private(part) for part in target.split(".")):
                private.append(f"private: {where} imports the private module {target}")
    for group in _cycles(graph):
        problems.append(f"cycle: {' -> '.join(_circle(graph, group))}  (group: {', '.join(sorted(group))})")
    return problems + private + layers


def _long_functions(tree: ast.AST, path: Path, root: Path) -> list[str]:
    """A line for each function of ``path`` (parsed: ``tree``) over :data:`MAX_FUNCTION_LINES`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"size: {path.relative_to(root.parent)}:{node.lineno} {node.name} has {length} lines "
                             f"(over {MAX_FUNCTION_LINES})")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return sorted(groups, key=lambda g: sorted(g))


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """One shortest circle through the group's first module, staying inside the group (breadth first)."""
    start = min(group)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return sorted(group)


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "pbs_toolkit"
    problems = check(root)
    for line in problems:
        print(line)
    if not problems:
        print(f"{root.name}: no module over {MAX_LINES} lines, no function over {MAX_FUNCTION_LINES}, no import "
              "cycle, no private cross-module import, no import up a floor or a rung")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
