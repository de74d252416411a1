"""Running pbstk on a cluster's login node itself.

Two rules (issue 21, items 9 and 10; README "On the login node"):

- No SSH to yourself: a profile's ``ssh_host`` is ignored when this host matches one of the profile's
  ``login_hosts`` patterns and its scheduler's submit program (the backend's ``submit_program``) is on PATH. An explicit
  ``--ssh HOST``/``PBSTK_SSH_HOST``/config.yaml ``ssh_host`` still wins; ``--ssh none``, ``--ssh ""`` or an empty
  ``PBSTK_SSH_HOST=`` mean no SSH anywhere (config.py turns them into ``""``).
- No silent local server on a shared login node: ``launch`` without a profile (no ``--profile``,
  ``PBSTK_PROFILE`` or config.yaml ``profile:``), that would run the local scheduler on this machine while a
  scheduler's submit program is on PATH, is refused in one line naming ``--profile`` (and the profile whose
  ``login_hosts`` match this host, if one does). ``--profile local`` or ``--scheduler local`` says you mean it.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection
from typing import TYPE_CHECKING

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schedulers import BACKENDS, runs_on_submit_host
from pbs_toolkit.settings.profiles import list_profiles
from pbs_toolkit.settings.this_host import on_login_host, submit_program

if TYPE_CHECKING:
    from pbs_toolkit.settings.profiles import Profile


def refuse_unchosen_local(explicit: Collection[str], profile: Profile) -> None:
    """Refuse a launch on the default ``local`` profile when a scheduler's submit program is on PATH
    (``explicit``: the settings a flag, ``PBSTK_*`` or config.yaml set, ``LaunchSettings.explicit``)."""
    if "profile" in explicit or "scheduler" in explicit:
        return
    if not runs_on_submit_host(profile.scheduler) or profile.ssh_host:
        return
    programs = sorted({p for name in BACKENDS if (p := submit_program(name)) and shutil.which(p)})
    if not programs:
        return

    here = [p.name for p in list_profiles() if on_login_host(p)]
    pick = f"--profile {here[0]} for this cluster" if len(here) == 1 else "--profile NAME (`pbstk profiles`)"
    raise UsageError(f"{' and '.join(programs)} on PATH (a cluster login node?) but no profile chosen: pass {pick}, "
                     "or --profile local to run the server on this machine")
