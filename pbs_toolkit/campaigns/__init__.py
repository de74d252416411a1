"""Campaigns: a command run against a server pbstk starts and stops for it (``pbstk run``), and what jobs and
services used (``pbstk usage``: node and GPU hours from the scheduler's accounting, requests and tokens from the
servers' own counters). docs/campaigns.md."""
