"""The stand-in vLLM's ``--middleware MODULE.CLASS`` (repeatable), as vLLM applies it: the object is imported at
start (an import error stops the server before it listens, as in vLLM) and every request goes through it. The
stand-in has no ASGI server, so each request runs the chain of pure-ASGI class middlewares on an ASGI ``http``
scope of the request, in its own event loop, around the stand-in's own handling: what a middleware answered
itself is the answer; a request passed on is served, inside the middleware's call (so a middleware that counts
requests in flight sees them until their answer ends, as in vLLM). A coroutine-function middleware (vLLM's
``@app.middleware("http")`` form) is not modelled: the stand-in refuses it at start.
"""

import asyncio
import importlib
import inspect


class Middlewares:
    def __init__(self, specs):
        self.app = self._serve
        for spec in reversed(specs):  # the first given is the outermost, as app.add_middleware stacks them
            module, name = spec.rsplit(".", 1)
            obj = getattr(importlib.import_module(module), name)
            if not inspect.isclass(obj):
                raise SystemExit(f"stand-in vllm: --middleware {spec}: only a class is modelled here")
            self.app = obj(self.app)
        self.active = bool(specs)

    @staticmethod
    async def _serve(scope, receive, send):
        scope["standin_serve"]()  # the stand-in's own handling: it writes its answer itself
        scope["standin_served"] = True

    def through(self, method, path, headers, serve):
        """Run ``serve`` through the middlewares; ``(status, body)`` when one answered instead, else ``None``."""
        scope = {"type": "http", "method": method, "path": path.split("?", 1)[0], "root_path": "",
                 "query_string": path.partition("?")[2].encode(), "standin_serve": serve, "headers":
                 [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        asyncio.run(self.app(scope, receive, send))
        if scope.get("standin_served"):
            return None
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
