"""The router front's data path (``server/router_relay.py``): the epoll relay passes answers on whole and in order,
also to a reader slower than the writer (the relay then waits for the reader instead of reading on)."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from typing import Any

import pytest

from pbs_toolkit.server.router_relay import Pump


def _front() -> Any:
    """A router front as its relay processes hold it (token "token"), without a router or a namespace."""
    from pbs_toolkit.server.router_front import Front

    front = Front("token")
    front.pump = Pump()
    return front


def _serving(handler: Any) -> socket.socket:
    """A loopback listener whose connections ``handler`` takes, each in a thread, as the front's ports do."""
    from pbs_toolkit.server.router_relay import accept_loop

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    threading.Thread(target=accept_loop, args=(listener, handler), daemon=True).start()
    return listener


def test_a_slow_reader_gets_every_stream_whole_and_in_order() -> None:
    pump = Pump()
    payload = hashlib.sha256(b"x").digest() * 262144  # 8 MiB: far more than a socket buffer holds
    readers, results = [], {}
    for i in range(3):
        up_w, up_r = socket.socketpair()  # the worker's side, the relay's upstream
        out_w, out_r = socket.socketpair()  # the relay's client side, the client

        def write(sock: socket.socket = up_w) -> None:
            with sock:
                sock.sendall(payload)

        def relay(src: socket.socket = up_r, dst: socket.socket = out_w) -> None:
            pump.relay(src, dst)
            src.close()
            dst.close()  # the client sees the end

        def read(sock: socket.socket = out_r, i: int = i) -> None:
            got = bytearray()
            with sock:
                sock.settimeout(30)
                while data := sock.recv(1024):  # small reads: the relay outruns this reader
                    got += data
            results[i] = bytes(got)

        for target in (write, relay, read):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            if target is read:
                readers.append(thread)
    for thread in readers:
        thread.join(60)
    assert sorted(results) == [0, 1, 2]
    assert all(got == payload for got in results.values())
    assert pump.flows == {}  # nothing left registered


