"""``launched``: one job for the length of a ``with`` block (launch, wait, hand out the endpoint, cancel).

It was called ``pbs_toolkit.serve`` until 0.1, which clashed with ``Client.serve`` (and ``pbstk serve``): those
start a *service*, several replicas behind a router, kept alive by a keeper. ``serve`` still works for one
release and warns (``DeprecationWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pbs_toolkit.client import Client, Endpoint, Job

__all__ = ["launched"]


@contextmanager
def launched(model: str, preset: str | None = None, profile: str | None = None, *, timeout: float = 3600.0,
             client: Client | None = None, **options: Any) -> Iterator[Endpoint]:
    """Launch ``model``, wait until it is ready, yield its ``Endpoint``; cancel the job on the way out, whatever
    ends the block (an exception, Ctrl-C, a failed or timed-out wait). ``client``: reuse one (else a fresh one,
    closed at the end); ``options``: ``Client.launch``'s keywords (a misspelt one is a ``TypeError``)."""
    from pbs_toolkit.client import Client

    own = client is None
    c = client or Client()
    job: Job | None = None
    try:
        job = c.launch(model, preset, profile, **options)
        c.wait(job, timeout)
        yield c.endpoint(job)
    finally:
        try:
            if job is not None:
                c.cancel(job)
        finally:
            if own:
                c.close()


def serve(*args: Any, **kwargs: Any) -> Any:
    """Deprecated: :func:`launched` (``Client.serve`` is a different thing: a replica service)."""
    warnings.warn("pbs_toolkit.serve is now pbs_toolkit.launched (Client.serve and `pbstk serve` start a "
                  "service of replicas); the old name goes in the next release", DeprecationWarning, stacklevel=2)
    return launched(*args, **kwargs)
