"""The phases the start script writes into ``server.json``, defined once for bash and Python.

The settings header of every rendered ``start_vllm.sh`` assigns ``PHASE_<NAME>=<value>`` for each member, and
the static body writes only those variables; pbstk reads the marker back with the same enum, so a phase
renamed here changes both sides at once (tests/test_start_script.py checks the body uses no other phase).
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    """A ``server.json`` phase. A ``str`` so markers compare and serialise as the plain strings bash wrote."""

    SETUP = "setup"  # the job started: site setup, venv, environment
    STARTING = "starting"  # vLLM was started and has not bound its port yet
    READY = "ready"  # vLLM's port accepts connections
    FAILED = "failed"  # the start failed (setup, no vLLM, no port) or vLLM died before it was ready
    EXITED = "exited"  # vLLM ran and exited (code in ``exit_code``)
    CANCELLED = "cancelled"  # the job got a stop signal (the scheduler's cancel, walltime, pbstk cancel)

    def __str__(self) -> str:  # f-strings and str() give the value on every Python version
        return self.value


# Sets of the plain values: an Enum member hashes by its name, so ``"ready" in {Phase.READY}`` would be False.
#: phases after which the start script writes nothing more
FINAL_PHASES = frozenset(p.value for p in (Phase.FAILED, Phase.EXITED, Phase.CANCELLED))
#: phases in which a server may be listening on the marker's port
LISTENING_PHASES = frozenset(p.value for p in (Phase.STARTING, Phase.READY))


def bash_assignments() -> list[str]:
    """``PHASE_READY=ready`` lines for the start script's settings header (values are plain words)."""
    return [f"PHASE_{phase.name}={phase.value}" for phase in Phase]
