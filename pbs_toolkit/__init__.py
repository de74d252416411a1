"""pbs-toolkit: serve models with vLLM on PBS clusters and point evaluations at them.

The public API is re-exported lazily so that ``import pbs_toolkit`` (and ``pbstk --help``) stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "render": ("pbs_toolkit.render", "render"),
    "RenderRequest": ("pbs_toolkit.render", "RenderRequest"),
    "launch": ("pbs_toolkit.launch", "launch"),
    "status": ("pbs_toolkit.status", "status"),
    "cancel": ("pbs_toolkit.launch", "cancel"),
    "wait_until_ready": ("pbs_toolkit.readiness", "wait_until_ready"),
    "update_endpoint": ("pbs_toolkit.endpoints", "update_endpoint"),
    "PbstkError": ("pbs_toolkit.errors", "PbstkError"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)


__all__ = list(_LAZY) + ["__version__"]
