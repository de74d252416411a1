"""pbs-toolkit: serve models with vLLM on PBS clusters and point evaluations at them.

The public API is re-exported lazily so that ``import pbs_toolkit`` (and ``pbstk --help``) stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "render": ("pbs_toolkit.jobs.render", "render"),
    "RenderRequest": ("pbs_toolkit.jobs.render", "RenderRequest"),
    "launch": ("pbs_toolkit.jobs.launch", "launch"),
    "status": ("pbs_toolkit.jobs.status", "status"),
    "cancel": ("pbs_toolkit.jobs.launch", "cancel"),
    "wait_until_ready": ("pbs_toolkit.jobs.readiness", "wait_until_ready"),
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
