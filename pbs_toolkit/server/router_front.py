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

import asyncio
import ctypes
import fcntl
import hmac
import os
import signal
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

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
HEAD_LIMIT = 64 * 1024
HEAD_WAIT_S = 60.0
CHUNK = 64 * 1024


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
    s.listen(512)
    s.setblocking(False)
    return s


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, text: str) -> None:
        super().__init__(text)
        self.status, self.reason, self.text = status, reason, text


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


def rebuild(method: bytes, target: bytes, version: bytes, headers: list[tuple[bytes, bytes]], host: bytes) -> bytes:
    kept = [(n, v) for n, v in headers if n not in HOP_BY_HOP and n != TOKEN_HEADER and n != b"host"]
    lines = [b" ".join((method, target, version)), b"host: " + host]
    lines += [n + b": " + v for n, v in kept]
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def closing(head: bytes) -> bytes:
    """A response head that tells the client this connection ends with it (one request per connection here)."""
    lines = head[:-4].split(b"\r\n")
    kept = [ln for ln in lines[1:] if ln.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")]
    return b"\r\n".join([lines[0], *kept, b"connection: close"]) + b"\r\n\r\n"


def allowed(method: bytes, path: str) -> bool:
    if path.startswith(PUBLIC_PREFIXES) or path in PUBLIC_PATHS:
        return True
    return method == b"GET" and path in PUBLIC_GET


async def copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, CHUNK))
        if not data:
            raise ConnectionError("body cut short")
        writer.write(data)
        await writer.drain()
        n -= len(data)


async def copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size = int(line.split(b";", 1)[0].strip() or b"x", 16)
        if size == 0:
            while True:
                trailer = await reader.readuntil(b"\r\n")
                writer.write(trailer)
                if trailer == b"\r\n":
                    await writer.drain()
                    return
        await copy_exact(reader, writer, size + 2)


async def copy_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            return
        writer.write(data)
        await writer.drain()


def close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except OSError:
        pass


async def answer(writer: asyncio.StreamWriter, status: int, reason: str, text: str) -> None:
    body = (text + "\n").encode()
    writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                 % (status, reason.encode(), len(body)) + body)
    try:
        await writer.drain()
    except OSError:
        pass


