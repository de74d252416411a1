"""One of each (issue 29): one HTTP client, one ``/metrics`` scraper, one free-port rule, one router start path.

Each duplicate the issue names is checked gone by reading the package's text (``ast`` for Python): cheap, and
each check fails on the code that had the duplicate. The behaviour of each unified piece is tested where it
always was (tests/test_router.py, tests/test_observe*.py, tests/test_campaigns.py, tests/test_start_script.py,
tests/test_service_router_job.py).
"""

from __future__ import annotations

import ast
import re
import socket
import subprocess
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


def shell_functions(text: str) -> set[str]:
    return set(re.findall(r"^\s*(pbstk_\w+)\s*\(\)", text, re.MULTILINE))


def test_one_free_port_rule_in_the_start_scripts() -> None:
    """Every port search of the scripts that run on the nodes is ``server/start/free_port.sh``'s: no other file
    defines a port-picking function, and no Python asks the kernel for a free port (the snippet that was written
    both in ``services/router/process.py`` and ``start_router.sh``)."""
    pickers = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".sh", ".j2") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(PACKAGE).as_posix()
        if found := {f for f in shell_functions(text) if "port" in f}:
            pickers[rel] = found
        assert "getsockname" not in text, rel
    assert pickers == {"server/start/free_port.sh": {"pbstk_port_in_use", "pbstk_free_port"}}
    snippets = [rel for rel, tree in library_modules().items() for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "getsockname" in node.value]
    assert snippets == []


def test_the_free_port_rule_skips_ports_in_use_and_those_named(tmp_path: Path) -> None:
    """``pbstk_free_port`` (bash, as on a node): in a window of three loopback ports where one listens and one is
    named to avoid, it picks the third whatever its random start; with none left it fails and assigns nothing."""
    rule = PACKAGE / "server" / "start" / "free_port.sh"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(64)  # never accepted: the probes must not fill its backlog
        taken = busy.getsockname()[1]
        lo = taken - 1 if taken > 1024 else taken
        window = [lo, lo + 1, lo + 2]
        avoid = next(p for p in window if p != taken)
        script = (f'source {rule}\nfor _ in 1 2 3 4 5 6 7 8; do\n  P=none\n'
                  f'  pbstk_free_port P 127.0.0.1 {lo} {lo + 2} {avoid} && echo "$P"\ndone\n'
                  f'P=none; pbstk_free_port P 127.0.0.1 {taken} {taken} || echo "none left: $P"\n')
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,  # noqa: S603,S607
                             check=True).stdout.split("\n")
    free = [p for p in window if p not in (taken, avoid)]
    listening = set()
    for port in free:  # the third may be some other process's: then the rule must not pick it either
        with socket.socket() as probe:
            probe.settimeout(2)
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                listening.add(port)
    expected = [] if listening else [str(free[0])] * 8
    assert [line for line in out[:-2] if line] == expected, out
    assert out[-2] == "none left: none", out


def test_one_router_start_procedure() -> None:
    """A router started from here (``router: local``/``login``) and a router job run the same ``start_router.sh``:
    the router's command line is built only where that script is rendered (``services/router/script.py``), and
    ``start_router`` renders it."""
    modules = library_modules()
    builders = sorted(rel for rel, tree in modules.items() for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and called(node) == "router_argv")
    assert builders == ["services/router/script.py"]
    start = next(node for node in ast.walk(modules["services/router/process.py"])
                 if isinstance(node, ast.FunctionDef) and node.name == "start_router")
    assert "render_start_script" in {called(node) for node in ast.walk(start) if isinstance(node, ast.Call)}
