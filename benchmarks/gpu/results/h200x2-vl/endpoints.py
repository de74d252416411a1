"""Endpoints for verifiers (``vf-eval -m ALIAS``).

``key`` names the environment variable that holds the API key, not the key.
pbstk edits this file in place: it replaces or appends one entry and leaves the rest as written.
"""

ENDPOINTS = {}
