"""The stand-in vLLM's ``--middleware MODULE.CLASS`` (repeatable), as vLLM applies it: the object is imported at
start (an import error stops the server before it listens, as in vLLM) and every request goes through it. The
stand-in has no ASGI server, so it runs each pure-ASGI class middleware on an ASGI ``http`` scope of the request:
what the middleware sent is the answer; a request it passed on to the app is served as usual. A coroutine-function
middleware (vLLM's ``@app.middleware("http")`` form) is not modelled: the stand-in refuses it at start.
"""

import asyncio
import importlib
import inspect


class Middlewares:
    def __init__(self, specs):
        self.apps = []
        for spec in specs:
            module, name = spec.rsplit(".", 1)
            obj = getattr(importlib.import_module(module), name)
            if not inspect.isclass(obj):
                raise SystemExit(f"stand-in vllm: --middleware {spec}: only a class is modelled here")
            self.apps.append(obj(self._app))

    @staticmethod
    async def _app(scope, receive, send):
        scope["standin_passed"] = True

    def refused(self, method, path, headers):
        """``(status, body)`` a middleware answered instead of the app, or ``None``: passed on."""
        for app in self.apps:
            scope = {"type": "http", "method": method, "path": path.split("?", 1)[0], "root_path": "",
                     "query_string": path.partition("?")[2].encode(), "headers":
                     [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
            sent = []

            async def send(message, sent=sent):
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            asyncio.run(app(scope, receive, send))
            if not scope.get("standin_passed"):
                status = next(m["status"] for m in sent if m["type"] == "http.response.start")
                return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return None
