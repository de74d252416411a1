"""Where the toolkit keeps things on this machine (XDG directories via ``platformdirs``)."""

from __future__ import annotations

from pathlib import Path


def user_config_dir() -> Path:
    """``$XDG_CONFIG_HOME/pbstk``: config.yaml, user presets/ and profiles/."""
    import platformdirs

    return Path(platformdirs.user_config_dir("pbstk", appauthor=False))


def user_state_dir() -> Path:
    """``$XDG_STATE_HOME/pbstk``: the job store and per-job secrets."""
    import platformdirs

    return Path(platformdirs.user_state_dir("pbstk", appauthor=False))


def user_data_dir() -> Path:
    """``$XDG_DATA_HOME/pbstk``: the default endpoint registry and tune results."""
    import platformdirs

    return Path(platformdirs.user_data_dir("pbstk", appauthor=False))
