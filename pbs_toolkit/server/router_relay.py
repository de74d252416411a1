"""pbstk's router front, its data path: the relays between sockets (``router_front.py`` decides what is passed on).

A request's head and body are handled by a thread of its own, on blocking sockets; once its body is upstream,
its answer is relayed by the process's one epoll thread (``Pump``): a chunk costs a wake-up shared with every other
stream ready at that moment, a ``recv_into`` and a ``send``. An answer from a worker is also read for where it ends
(``Framing``: its Content-Length or its chunks), so that the connection to the worker is kept for the next request
(``Upstreams``), as the router keeps its own without the front. Standard library only (Python 3.7+, Linux), copied
next to ``router_front.py``.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
import time
from typing import Callable  # noqa: UP035 - Python 3.7 on the router host

HEAD_LIMIT = 64 * 1024
CHUNK = 64 * 1024
CONNECT_WAIT_S = 30.0
LINE_LIMIT = 4096
KEEP_IDLE_S = 2.0


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, text: str) -> None:
        super().__init__(text)
        self.status, self.reason, self.text = status, reason, text


def closing(head: bytes) -> bytes:
    """A response head that tells the client this connection ends with it (one request per connection here)."""
    lines = head[:-4].split(b"\r\n")
    kept = [ln for ln in lines[1:] if ln.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")]
    return b"\r\n".join([lines[0], *kept, b"connection: close"]) + b"\r\n\r\n"


class Conn:
    """A blocking socket and the bytes already read from it past what was parsed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def read_until(self, mark: bytes, limit: int = HEAD_LIMIT) -> bytes:
        while True:
            end = self.buf.find(mark)
            if end >= 0:
                line, self.buf = self.buf[:end + len(mark)], self.buf[end + len(mark):]
                return line
            if len(self.buf) > limit:
                raise BadRequest(431, "Request Header Fields Too Large", "request head over 64 KiB")
            data = self.sock.recv(CHUNK)
            if not data:
                raise ConnectionError("closed before the end of a head")
            self.buf += data

    def copy_exact(self, dst: socket.socket, n: int) -> None:
        """Exactly ``n`` bytes to ``dst`` (never a byte more: what follows is not passed on)."""
        first, self.buf = self.buf[:n], self.buf[n:]
        dst.sendall(first)
        n -= len(first)
        while n > 0:
            data = self.sock.recv(min(n, CHUNK))
            if not data:
                raise ConnectionError("body cut short")
            dst.sendall(data)
            n -= len(data)

    def copy_chunked(self, dst: socket.socket) -> None:
        while True:
            line = self.read_until(b"\r\n")
            dst.sendall(line)
            size = int(line.split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                while self.read_until(b"\r\n") != b"\r\n":
                    pass  # trailers: not passed on
                dst.sendall(b"\r\n")
                return
            self.copy_exact(dst, size + 2)


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Everything from ``src`` to ``dst`` until its end: the data path, two system calls and no parsing a chunk."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    recv_into, sendall = src.recv_into, dst.sendall
    while True:
        n = recv_into(buf)
        if not n:
            return
        sendall(view[:n])


class Flow:
    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst, self.pending, self.done = src, dst, b"", threading.Event()
        self.framing: Framing | None = None
        self.last = False  # nothing more to read for this answer (its framing says it is whole, or it overran)
        self.whole = False  # it ended exactly where its framing said: the connection to the worker may be kept


class Pump:
    """This process's one relay thread for answers: epoll, then recv_into and send for each socket ready. Many
    streams cost one wake-up for all that are ready, not a thread switch (and a GIL hand-over) for each chunk."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.flows: dict[int, Flow] = {}
        threading.Thread(target=self.run, daemon=True).start()

    def relay(self, src: socket.socket, dst: socket.socket, framing: Framing | None = None) -> bool:
        """Everything from ``src`` to ``dst`` until its end, or until the end ``framing`` reads (this thread sleeps
        meanwhile). True when the answer ended exactly where its framing said (``src`` may carry another)."""
        src.setblocking(False)
        dst.setblocking(False)
        flow = Flow(src, dst)
        flow.framing = framing
        self.flows[src.fileno()] = flow
        self.epoll.register(src.fileno(), select.EPOLLIN)
        flow.done.wait()
        return flow.whole

    def end(self, fd: int, flow: Flow) -> None:
        self.epoll.unregister(fd)
        del self.flows[fd]
        flow.done.set()

    def move(self, old: int, new: int, events: int, flow: Flow) -> None:
        self.epoll.unregister(old)
        del self.flows[old]
        self.flows[new] = flow
        self.epoll.register(new, events)

    def run(self) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        flows, epoll = self.flows, self.epoll
        while True:
            for fd, _ in epoll.poll():
                flow = flows.get(fd)
                if flow is None:
                    continue
                try:
                    if flow.pending:  # dst could take no more: now it can
                        self.flush(fd, flow)
                    else:
                        self.forward(fd, flow, buf, view)
                except BlockingIOError:
                    continue
                except (OSError, ValueError):  # ValueError: a chunked answer that does not parse
                    self.end(fd, flow)

    def flush(self, fd: int, flow: Flow) -> None:
        sent = flow.dst.send(flow.pending)
        flow.pending = flow.pending[sent:]
        if not flow.pending and flow.last:
            self.end(fd, flow)
        elif not flow.pending:  # back to reading
            self.move(fd, flow.src.fileno(), select.EPOLLIN, flow)

    def forward(self, fd: int, flow: Flow, buf: bytearray, view: memoryview) -> None:
        n = flow.src.recv_into(buf)
        if not n:
            self.end(fd, flow)
            return
        if flow.framing is not None:  # where the answer ends (a kept connection to a worker)
            n = self.framed(flow, flow.framing, bytes(view[:n]))
        try:
            sent = flow.dst.send(view[:n])
        except BlockingIOError:
            sent = 0
        if sent < n:  # a slow reader: wait until dst can take the rest
            flow.pending = bytes(view[sent:n])
            self.move(fd, flow.dst.fileno(), select.EPOLLOUT, flow)
        elif flow.last:
            self.end(fd, flow)

    @staticmethod
    def framed(flow: Flow, framing: Framing, data: bytes) -> int:
        """How much of ``data`` (just read) belongs to the answer; marks the flow's last read."""
        used = framing.feed(data)
        if framing.done:
            flow.last, flow.whole = True, used == len(data)  # bytes past the answer's end: the connection goes
        return used


def quietly(target: Callable[..., None], *args: object) -> threading.Thread:
    def run() -> None:
        try:
            target(*args)
        except (OSError, ValueError, BadRequest):
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def shut(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    """Wakes a thread blocked on ``sock`` (a plain close would not)."""
    try:
        sock.shutdown(how)
    except OSError:
        pass


def answer(sock: socket.socket, status: int, reason: str, text: str) -> None:
    body = (text + "\n").encode()
    try:
        sock.sendall(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                     % (status, reason.encode(), len(body)) + body)
    except OSError:
        pass


def both_ways(client: socket.socket, up: socket.socket) -> None:
    """A plain two-way relay (a CONNECT tunnel, the Prometheus port) until the upstream side ends."""
    other = quietly(pump, client, up)
    try:
        pump(up, client)
    finally:
        shut(up)
        shut(client, socket.SHUT_RD)
        other.join()
        up.close()


def exchange(client: Conn, head: bytes, length: int | None, up: socket.socket, pumps: Pump,
             keep: Callable[[socket.socket], None] | None = None, method: bytes = b"", reused: bool = False) -> None:
    """One request: its head and exactly its body upstream (never a byte more), the whole answer back. ``keep``:
    the request asked ``up`` to stay open (its body was all at hand); once the answer has ended where its framing
    says, ``up`` goes to ``keep`` instead of being closed. ``reused``: ``up`` is a kept connection; if it fails
    before any byte of the answer came (the worker closed it just as it was reused), :class:`Stale` is raised
    with the client's body untouched, ``up`` closed, nothing sent to the client: the caller may retry it once (the
    front does so too on a fresh connection to the router whose body is at hand: any connection, fresh or kept, that
    ends before an answer)."""
    sender = None
    answer_ = Conn(up)
    try:
        if reused:
            stale_check(up, client, head, length, answer_)
        else:
            up.sendall(head)
            if length is not None and len(client.buf) >= length:
                client.copy_exact(up, length)  # the whole body came with the head (the usual case): no thread
            elif length is None:
                sender = quietly(client.copy_chunked, up)
            else:
                sender = quietly(client.copy_exact, up, length)
    except Stale:
        up.close()
        raise
    kept = False
    try:
        while True:  # interim answers (100 Continue) as they are, then the final one's head says "close"
            head = answer_.read_until(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 1") or head.startswith(b"HTTP/1.1 101"):
                break
            client.sock.sendall(head)
        framing = answer_framing(head, method) if keep is not None and sender is None else None
        rest = answer_.buf
        if framing is not None:
            rest = rest[:framing.feed(rest)]
        client.sock.sendall(closing(head) + rest)
        if framing is not None and framing.done:
            kept = len(rest) == len(answer_.buf)  # the answer came whole with its head
        elif sender is None:
            kept = pumps.relay(up, client.sock, framing) and framing is not None
        else:  # the body is still on its way, on blocking sockets: this thread relays the answer
            pump(up, client.sock)
    finally:
        if kept and keep is not None:  # (a kept request had its whole body at hand: no sender)
            keep(up)
        else:
            shut(up)
            if sender is not None:
                shut(client.sock, socket.SHUT_RD)
                sender.join()
            up.close()


class Stale(Exception):
    """A kept connection to a worker failed before any byte of the answer: the request may go on a fresh one."""


def stale_check(up: socket.socket, client: Conn, head: bytes, length: int | None, answer_: Conn) -> None:
    """A request whose body is all at hand, on a kept connection: sent, and its answer's first bytes read into
    ``answer_``; :class:`Stale` (the client's bytes left as they were) if the connection fails first: EOF, a reset,
    EPIPE while sending. What HTTP clients do with a stale pooled connection."""
    body = client.buf[:length or 0]
    try:
        up.sendall(head + body)
        data = up.recv(CHUNK)
    except OSError as exc:
        raise Stale(str(exc)) from None
    if not data:
        raise Stale("closed by the worker")
    client.buf = client.buf[len(body):]
    answer_.buf = data


class Framing:
    """Where a worker's answer ends, read as it passes: its ``Content-Length``, or its chunks (``length`` None)."""

    def __init__(self, length: int | None) -> None:
        self.chunked, self.left, self.line, self.trailer = length is None, length or 0, b"", False
        self.done = length == 0

    def feed(self, data: bytes) -> int:
        """How many bytes of ``data`` belong to the answer (``done`` once it is whole); ValueError if unreadable."""
        i, n = 0, len(data)
        while i < n and not self.done:
            if self.left:
                take = min(self.left, n - i)
                i, self.left = i + take, self.left - take
                self.done = not self.chunked and not self.left
                continue
            end = data.find(b"\n", i)
            if end < 0:
                self.line += data[i:]
                if len(self.line) > LINE_LIMIT:
                    raise ValueError("chunk line too long")
                return n
            line, self.line, i = self.line + data[i:end + 1], b"", end + 1
            if self.trailer:
                self.done = not line.strip()
                continue
            size = int(line.split(b";", 1)[0].strip(), 16)
            self.left, self.trailer = (size + 2, False) if size else (0, True)
        return i


def answer_framing(head: bytes, method: bytes) -> Framing | None:
    """How a worker's HTTP/1.1 answer is framed, or None when it ends with its connection (or cannot be told)."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] != b"HTTP/1.1" or not parts[1].isdigit():
        return None
    fields: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields.setdefault(name.strip().lower(), []).append(value.strip().lower())
    if b"close" in b",".join(fields.get(b"connection", [])):
        return None
    if method == b"HEAD" or parts[1] in (b"204", b"304"):
        return Framing(0)
    codings, lengths = fields.get(b"transfer-encoding", []), fields.get(b"content-length", [])
    if codings:
        return Framing(None) if codings == [b"chunked"] and not lengths else None
    return Framing(int(lengths[0])) if len(lengths) == 1 and lengths[0].isdigit() else None


class Upstreams:
    """Connections to workers kept open between requests (vLLM's server, like the router alone, keeps them): a
    request on a kept one costs the worker no new connection. Each is used by one request at a time, for at
    most ``KEEP_IDLE_S`` after the last (uvicorn closes idle ones after 5 s), and only if it is still open and
    quiet."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[tuple[float, socket.socket]]] = {}
        self.lock = threading.Lock()

    def get(self, host: str, port: int) -> socket.socket | None:
        while True:
            with self.lock:
                kept = self.idle.get((host, port))
                if not kept:
                    return None
                since, sock = kept.pop()
            if time.monotonic() - since < KEEP_IDLE_S and quiet(sock):
                return ready(sock)
            sock.close()

    def put(self, host: str, port: int, sock: socket.socket) -> None:
        now = time.monotonic()
        with self.lock:
            kept = self.idle.setdefault((host, port), [])
            while kept and now - kept[0][0] >= KEEP_IDLE_S:  # the oldest first: stale ones do not pile up
                kept.pop(0)[1].close()
            kept.append((now, sock))


def quiet(sock: socket.socket) -> bool:
    """Still open, and nothing unasked for waiting on it."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": closed by the worker; bytes: unasked for
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


class Unreachable(Exception):
    """The worker the router asked for refused the connection (or did not answer it)."""


def dial(host: str, port: int) -> socket.socket:
    """A connection from the host's network (a worker the router asked for); :class:`Unreachable` when none."""
    try:
        sock = socket.create_connection((host, port), CONNECT_WAIT_S)
    except OSError as exc:
        raise Unreachable(f"{host}:{port}: {type(exc).__name__}") from None
    return ready(sock)


def refuse(sock: socket.socket) -> None:
    """Makes the close of ``sock`` (its handler's end) a reset, not an answer: what the router's connection to a
    dead worker meets without the front (a refused connection), which it retries on another worker."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def ready(sock: socket.socket) -> socket.socket:
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each streamed token leaves at once
    return sock


def accept_loop(lsock: socket.socket, handler: Callable[[socket.socket], None]) -> None:
    """A thread per connection (started from this thread: in its network namespace); ends when ``lsock`` is shut."""
    while True:
        try:
            sock, _ = lsock.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED):
                time.sleep(0.05)
                continue
            return  # shut down: no new connections

        def run(sock: socket.socket = sock) -> None:
            try:
                handler(ready(sock))
            except OSError:
                pass
            finally:
                sock.close()
        threading.Thread(target=run, daemon=True).start()
