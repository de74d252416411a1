"""pbstk's router front: vllm-router in a private network namespace, reachable only through this process.

vllm-router's admin API (``/add_worker``, ``/remove_worker``, ...) has no authentication and shares the proxy port,
so on a shared host any user who can connect to that port could add a worker of theirs and receive prompts with
the clients' key. This front takes the router off the host's network instead:

* it binds the public port (and the public Prometheus port) on the host, then moves into an unprivileged user
  namespace and, in one thread, a new network namespace with only its own loopback: the router is started from
  that thread, so it listens where no other process on the host can connect (nor can anyone else's router);
* requests on the public port are passed on, one per connection, only when they are service traffic (``/v1/...``,
  ``/health``, ``GET /list_workers``, ...). Every other path (``/add_worker``, ``/remove_worker``, ``/workers``,
  ``/flush_cache``, ...) needs the header ``X-Pbstk-Router-Token`` with the router's token (from the environment,
  ``PBSTK_ROUTER_TOKEN``: pbstk keeps it in the owner's 0600 files), else ``403``;
* the router has no other way out of its namespace: it reaches its workers through this process as its HTTP proxy
  (``http_proxy`` points at a port inside the namespace), which connects from the host's network. A ``grpc://``
  worker, which would not use the proxy, is unreachable from inside.

Standard library only (Python 3.7+, Linux): it runs on the router's host, where pbstk itself may not be installed.
Usage: ``python3 router_front.py BIND PORT PROM_PORT -- ROUTER_COMMAND...`` (pbstk appends the router's own
``--host/--port/--prometheus-*`` inside the namespace). It exits with the router's status.
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any
from urllib.parse import urlsplit

try:  # the package's copy (tests, mypy); on the router's host the files lie side by side in the run directory
    from .router_models import ModelList
    from .router_relay import (
        BadRequest,
        Conn,
        Pump,
        Stale,
        Unreachable,
        Upstreams,
        accept_loop,
        answer,
        both_ways,
        dial,
        exchange,
        ready,
        refuse,
        shut,
    )
except ImportError:
    from router_models import ModelList  # type: ignore[no-redef]
    from router_relay import (  # type: ignore[no-redef]
        BadRequest,
        Conn,
        Pump,
        Stale,
        Unreachable,
        Upstreams,
        accept_loop,
        answer,
        both_ways,
        dial,
        exchange,
        ready,
        refuse,
        shut,
    )

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
TOKEN_ENV = "PBSTK_ROUTER_TOKEN"
TOKEN_HEADER = b"x-pbstk-router-token"
#: service traffic: what anyone who reaches the public port may ask (the replicas check the service's key)
PUBLIC_PREFIXES = ("/v1/",)
PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/liveness", "/readiness", "/generate",
                          "/get_model_info", "/get_server_info"})
PUBLIC_GET = frozenset({"/list_workers"})
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
                        b"proxy-authenticate", b"te", b"upgrade"})
HEAD_WAIT_S = 60.0
#: the router's multi-model mode (pbstk's multi-model services): the front answers ``GET /v1/models`` itself
IGW_FLAG = "--enable-igw"
PROCESSES_ENV = "PBSTK_ROUTER_FRONT_PROCESSES"
MAX_PROCESSES = 4
PR_SET_PDEATHSIG = 1


def log(message: str) -> None:
    print(f"pbstk-router-front: {message}", file=sys.stderr, flush=True)


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def enter_user_namespace() -> None:
    """This process into a new user namespace where it keeps its own uid and gid (and may create a network one)."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def enter_network_namespace() -> None:
    """The calling thread (only) into a new network namespace, its loopback up."""
    _unshare(CLONE_NEWNET)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))  # SIOCSIFFLAGS: IFF_UP


def inside_ports(n: int) -> list[int]:
    """``n`` free ports on the namespace's loopback (nothing else lives there: no race with other processes)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s


def parse_head(head: bytes) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]:
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest(400, "Bad Request", "malformed request line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "Bad Request", "malformed header")
        headers.append((name.lower(), value.strip()))
    return parts[0], parts[1], parts[2], headers


def body_framing(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length, or None for a chunked body; refuses what two parsers could read differently."""
    lengths = [v for n, v in headers if n == b"content-length"]
    codings = [v for n, v in headers if n == b"transfer-encoding"]
    if codings:
        if lengths or len(codings) != 1 or codings[0].lower() != b"chunked":
            raise BadRequest(400, "Bad Request", "unsupported Transfer-Encoding")
        return None
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        raise BadRequest(400, "Bad Request", "bad Content-Length")
    return int(lengths[0]) if lengths else 0


def rebuild(method: bytes, target: bytes, version: bytes, headers: list[tuple[bytes, bytes]], host: bytes,
            close: bool = True) -> bytes:
    kept = [(n, v) for n, v in headers if n not in HOP_BY_HOP and n != TOKEN_HEADER and n != b"host"]
    lines = [b" ".join((method, target, version)), b"host: " + host]
    lines += [n + b": " + v for n, v in kept]
    lines.append(b"connection: close" if close else b"connection: keep-alive")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def allowed(method: bytes, path: str) -> bool:
    if path.startswith(PUBLIC_PREFIXES) or path in PUBLIC_PATHS:
        return True
    return method == b"GET" and path in PUBLIC_GET


