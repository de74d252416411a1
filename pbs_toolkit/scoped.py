"""``launched``: one job for the length of a ``with`` block (launch, wait, hand out the endpoint, cancel).

It was called ``pbs_toolkit.serve`` until 0.1, which clashed with ``Client.serve`` (and ``pbstk serve``): those
start a *service*, several replicas behind a router, kept alive by a keeper. ``serve`` still works for one
release and warns (``DeprecationWarning``). Both are defined beside ``Client`` (client.py), which they open:
this module only names them, so that it never imports from a module that imports it back.
"""

from __future__ import annotations

from pbs_toolkit.client import launched, serve

__all__ = ["launched", "serve"]
