"""PRIVATE STAND-IN of ROUTER's ``services/router.py`` (branch wp-router wins at merge): just enough of the
contract's API to run the service layer's tests on this machine. Local runner only."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import PbstkError
from pbs_toolkit.transports import Runner


class RouterError(PbstkError):
    pass


@dataclass
class RouterInfo:
    host: str
    port: int
    prometheus_port: int
    pid: int
    policy: str
    run_dir: str
    transport: str = ""
    token: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouterInfo:
        return cls(**{k: d[k] for k in ("host", "port", "prometheus_port", "pid", "policy", "run_dir")},
                   transport=d.get("transport", ""), token=d.get("token", ""))


def _free_port(bind: str) -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])


def start_router(runner: Runner, run_dir: str, *, command: Sequence[str] = ("vllm-router",), bind: str = "127.0.0.1",
                 advertise: str | None = None, policy: str = "round_robin", worker_urls: Sequence[str] = (),
                 extra_args: Sequence[str] = (), timeout: float = 30.0) -> RouterInfo:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    port, prom = _free_port(bind), _free_port(bind)
    token = secrets.token_hex(16)
    argv = [*command, "--host", bind, "--port", str(port), "--prometheus-port", str(prom), "--policy", policy,
            *(["--worker-urls", *worker_urls] if worker_urls else []), *extra_args]
    try:
        with open(os.path.join(run_dir, "router.log"), "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,  # noqa: S603
                                    start_new_session=True, env={**os.environ, "PBSTK_ROUTER_TOKEN": token})
    except OSError as exc:
        raise RouterError(f"cannot start the router {command[0]!r}: {exc.strerror or exc}") from None
    info = RouterInfo(advertise or bind, port, prom, proc.pid, policy, run_dir, "", token)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RouterError(f"the router exited at once (code {proc.returncode}); see {run_dir}/router.log")
        try:
            with socket.create_connection((bind, port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        raise RouterError("the router did not answer in time")
    Path(run_dir, "router.json").write_text(json.dumps(info.to_dict()))
    return info


def router_alive(runner: Runner, info: RouterInfo) -> bool:
    # vllm-router sets its process title ("vllm::router"), which overwrites the environ area: the token cannot
    # be read back from /proc/PID/environ, so the stand-in also accepts that title
    try:
        env = Path(f"/proc/{info.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{info.pid}/cmdline").read_bytes()
        state = Path(f"/proc/{info.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":
        return False
    return f"PBSTK_ROUTER_TOKEN={info.token}".encode() in env or cmdline.startswith(b"vllm::router")


def stop_router(runner: Runner, info: RouterInfo, timeout: float = 10.0) -> bool:
    if not router_alive(runner, info):
        return False
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.waitpid(info.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not router_alive(runner, info):
            return True
        time.sleep(0.1)
    os.kill(info.pid, signal.SIGKILL)
    return True


class RouterAdmin:
    def __init__(self, base_url: str, timeout: float = 5.0) -> None:
        import requests

        self.base_url, self.timeout, self.session = base_url.rstrip("/"), timeout, requests.Session()

    def workers(self) -> list[str]:
        r = self.session.get(self.base_url + "/list_workers", timeout=self.timeout)
        r.raise_for_status()
        data = r.json()
        return list(data.get("urls") or data.get("workers") or []) if isinstance(data, dict) else list(data)

    def add_worker(self, url: str) -> None:
        r = self.session.post(self.base_url + "/add_worker", params={"url": url}, timeout=self.timeout)
        if r.status_code >= 400 and "already" not in r.text.lower():
            raise RouterError(f"add_worker {url}: {r.status_code} {r.text[:200]}")

    def remove_worker(self, url: str) -> None:
        self.session.post(self.base_url + "/remove_worker", params={"url": url}, timeout=self.timeout)

    def close(self) -> None:
        self.session.close()


@contextmanager
def open_admin(runner: Runner, info: RouterInfo) -> Iterator[RouterAdmin]:
    admin = RouterAdmin(info.url)
    try:
        yield admin
    finally:
        admin.close()
