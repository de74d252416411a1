"""pbs-toolkit: serve models with vLLM on batch-scheduled HPC clusters and point evaluations at them.

The public API is re-exported lazily so that ``import pbs_toolkit`` (and ``pbstk --help``) stays fast.
``launch``, ``status``, ``render`` and ``cancel`` are functions defined here that open a ``Client`` for one call;
no submodule has those names at the top level, so importing one can never replace them.
"""

from __future__ import annotations

from typing import Any

from pbs_toolkit.version import __version__

_LAZY = {
    "Client": ("pbs_toolkit.client", "Client"),
    "launched": ("pbs_toolkit.scoped", "launched"),
    # deprecated (a DeprecationWarning when called): ``launched``'s old name, which ``Client.serve`` also had
    "serve": ("pbs_toolkit.scoped", "serve"),
    "Job": ("pbs_toolkit.client", "Job"),
    "Endpoint": ("pbs_toolkit.client", "Endpoint"),
    "Metrics": ("pbs_toolkit.client", "Metrics"),
    "Diagnosis": ("pbs_toolkit.client", "Diagnosis"),
    "BenchResult": ("pbs_toolkit.client", "BenchResult"),
    "LevelResult": ("pbs_toolkit.perf.benchjob", "LevelResult"),
    "TuneReport": ("pbs_toolkit.perf.tune", "TuneReport"),
    "RenderRequest": ("pbs_toolkit.settings.launch_settings", "RenderRequest"),
    "JobStatus": ("pbs_toolkit.jobs.status", "JobStatus"),
    "wait_until_ready": ("pbs_toolkit.jobs.readiness", "wait_until_ready"),
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



def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)


__all__ = list(_LAZY) + list(_FUNCTIONS) + ["__version__"]
