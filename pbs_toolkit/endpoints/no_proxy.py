"""``NO_PROXY`` for an endpoint: clients must reach the server directly, never through the site's proxy.

Login shells on some sites set ``http_proxy`` (ALCF: ``proxy.alcf.anl.gov:3128``); ``curl`` and the OpenAI SDK
(httpx) then send requests for a compute node to a proxy that cannot reach it. ``pbstk env`` exports
``NO_PROXY``/``no_proxy`` with the endpoint's host appended to whatever the shell already has (both spellings
merged: curl reads the lower-case one, httpx and requests either), so ``eval "$(pbstk env)"`` keeps the
proxy for everything else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit


def no_proxy_value(url: str, environ: Mapping[str, str] | None = None) -> str:
    """The existing ``NO_PROXY`` and ``no_proxy`` entries of ``environ`` (default: this process's), in order and
    without repeats, with ``url``'s host appended unless it is already there."""
    environ = os.environ if environ is None else environ
    entries: list[str] = []
    for name in ("NO_PROXY", "no_proxy"):
        for entry in (environ.get(name) or "").split(","):
            entry = entry.strip()
            if entry and entry not in entries:
                entries.append(entry)
    host = urlsplit(url).hostname
    if host and host not in entries and "*" not in entries:
        entries.append(host)
    return ",".join(entries)
