"""One of each (issue 29): one HTTP client, one ``/metrics`` scraper, one free-port rule, one router start path.

Each duplicate the issue names is checked gone by reading the package's text (``ast`` for Python): cheap, and
each check fails on the code that had the duplicate. The behaviour of each unified piece is tested where it
always was (tests/test_router.py, tests/test_observe*.py, tests/test_campaigns.py, tests/test_start_script.py,
tests/test_service_router_job.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pbs_toolkit"
#: the one HTTP client of the package (everything that runs on this machine or talks through a runner)
HTTP_CLIENT = "transports/http.py"
#: HTTP that is not a request to one of our servers through a runner: the load generator's many concurrent
#: streams, and the Hub's ``config.json`` over the internet (both ``httpx``, a library, not hand-written)
OTHER_HTTP = {"perf/bench.py": {"httpx"}, "settings/model_size.py": {"httpx"}}
#: modules a client may not import beside ``transports/http.py``
HTTP_MODULES = {"http.client", "requests", "urllib.request", "httpx", "urllib3", "aiohttp"}


def library_modules() -> dict[str, ast.Module]:
    """Every module of the package outside ``server/`` (which runs inside jobs on the standard library)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith("server/"):
            found[rel] = ast.parse(path.read_text(encoding="utf-8"), rel)
    return found


def imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def called(node: ast.Call) -> str:
    """The name a call calls: ``f`` of ``f(...)`` and of ``mod.f(...)``."""
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def test_one_http_client_speaks_http() -> None:
    """No module but ``transports/http.py`` imports an HTTP library or writes an HTTP request line by hand."""
    offenders = []
    for rel, tree in library_modules().items():
        if rel == HTTP_CLIENT:
            continue
        for name in sorted(imported(tree) & HTTP_MODULES - OTHER_HTTP.get(rel, set())):
            offenders.append(f"{rel} imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and " HTTP/1." in node.value:
                offenders.append(f"{rel}:{node.lineno} writes an HTTP request line")
    assert offenders == []


def test_one_metrics_scraper_fetches_metrics() -> None:
    """``/metrics`` is requested in one place, ``transports/http.py``'s ``metrics_text`` (``perf/scrape.py``'s
    snapshots, the usage counters, the router's own figures and status's busy check come through it)."""
    requests_of_metrics = []
    for rel, tree in library_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and called(node) in ("http_request", "http_status") and any(
                    isinstance(a, ast.Constant) and a.value == "/metrics" for a in node.args):
                requests_of_metrics.append(rel)
    assert requests_of_metrics == ["transports/http.py"]
