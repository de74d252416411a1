"""Services: several ordinary pbstk servers (replicas) behind one vllm-router, with one URL and one key.

The modules at this level are the service's life: its record and state (``record``, ``state``, ``intents``), what
it needs from its caller (``session``, ``api``), starting, watching and stopping it (``manage``, ``status``,
``ready``, ``health``, ``observe``, ``stop``, ``cancel_all``, ``lease``, ``entry``). Three subpackages hold the rest,
each on a rung (scripts/check_imports.py ``RUNGS``): ``router`` (1), the vllm-router itself; ``models`` (2),
multi-model services; ``keeper`` (3), the detached process that keeps the router true to the replicas. A
subpackage imports those below it and the modules at this level, never one above; the modules at this level may
import all three.
"""
