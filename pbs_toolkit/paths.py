"""Where the toolkit keeps things on this machine (XDG directories via ``platformdirs``).

On Linux the plain case (the variable an absolute path, or unset under an absolute ``HOME``) is answered here
without importing ``platformdirs``: its unix module imports ``tempfile``, hence ``shutil``, ``random`` and the
compressors, about a third of what ``pbstk logs -n`` of a local job costs beyond ``pbstk --version``. Every
other case (another system, Android, a relative value, no usable ``HOME``) is platformdirs' to answer;
tests/test_paths.py holds both to the same directories.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP = "pbstk"


def _plain_xdg(variable: str, under_home: str) -> Path | None:
    """The XDG base directory ``variable`` names, as platformdirs gives it on Linux in the plain case: its value
    when absolute, else ``$HOME/under_home`` while it is unset and ``HOME`` is absolute; ``None`` otherwise."""
    if sys.platform != "linux" or hasattr(sys, "getandroidapilevel"):
        return None
    value = os.environ.get(variable, "")
    if value:
        return Path(value) if os.path.isabs(value) else None
    home = os.environ.get("HOME", "")
    return Path(home) / under_home if os.path.isabs(home) else None


def _user_dir(variable: str, under_home: str, platformdirs_name: str) -> Path:
    """pbstk's directory under the XDG base ``variable``: ``_plain_xdg``'s, else ``platformdirs.<name>``'s."""
    base = _plain_xdg(variable, under_home)
    if base is not None:
        return base / APP
    import platformdirs  # here: only where the plain case does not answer (see the module's docstring)

    return Path(getattr(platformdirs, platformdirs_name)(APP, appauthor=False))


def user_config_dir() -> Path:
    """``$XDG_CONFIG_HOME/pbstk``: config.yaml, user presets/ and profiles/."""
    return _user_dir("XDG_CONFIG_HOME", ".config", "user_config_dir")


def user_state_dir() -> Path:
    """``$XDG_STATE_HOME/pbstk``: the job store and per-job secrets."""
    return _user_dir("XDG_STATE_HOME", ".local/state", "user_state_dir")


def user_data_dir() -> Path:
    """``$XDG_DATA_HOME/pbstk``: the default endpoint registry and tune results."""
    return _user_dir("XDG_DATA_HOME", ".local/share", "user_data_dir")
