"""pbstk's router front, its data path: the relays between sockets (``router_front.py`` decides what is passed on).

A request's head and body are handled by a thread of its own, on blocking sockets; once its body is upstream,
its answer is relayed by the process's one epoll thread (``Pump``): a chunk costs a wake-up shared with every other
stream ready at that moment, a ``recv_into`` and a ``send``; no parsing, no per-chunk objects. Standard library only
(Python 3.7+, Linux), copied next to ``router_front.py``.
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


class Pump:
    """This process's one relay thread for answers: epoll, then recv_into and send for each socket ready. Many
    streams cost one wake-up for all that are ready, not a thread switch (and a GIL hand-over) for each chunk."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.flows: dict[int, Flow] = {}
        threading.Thread(target=self.run, daemon=True).start()

    def relay(self, src: socket.socket, dst: socket.socket) -> None:
        """Everything from ``src`` to ``dst`` until its end (this thread sleeps meanwhile)."""
        src.setblocking(False)
        dst.setblocking(False)
        flow = Flow(src, dst)
        self.flows[src.fileno()] = flow
        self.epoll.register(src.fileno(), select.EPOLLIN)
        flow.done.wait()

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
                        sent = flow.dst.send(flow.pending)
                        flow.pending = flow.pending[sent:]
                        if not flow.pending:  # back to reading
                            self.move(fd, flow.src.fileno(), select.EPOLLIN, flow)
                        continue
                    n = flow.src.recv_into(buf)
                    if not n:
                        self.end(fd, flow)
                        continue
                    try:
                        sent = flow.dst.send(view[:n])
                    except BlockingIOError:
                        sent = 0
                    if sent < n:  # a slow reader: wait until dst can take the rest
                        flow.pending = bytes(view[sent:n])
                        self.move(fd, flow.dst.fileno(), select.EPOLLOUT, flow)
                except BlockingIOError:
                    continue
                except OSError:
                    self.end(fd, flow)


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


def exchange(client: Conn, head: bytes, length: int | None, up: socket.socket, pumps: Pump) -> None:
    """One request: its head and exactly its body upstream (never a byte more), the whole answer back."""
    up.sendall(head)
    sender = None
    if length is not None and len(client.buf) >= length:
        client.copy_exact(up, length)  # the whole body came with the head (the usual case): no second thread
    elif length is None:
        sender = quietly(client.copy_chunked, up)
    else:
        sender = quietly(client.copy_exact, up, length)
    answer_ = Conn(up)
    try:
        while True:  # interim answers (100 Continue) as they are, then the final one's head says "close"
            head = answer_.read_until(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 1") or head.startswith(b"HTTP/1.1 101"):
                break
            client.sock.sendall(head)
        client.sock.sendall(closing(head) + answer_.buf)
        if sender is None:
            pumps.relay(up, client.sock)
        else:  # the body is still on its way, on blocking sockets: this thread relays the answer
            pump(up, client.sock)
    finally:
        shut(up)
        if sender is not None:
            shut(client.sock, socket.SHUT_RD)
            sender.join()
        up.close()


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
