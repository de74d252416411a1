"""pbs-toolkit: serve models with vLLM on PBS clusters and point evaluations at them.

The public API is re-exported lazily so that ``import pbs_toolkit`` (and ``pbstk --help``) stays fast.
``launch``, ``status``, ``render`` and ``cancel`` are functions defined here, not re-exports: modules of the
same names exist, and importing one makes Python set it as this package's attribute, which would replace the
function (``p.launch(...)`` twice in a notebook: "'module' object is not callable"). The package's module class
keeps these names from being overwritten that way.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Client": ("pbs_toolkit.client", "Client"),
    "serve": ("pbs_toolkit.client", "serve"),
    "Job": ("pbs_toolkit.client", "Job"),
    "Endpoint": ("pbs_toolkit.client", "Endpoint"),
    "Metrics": ("pbs_toolkit.client", "Metrics"),
    "Diagnosis": ("pbs_toolkit.client", "Diagnosis"),
    "BenchResult": ("pbs_toolkit.client", "BenchResult"),
    "RenderRequest": ("pbs_toolkit.render", "RenderRequest"),
    "JobStatus": ("pbs_toolkit.status", "JobStatus"),
    "wait_until_ready": ("pbs_toolkit.readiness", "wait_until_ready"),
    "update_endpoint": ("pbs_toolkit.endpoints", "update_endpoint"),
    "PbstkError": ("pbs_toolkit.errors", "PbstkError"),
}


def launch(model: str, preset: str | None = None, profile: str | None = None, **options: Any) -> Any:
    """Launch ``model`` (see ``Client.launch``); returns the ``Job``."""
    from pbs_toolkit.client import Client

    with Client() as client:
        return client.launch(model, preset, profile, **options)


def status(*jobs: Any, all: bool = False) -> Any:  # noqa: A002
    """``JobStatus`` of ``jobs`` (ids, names, ``Job``s; default: every job not ended). See ``Client.status``."""
    from pbs_toolkit.client import Client

    with Client() as client:
        return client.status(*jobs, all=all)


def render(model: str, preset: str | None = None, profile: str | None = None, **options: Any) -> Any:
    """Render the job scripts for ``model`` without writing or submitting anything (see ``Client.render``)."""
    from pbs_toolkit.client import Client

    with Client() as client:
        return client.render(model, preset, profile, **options)


def cancel(job: Any) -> bool:
    """Stop ``job`` (see ``Client.cancel``)."""
    from pbs_toolkit.client import Client

    with Client() as client:
        return client.cancel(job)


_FUNCTIONS = {"launch": launch, "status": status, "render": render, "cancel": cancel}


class _Package(types.ModuleType):
    """This package's module type: a submodule import does not replace the API functions of the same name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return  # importlib binding ``pbs_toolkit.launch`` (the module): it stays in sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)


__all__ = list(_LAZY) + list(_FUNCTIONS) + ["__version__"]