class Front:
    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.router_port = 0
        self.router_prom_port = 0
        self.pump: Pump
        self.upstreams = Upstreams()
        #: the router's multi-model mode (``--enable-igw``): ``GET /v1/models`` is answered by :meth:`models`
        self.models_mode = False
        self.listing = ModelList()
        self.proxy_port = 0

    def inside(self, port: int) -> socket.socket:
        """A connection to ``port`` on the namespace's loopback (made by a thread that lives there)."""
        return ready(socket.create_connection(("127.0.0.1", port), 10))

    def public(self, sock: socket.socket) -> None:
        """The public port: service traffic to the router; anything else only with the router's token."""
        client = Conn(sock)
        stage = "reading the client's request head"
        try:
            sock.settimeout(HEAD_WAIT_S)  # a client that never finishes its head does not hold a connection for ever
            head = client.read_until(b"\r\n\r\n")
            sock.settimeout(None)
            method, target, version, headers = parse_head(head)
            path = target.split(b"?", 1)[0].decode("ascii", "replace")
            if not path.startswith("/") or "%" in path or "/." in path or "//" in path or "\\" in path:
                raise BadRequest(400, "Bad Request", "pbstk router front: this path is not passed on")
            if not allowed(method, path):
                given = [v for n, v in headers if n == TOKEN_HEADER]
                if not (len(given) == 1 and hmac.compare_digest(given[0], self.token)):
                    raise BadRequest(403, "Forbidden",
                                     f"pbstk router front: {path} is the router's admin API: its owner only")
            length = body_framing(headers)
            if self.models_mode and method == b"GET" and path == "/v1/models":
                stage = "listing the models of every worker"
                status, body = self.listing.answer(headers, self.inside(self.router_port), self.proxy_port)
                sock.sendall(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n" % (status, b"OK" if status == 200 else b"Error",
                                                                  len(body)) + body)
                return
            try:
                upstream = self.inside(self.router_port)
            except OSError:
                raise BadRequest(502, "Bad Gateway", "pbstk router front: the router is not answering yet") from None
            what = f"{method.decode('ascii', 'replace')} {path}"
            stage = f"relaying {what} to the router and its answer back"
            request = rebuild(method, target, version, headers, b"127.0.0.1")
            # a request whose body is all at hand goes once more, on a fresh connection, when the router ends the
            # connection before any byte of its answer (on an H100 under a c=512 burst vllm-router reset 1 of
            # 12,000; the client saw "server disconnected"). It may have reached a worker: at worst it runs twice.
            again = length is not None and len(client.buf) >= length
            try:
                exchange(client, request, length, upstream, self.pump, reused=again)
            except Stale as exc:
                log(f"the router ended a connection before answering {what} ({exc}): sent once more")
                exchange(client, request, length, self.inside(self.router_port), self.pump)
        except BadRequest as exc:
            answer(sock, exc.status, exc.reason, exc.text)
        except (ConnectionError, OSError, ValueError) as exc:
            # the connection just ends: said in the log, so that a client's "server disconnected" has a cause
            log(f"a connection ended while {stage}: {type(exc).__name__}: {exc}")

    def egress(self, sock: socket.socket) -> None:
        """The router's HTTP proxy (inside the namespace): its requests to workers, sent from the host's network."""
        client = Conn(sock)
        try:
            method, target, version, headers = parse_head(client.read_until(b"\r\n\r\n"))
            if method == b"CONNECT":  # an https:// worker: a tunnel to that host and port
                host, _, port = target.decode("ascii").rpartition(":")
                up = dial(host.strip("[]"), int(port))
                sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                up.sendall(client.buf)
                both_ways(sock, up)
                return
            url = urlsplit(target.decode("ascii"))
            if url.scheme != "http" or not url.hostname:
                raise BadRequest(400, "Bad Request", "pbstk router front: only http:// targets")
            origin = (url.path or "/") + (f"?{url.query}" if url.query else "")
            length = body_framing(headers)
            key = (url.hostname, url.port or 80)
            # a body all at hand (the usual case): the worker's connection is kept for the next request
            keep = version == b"HTTP/1.1" and length is not None and len(client.buf) >= length
            kept = self.upstreams.get(*key) if keep else None
            head = rebuild(method, origin.encode(), version, headers, url.netloc.encode(), not keep)
            put = (lambda up: self.upstreams.put(*key, up)) if keep else None
            if kept is not None:
                try:  # a kept connection the worker closed just as it was reused: once more on a fresh one
                    exchange(client, head, length, kept, self.pump, put, method, reused=True)
                    return
                except Stale:
                    pass
            exchange(client, head, length, dial(*key), self.pump, put, method)
        except Unreachable:  # as a dead worker's refusal would reach the router without the front: it retries
            refuse(sock)
        except BadRequest as exc:  # nothing was sent back yet: an answer of our own
            answer(sock, exc.status, exc.reason, exc.text)
        except (ConnectionError, OSError, ValueError):
            pass  # mid-answer: the connection just ends, as the worker's did

    def prometheus(self, sock: socket.socket) -> None:
        """The public Prometheus port: a plain relay to the router's metrics endpoint (read-only)."""
        try:
            up = self.inside(self.router_prom_port)
        except OSError:
            return
        both_ways(sock, up)