def test_a_worker_that_refuses_is_refused_to_the_router_not_answered() -> None:
    """The router's proxy (``Front.egress``) asked for a worker whose port refuses: the router's connection ends
    with a reset, as its own connection to that worker would have without the front (vllm-router retries a
    refused connection on another worker); not an answer of the front's own (502), and never a hang."""
    with socket.socket() as dead:  # a port nothing listens on
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    front = _front()
    proxy = _serving(front.egress)
    try:
        for _ in range(3):  # each time, and the proxy goes on serving
            with socket.create_connection(proxy.getsockname(), timeout=10) as router:
                router.sendall(b"POST http://127.0.0.1:%d/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                               b"content-length: 2\r\n\r\n{}" % (dead_port, dead_port))
                got = b""
                with pytest.raises(ConnectionResetError):
                    while data := router.recv(4096):
                        got += data
                assert got == b""
    finally:
        proxy.shutdown(socket.SHUT_RDWR)
        proxy.close()


def test_framing_finds_where_an_answer_ends_however_it_is_cut() -> None:
    """The relay keeps a worker's connection only when the answer ended exactly where its framing says: a chunked
    stream cut at every byte, a Content-Length body, and bytes past the end (counted out, never passed on)."""
    from pbs_toolkit.server.router_relay import Framing, answer_framing

    stream = b"5\r\ndata:\r\n1a;ext=1\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: t\r\n\r\n"
    for cut in range(1, len(stream)):
        framing = answer_framing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"POST")
        assert framing is not None
        used = framing.feed(stream[:cut])
        assert used == cut and not framing.done
        assert framing.feed(stream[cut:] + b"NEXT") == len(stream) - cut and framing.done
    framing = answer_framing(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", b"POST")
    assert framing is not None and framing.feed(b"abcdef") == 4 and framing.done
    assert answer_framing(b"HTTP/1.1 204 No Content\r\n\r\n", b"POST").done  # type: ignore[union-attr]
    # what ends with its connection is never framed: HTTP/1.0, "close", no length, two lengths
    for head in (b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\n", b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
                 b"Content-Length: 4\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\n"):
        assert answer_framing(head, b"POST") is None, head
    with pytest.raises(ValueError):
        Framing(None).feed(b"zz\r\n")


def _accepting(handler: Any) -> tuple[socket.socket, int]:
    """A loopback listener whose accepted connections go to ``handler`` in one thread, until it is closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            handler(conn)

    threading.Thread(target=accept, daemon=True).start()
    return sock, sock.getsockname()[1]


class _OneShotWorker:
    """A worker on loopback that keeps each connection open after its first answer, then closes it as the next
    request on it arrives (read, never answered): the race of a worker closing an idle kept connection just as
    the front reuses it. ``reset``: a reset (ECONNRESET at the front) instead of a plain close (EOF)."""

    def __init__(self, reset: bool) -> None:
        self.reset, self.requests, self.dropped = reset, 0, 0
        self.sock, self.port = _accepting(lambda conn: threading.Thread(target=self.serve, args=(conn,),
                                                                         daemon=True).start())

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buf, answered = b"", 0
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(4096)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(4096)
                buf = buf[length:]
                if answered:  # the next request on a kept connection: the worker closes it now, unanswered
                    self.dropped += 1
                    if self.reset:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                self.requests += 1
                answered += 1
                body = b'{"n": %d}' % self.requests
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))


@pytest.mark.parametrize("reset", [False, True], ids=["eof", "reset"])
def test_a_kept_connection_the_worker_closes_as_it_is_reused_is_retried_once_on_a_fresh_one(reset: bool) -> None:
    """The router's proxy (``Front.egress``) reuses its kept connection to a worker that closes it just as the
    next request arrives: the request goes once more on a fresh connection and the router gets its answer
    (without the retry its connection ended with no answer: aiohttp's ``ServerDisconnected`` at the client)."""
    worker = _OneShotWorker(reset)
    front = _front()
    proxy = _serving(front.egress)
    try:
        answers = []
        for _ in range(4):  # each on a new router connection; the front reuses its connection to the worker
            with socket.create_connection(proxy.getsockname(), timeout=30) as router:
                router.sendall(b"POST http://127.0.0.1:%d/v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                               b"content-length: 2\r\n\r\n{}" % (worker.port, worker.port))
                got = b""
                while data := router.recv(4096):
                    got += data
                answers.append(got)
        assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") for a in answers), answers
        assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b'{"n": %d}' % i for i in range(1, 5)]
        assert worker.dropped == 3  # every reuse met the race, and was retried
    finally:
        proxy.shutdown(socket.SHUT_RDWR)
        proxy.close()
        worker.sock.close()


class _RudeRouter:
    """A router on loopback that takes each request in and ends the first ``rude`` connections without a byte
    (``reset``: with a reset, as vllm-router did once in 12,000 requests of a GPU burst), then answers 200."""

    def __init__(self, rude: int, reset: bool = False) -> None:
        self.rude, self.reset, self.seen = rude, reset, 0
        self.sock, self.port = _accepting(self.serve)

    def serve(self, conn: socket.socket) -> None:  # one at a time, in the accepting thread
        with conn:
            conn.recv(65536)
            self.seen += 1
            if self.seen <= self.rude:
                if self.reset:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")


def _post_through_front(router: _RudeRouter) -> bytes:
    front = _front()
    front.router_port = router.port
    public = _serving(front.public)
    try:
        with socket.create_connection(public.getsockname(), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            got = b""
            while data := client.recv(4096):
                got += data
            return got
    finally:
        public.close()


def _front_log(capfd: pytest.CaptureFixture[str], words: str) -> str:
    err = ""
    for _ in range(100):
        err += capfd.readouterr().err
        if words in err:
            break
        threading.Event().wait(0.05)
    return err


@pytest.mark.parametrize("reset", [False, True], ids=["eof", "reset"])
def test_a_request_the_router_drops_before_answering_is_sent_once_more(reset: bool,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """Before: the client got no answer (aiohttp's ``ServerDisconnected``; 1 of 12,000 requests of an H100 burst
    through an autoscaled service, the router's log: ``ConnectionResetError``). Its body was at hand: it goes
    once more on a fresh connection, and the front's log says so."""
    router = _RudeRouter(rude=1, reset=reset)
    try:
        got = _post_through_front(router)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"ok"), got
        assert router.seen == 2
        assert "the router ended a connection before answering POST /v1/completions" in \
               _front_log(capfd, "sent once more")
    finally:
        router.sock.close()


def test_a_router_that_closes_without_an_answer_is_named_in_the_fronts_log(capfd: pytest.CaptureFixture[str]) -> None:
    """Twice in a row (the first try and the one more): the client's side is aiohttp's ``ServerDisconnected``,
    and the front's log says where the connection ended and why."""
    router = _RudeRouter(rude=2)
    try:
        assert _post_through_front(router) == b""  # no answer: the client sees the server disconnect
        assert router.seen == 2
        err = _front_log(capfd, "a connection ended")
        assert "a connection ended while relaying POST /v1/completions to the router and its answer back: " \
               "ConnectionError: closed before the end of a head" in err
    finally:
        router.sock.close()
