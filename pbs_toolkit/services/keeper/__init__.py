"""The keeper of a service: its ticks, a tick's work on each slot, its restart and scaling policies, its process.

``loop.py`` runs its ticks; ``slots.py`` is a tick's work on one replica slot (routing, hand-over, replacement);
``restarts.py`` is the restart policy of an ended replica; ``autoscale.py`` is the autoscaling policy and
``scaler.py`` what a tick does with it (and with ``--idle-cancel``); ``process.py`` is the detached process itself:
its directory, starting it, its heartbeat, stopping it.

Imports: ``services/models`` (a multi-model slot's workers, each model's server), ``services/router`` (its admin API
and figures) and the service's modules around it (``record``, ``state``, ``health``, ``lease``, ``intents``,
``manage``'s ``launch_replica``, ``stop``'s ``teardown``): rung 3 of scripts/check_imports.py ``RUNGS``, the top
one; neither models nor the router imports it.
"""
