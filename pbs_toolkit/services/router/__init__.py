"""The router: a service's vllm-router, where it runs, how it starts and stops, its admin API and its figures.

``process.py`` starts, checks and stops the router on this machine or a login node (``router: local``/``login``),
detached; ``job.py`` runs it inside a small CPU job instead (``router: job``); ``script.py`` renders
``start_router.sh``, the one start procedure of both; ``admin.py`` is its admin API (``/list_workers``,
``/add_worker``, ``/remove_worker``) and plain HTTP to it; ``metrics.py`` reads its Prometheus figures.

What runs on the router's host beside vllm-router is not here but in ``pbs_toolkit/server/`` (floor 1: what runs
inside a job, importing only the neutral modules), shipped or copied from there: ``server/start_router.sh`` (the
start procedure's static body), ``server/router_front.py`` (the front that keeps the admin API behind the router's
token), ``server/router_relay.py`` (the front's data path) and ``server/router_models.py`` (``GET /v1/models`` of a
multi-model service).

Imports: the service's ``record``, ``session`` and ``intents``, and lower floors; never ``services/models`` nor
``services/keeper``, which import this (rung 1 of scripts/check_imports.py ``RUNGS``).
"""
