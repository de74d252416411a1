"""Profile key ``stage_to``: the start script's block that copies the staged weights to each node's own disk.

The bash is ``server/stage_copy.sh`` (functions only); the body calls ``pbstk_stage_copy`` on each node once its
rank is known, when ``STAGE_TO`` is set. Without ``stage_to`` nothing is added, so a start script is unchanged.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.weights.preflight import revision_of

STAGE_COPY = Path(__file__).resolve().parent.parent / "server" / "stage_copy.sh"
#: the settings the block assigns: like the header's, an ``--env`` of one is refused (it would redirect the copy)
STAGE_SETTINGS = frozenset({"STAGE_TO", "STAGE_REVISION", "STAGE_PARALLEL"})


def stage_copy_block(profile: Profile, vllm_args: Sequence[str]) -> str:
    """The settings and functions of the node-local copy for a start script ("" when ``stage_to`` is unset)."""
    if not profile.stage_to:
        return ""
    settings = (f"# profile key stage_to: each node copies the model to its own disk (docs/weights.md)\n"
                f"STAGE_TO={shlex.quote(profile.stage_to)}\n"
                f"STAGE_REVISION={shlex.quote(revision_of(vllm_args))}\n"
                f"STAGE_PARALLEL={int(profile.stage_to_parallel)}\n")
    return settings + STAGE_COPY.read_text(encoding="utf-8")
