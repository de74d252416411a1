"""job helper, swapping models: their vLLMs' development endpoints behind the key; requests in flight counted.

Written into a swapping job's run directory by pbstk's start_vllm.sh and loaded by its vLLMs as
``--middleware pbstk_dev_guard.DevGuard`` (docs/multi-model.md "Swapping"). Standard library only: it runs in
the vLLM's own Python.

vLLM's sleep mode needs ``VLLM_SERVER_DEV_MODE=1``, which also serves ``/sleep``, ``/wake_up``,
``/collective_rpc``, ``/reset_prefix_cache`` and more, and vLLM's ``--api-key`` guards only ``/v1`` (and
``/v2``, ``/inference``, ``/cohere``). This ASGI middleware answers 401 to every request without the job's key
(``Authorization: Bearer KEY``, the key read once from the file ``PBSTK_DEV_GUARD_KEY_FILE`` names), except the
probes that are open on any vLLM: ``/health``, ``/ping``, ``/metrics``, ``/version``, ``/load``. Without a
readable key it refuses everything but those (closed, not open, when in doubt).

It also counts the generation requests in flight in this API server (a ``POST`` under ``/v1/`` and the other
inference paths, from its arrival to its answer's end) and answers ``GET /pbstk/inflight`` (with the key) with
``{"inflight": N}``: the swapper's signal that a sleeping model is wanted. vLLM's own gauges cannot say it: a
sleeping (paused) engine does not step, and its requests counters come from its steps, so a request held for a
sleeping engine shows in no metric of vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading

#: paths any vLLM answers without a key (the probes of pbstk, the router and monitoring)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})
KEY_FILE_ENV = "PBSTK_DEV_GUARD_KEY_FILE"
#: where the count of requests in flight is read (guarded like every other path)
INFLIGHT_PATH = "/pbstk/inflight"
#: the paths of generation (and other inference) requests, counted while in flight when POSTed
COUNTED_PREFIXES = ("/v1/", "/v2/", "/inference/", "/pooling", "/classify", "/score", "/rerank", "/invocations")
_REFUSED = b'{"error": "Unauthorized"}'


def key_digest(path: str | None) -> bytes | None:
    """The SHA-256 of the key in ``path`` (``None``: no readable, non-empty key)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError:
        return None
    return hashlib.sha256(key).digest() if key else None


def allowed(path: str, authorization: str, digest: bytes | None) -> bool:
    """Whether a request for ``path`` with this ``Authorization`` header passes."""
    if path in OPEN_PATHS:
        return True
    scheme, _, token = authorization.partition(" ")
    if digest is None or scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode("utf-8")).digest(), digest)


class DevGuard:
    """Pure ASGI middleware (vLLM adds a class given to ``--middleware`` with ``app.add_middleware``)."""

    def __init__(self, app):  # noqa: ANN001 (an ASGI app; no typing imports in the vLLM's Python)
        self.app = app
        self.digest = key_digest(os.environ.get(KEY_FILE_ENV))
        self.inflight = 0
        self.lock = threading.Lock()  # one event loop in vLLM; the test stand-in serves from threads

    async def __call__(self, scope, receive, send):  # noqa: ANN001
        if scope.get("type") not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "")
        path = scope.get("path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        auth = ""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                auth = value.decode("latin-1")
                break
        if allowed(path, auth, self.digest):
            if scope["type"] == "http" and path == INFLIGHT_PATH:
                return await _answer(send, 200, json.dumps({"inflight": self.inflight}).encode("ascii"))
            if scope["type"] != "http" or scope.get("method") != "POST" or not path.startswith(COUNTED_PREFIXES):
                return await self.app(scope, receive, send)
            with self.lock:
                self.inflight += 1
            try:
                return await self.app(scope, receive, send)
            finally:
                with self.lock:
                    self.inflight -= 1
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        return await _answer(send, 401, _REFUSED)


async def _answer(send, status, body):  # noqa: ANN001
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