def start_router(command: list[str], router_port: int, prom_port: int, proxy_port: int) -> subprocess.Popen[bytes]:
    """The router, started from the namespace's thread (so it lives in that namespace)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proxy = f"http://127.0.0.1:{proxy_port}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env[name] = proxy
    env["no_proxy"] = env["NO_PROXY"] = ""
    argv = [*command, "--host", "127.0.0.1", "--port", str(router_port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)  # noqa: S603 - an argument list


def setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def relay(front: Front, netns: int, public_sock: socket.socket, prom_sock: socket.socket,
          proxy_sock: socket.socket) -> None:
    """This process's relay threads: the egress proxy's from the host's network, the public ports' from inside."""
    front.pump = Pump()

    def inside() -> None:
        setns(netns)  # this thread, and the threads it starts, connect to the router's loopback
        threading.Thread(target=accept_loop, args=(prom_sock, front.prometheus), daemon=True).start()
        accept_loop(public_sock, front.public)

    threading.Thread(target=inside, daemon=True).start()
    threading.Thread(target=accept_loop, args=(proxy_sock, front.egress), daemon=True).start()


def processes() -> int:
    """How many processes relay (each its own core: one Python process tops out near one core)."""
    wanted = os.environ.get(PROCESSES_ENV, "")
    return max(1, int(wanted)) if wanted.isdigit() else max(1, min(MAX_PROCESSES, len(os.sched_getaffinity(0))))


def fork_relays(n: int, front: Front, netns: int, socks: list[socket.socket]) -> list[int]:
    """``n`` more relay processes sharing the listening sockets (the kernel hands each connection to one of them).
    They ignore the stop signals (the router drains through them) and die with this process."""
    parent, pids = os.getpid(), []
    for _ in range(n):
        pid = os.fork()
        if pid:
            pids.append(pid)
            continue
        try:  # the child: no Python cleanup of the parent's state, ever
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            if os.getppid() == parent:
                relay(front, netns, *socks)
                threading.Event().wait()
        finally:
            os._exit(0)
    return pids


def setup(front: Front, command: list[str], out: dict[str, Any]) -> None:
    """In a thread of its own, which ends: the network namespace (kept by an open handle), the router in it."""
    try:
        enter_network_namespace()
        out["netns"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        out["proxy"] = proxy_sock = listener("127.0.0.1", 0)
        front.proxy_port, front.models_mode = proxy_sock.getsockname()[1], IGW_FLAG in command
        front.router_port, front.router_prom_port = inside_ports(2)
        out["proc"] = start_router(command, front.router_port, front.router_prom_port, proxy_sock.getsockname()[1])
    except OSError as exc:
        out["error"] = exc


def serve(bind: str, port: int, prom_port: int, command: list[str]) -> int:
    try:
        public_sock = listener(bind, port)
        prom_sock = listener(bind, prom_port)
    except OSError as exc:
        log(f"error: cannot bind {bind}:{port}/{prom_port}: {exc.strerror}")  # "Address already in use": pbstk retries
        return 1
    front = Front(os.environ.get(TOKEN_ENV, ""))
    if not front.token:
        log(f"error: {TOKEN_ENV} is not set: the admin API would have no owner")
        return 1
    made: dict[str, Any] = {}
    try:
        enter_user_namespace()  # while this process has one thread only, as unshare wants
    except OSError as exc:
        made["error"] = exc
    else:
        thread = threading.Thread(target=setup, args=(front, command, made))
        thread.start()
        thread.join()
    if "error" in made:
        log(f"error: cannot give the router a private network namespace ({made['error'].strerror}): unprivileged "
            "user namespaces are off on this host; set router_isolation: none in the profile to run it unprotected")
        return 1
    proc: subprocess.Popen[bytes] = made["proc"]
    socks = [public_sock, prom_sock, made["proxy"]]
    n = processes()
    children = fork_relays(n - 1, front, made["netns"], socks)  # one thread here now: a clean fork
    relay(front, made["netns"], *socks)
    log(f"router pid {proc.pid} in a private network namespace; public {bind}:{port}, prometheus {prom_port}; "
        f"{n} relay process(es)")

    def stop(signum: int, _frame: object) -> None:  # new connections end; the router drains the ones it has
        shut(public_sock, socket.SHUT_RD)  # wakes and ends every process's accept on them
        shut(prom_sock, socket.SHUT_RD)
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # the front failed: no router left behind, unreachable in its namespace
            proc.kill()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    log(f"the router exited ({rc})")
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--" or not argv[1].isdigit() or not argv[2].isdigit():
        log("usage: router_front.py BIND PORT PROM_PORT -- ROUTER_COMMAND...")
        return 2
    return serve(argv[0], int(argv[1]), int(argv[2]), argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
