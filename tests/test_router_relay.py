"""The router front's data path (``server/router_relay.py``): the epoll relay passes answers on whole and in order,
also to a reader slower than the writer (the relay then waits for the reader instead of reading on)."""

from __future__ import annotations

import hashlib
import socket
import threading

from pbs_toolkit.server.router_relay import Pump


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
