"""The package's version, in a module of its own: modules that print or record it import this, not the package
``__init__`` (whose lazy re-exports import ``Client``, which would close an import circle)."""

__version__ = "0.1.0"
