"""pbstk's router front, ``GET /v1/models`` of a multi-model service: every model the keeper registered, busy or
not, within about ``MODELS_WAIT_S`` seconds (server/router_front.py answers that path with :class:`ModelList`).

Standard library only: it runs beside router_front.py on the router's host.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
from typing import Any

#: how long ``GET /v1/models`` of a multi-model service waits for its model servers' own lists
MODELS_WAIT_S = 1.5


class ModelList:
    """The front's answer to ``GET /v1/models``, and what it keeps between two: each model's entry as its server
    last listed it, and the keys a server has accepted (their digests)."""

    def __init__(self) -> None:
        self.model_entries: dict[str, Any] = {}
        self.keys_seen: set[str] = set()

    def answer(self, headers: list[tuple[bytes, bytes]], router: socket.socket, proxy_port: int) -> tuple[int, bytes]:
        """``GET /v1/models`` of a multi-model router (whose own answer, ``{"models": [...]}``, is no OpenAI list
        and checks no key): every model the keeper registered (the router's ``/workers``, each with its
        ``model_id``), busy or not, within about ``MODELS_WAIT_S``. Each worker is asked its own list at once, in
        parallel, with the client's ``Authorization`` (each vLLM checks the key as for one model): the first 200
        proves the key, a 401 from any is passed on as it came. A worker too busy to answer in time (its API
        server's event loop streams tokens: on one H200 a look took 10 s and left the busy model out) is listed
        all the same, as it last answered, or by its id; a key no worker could check in time passes only if a
        worker accepted it before."""
        workers = self._router_workers(router)
        if workers is None:
            return 502, b'{"error": "pbstk router front: the router did not list its workers"}'
        if not workers:  # as the router itself answers: a completion gets 503 too, so no empty 200 list
            return 503, b'{"error": "No models available: the router has no worker"}'
        auth = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers if n == b"authorization"}
        answers: dict[int, tuple[int, bytes]] = {}
        asks = [threading.Thread(target=self._ask_models, daemon=True,
                                 args=(proxy_port, str(w.get("url", "")), auth, answers, i))
                for i, w in enumerate(workers)]
        for ask in asks:
            ask.start()
        until = time.monotonic() + MODELS_WAIT_S
        for ask in asks:
            ask.join(max(0.0, until - time.monotonic()))
        got = dict(answers)  # the answers in by now; a later one is not waited for
        refused = next((a for a in got.values() if a[0] != 200), None)
        if refused is not None:
            return refused
        digest = hashlib.sha256(repr(sorted(auth.items())).encode()).hexdigest()
        if got:
            self.keys_seen.add(digest)
        elif workers and digest not in self.keys_seen:
            return 504, b'{"error": "pbstk router front: no model server answered in time to check the key"}'
        for _status, body in got.values():
            self._remember(body)
        data: list[Any] = []
        for worker in workers:
            mid = str(worker.get("model_id") or "")
            if mid and mid not in {d.get("id") for d in data}:
                data.append(self.model_entries.get(mid) or {"id": mid, "object": "model", "owned_by": "vllm"})
        return 200, json.dumps({"object": "list", "data": data}).encode()

    @staticmethod
    def _router_workers(router: socket.socket) -> list[dict[str, Any]] | None:
        """The router's ``GET /workers`` (each with its ``url`` and ``model_id``) over the connection ``router``,
        None when it does not say."""
        conn = http.client.HTTPConnection("127.0.0.1", 0, timeout=10)
        conn.sock = router
        conn.request("GET", "/workers")
        try:
            return [w for w in json.loads(conn.getresponse().read())["workers"] if isinstance(w, dict)]
        except (ValueError, KeyError, TypeError):
            return None
        finally:
            conn.close()

    def _remember(self, body: bytes) -> None:
        """Keep each model's entry of a server's ``/v1/models`` answer, for a look it is too busy to answer."""
        try:
            for entry in json.loads(body)["data"]:
                if isinstance(entry, dict) and entry.get("id"):
                    self.model_entries[str(entry["id"])] = entry
        except (ValueError, KeyError, TypeError):
            pass

    @staticmethod
    def _ask_models(proxy_port: int, url: str, auth: dict[str, str], answers: dict[int, tuple[int, bytes]],
                    i: int) -> None:
        """One worker's own ``/v1/models`` through the egress proxy, into ``answers[i]`` when it answers."""
        proxy = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=MODELS_WAIT_S + 1)
        try:
            proxy.request("GET", url.rstrip("/") + "/v1/models", headers=auth)
            reply = proxy.getresponse()
            answers[i] = (reply.status, reply.read())
        except (OSError, http.client.HTTPException):
            pass  # a worker that went away, or is too busy: the others' answers stand
        finally:
            proxy.close()
