"""Multi-model services (issue 31; docs/multi-model.md): several models behind one service, packed into jobs.

``spec.py`` parses the models asked for; ``plan.py`` sizes each one and ``packing.py`` (pure) packs them into jobs;
``multi.py`` runs the plan as the service's slots and registers each model's vLLM with the router; ``per_model.py``
looks at each model on its own (its job, its log, its ``/metrics``).

Imports: ``services/router`` (the routing policies of ``router/script.py``) and the service's ``record`` and
``health``; never ``services/keeper``, which imports this (rung 2 of scripts/check_imports.py ``RUNGS``).
"""