async def exchange(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, head: bytes, length: int | None,
                   upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """One request: its head and exactly its body upstream (never a byte more), the whole answer back."""
    up_r, up_w = upstream
    up_w.write(head)

    async def send_body() -> None:
        if length is None:
            await copy_chunked(client_r, up_w)
        else:
            await copy_exact(client_r, up_w, length)

    sender = asyncio.ensure_future(send_body())
    try:
        while True:  # interim answers (100 Continue) as they are, then the final one's head says "close"
            head = await up_r.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 1") or head.startswith(b"HTTP/1.1 101"):
                break
            client_w.write(head)
        client_w.write(closing(head))
        await copy_all(up_r, client_w)
    finally:
        sender.cancel()
        close(up_w)


async def dial(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from the host's network (a worker the router asked for); 502 when there is none."""
    try:
        return await asyncio.open_connection(host, port, limit=HEAD_LIMIT)
    except OSError as exc:
        raise BadRequest(502, "Bad Gateway", f"pbstk router front: {host}:{port}: {type(exc).__name__}") from None


class Front:
    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.netns = ThreadPoolExecutor(max_workers=1)  # its one thread lives in the router's network namespace
        self.router_port = 0
        self.router_prom_port = 0

    async def inside(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to ``port`` on the namespace's loopback (the socket is made by the namespace's thread)."""
        loop = asyncio.get_event_loop()
        sock = await loop.run_in_executor(self.netns, socket.create_connection, ("127.0.0.1", port), 10)
        sock.setblocking(False)
        return await asyncio.open_connection(sock=sock, limit=HEAD_LIMIT)

    async def public(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The public port: service traffic to the router; anything else only with the router's token."""
        try:
            try:  # a client that never finishes its head does not hold a connection for ever
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_WAIT_S)
            except asyncio.LimitOverrunError:
                raise BadRequest(431, "Request Header Fields Too Large", "request head over 64 KiB") from None
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
            try:
                upstream = await self.inside(self.router_port)
            except OSError:
                raise BadRequest(502, "Bad Gateway", "pbstk router front: the router is not answering yet") from None
            await exchange(reader, writer, rebuild(method, target, version, headers, b"127.0.0.1"), length, upstream)
        except BadRequest as exc:
            await answer(writer, exc.status, exc.reason, exc.text)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError, ValueError):
            pass
        finally:
            close(writer)

    async def egress(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The router's HTTP proxy (inside the namespace): its requests to workers, sent from the host's network."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, version, headers = parse_head(head)
            if method == b"CONNECT":  # an https:// worker: a tunnel to that host and port
                host, _, port = target.decode("ascii").rpartition(":")
                up_r, up_w = await dial(host.strip("[]"), int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                pump = asyncio.ensure_future(copy_all(reader, up_w))
                try:
                    await copy_all(up_r, writer)
                finally:
                    pump.cancel()
                    close(up_w)
                return
            url = urlsplit(target.decode("ascii"))
            if url.scheme != "http" or not url.hostname:
                raise BadRequest(400, "Bad Request", "pbstk router front: only http:// targets")
            origin = (url.path or "/") + (f"?{url.query}" if url.query else "")
            length = body_framing(headers)
            upstream = await dial(url.hostname, url.port or 80)
            await exchange(reader, writer, rebuild(method, origin.encode(), version, headers, url.netloc.encode()),
                           length, upstream)
        except BadRequest as exc:  # nothing was sent back yet: an answer of our own
            await answer(writer, exc.status, exc.reason, exc.text)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
            pass  # mid-answer: the connection just ends, as the worker's did
        finally:
            close(writer)

    async def prometheus(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The public Prometheus port: a plain relay to the router's metrics endpoint (read-only)."""
        try:
            up_r, up_w = await self.inside(self.router_prom_port)
        except OSError:
            close(writer)
            return
        pump = asyncio.ensure_future(copy_all(reader, up_w))
        try:
            await copy_all(up_r, writer)
        except OSError:
            pass
        finally:
            pump.cancel()
            close(up_w)
            close(writer)


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


async def serve(bind: str, port: int, prom_port: int, command: list[str]) -> int:
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
    loop = asyncio.get_event_loop()
    try:
        enter_user_namespace()
        await loop.run_in_executor(front.netns, enter_network_namespace)
    except OSError as exc:
        log(f"error: cannot give the router a private network namespace ({exc.strerror}): unprivileged user "
            "namespaces are off on this host; set router_isolation: none in the profile to run it unprotected")
        return 1
    proxy_sock = await loop.run_in_executor(front.netns, listener, "127.0.0.1", 0)
    front.router_port, front.router_prom_port = await loop.run_in_executor(front.netns, inside_ports, 2)
    proc = await loop.run_in_executor(front.netns, start_router, command, front.router_port,
                                      front.router_prom_port, proxy_sock.getsockname()[1])
    servers = [await asyncio.start_server(front.public, sock=public_sock, limit=HEAD_LIMIT),
               await asyncio.start_server(front.prometheus, sock=prom_sock, limit=HEAD_LIMIT),
               await asyncio.start_server(front.egress, sock=proxy_sock, limit=HEAD_LIMIT)]
    log(f"router pid {proc.pid} in a private network namespace; public {bind}:{port}, prometheus {prom_port}")

    def stop(signum: int) -> None:  # new connections end; the router drains the ones it has, then we exit
        servers[0].close()
        servers[1].close()
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop, sig)
    try:
        rc = await loop.run_in_executor(None, proc.wait)
    finally:
        if proc.poll() is None:  # the front failed: no router left behind, unreachable in its namespace
            proc.kill()
    log(f"the router exited ({rc})")
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--" or not argv[1].isdigit() or not argv[2].isdigit():
        log("usage: router_front.py BIND PORT PROM_PORT -- ROUTER_COMMAND...")
        return 2
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve(argv[0], int(argv[1]), int(argv[2]), argv[4:]))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
