"""The ``pbstk`` command line: thin Click commands over the library. Entry point: ``main``."""
