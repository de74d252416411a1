"""``{account}``-style placeholders in profile values, filled from the resolved settings.

A shipped profile cannot know the user's project, yet its cache paths live under it (Polaris:
``/eagle/projects/{account}/hf_cache``). Placeholders are filled once every layer (flag, ``PBSTK_*``,
config.yaml, profile) has been merged; a value that still needs one that is unset, or that holds the old
literal ``YOUR_PROJECT``, is refused before anything is written: a job that fails at model load an hour after
it was queued is the worst way to learn about it.
"""

from __future__ import annotations

import getpass
import re
from typing import Any

from pbs_toolkit.errors import ConfigError, UsageError
from pbs_toolkit.settings.config import how_to_set
from pbs_toolkit.settings.profiles import Profile, validate

#: ``{name}``, but not the shell's ``${name}`` (setup lines and env values are shell text)
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: the literal old profiles shipped for the user to edit; never a real project name
LITERAL_PLACEHOLDERS = ("YOUR_PROJECT",)
#: profile keys whose values may hold placeholders
FILLED_KEYS = ("runs_root", "venv", "hf_home", "vllm_cache_root", "setup", "env", "extra_directives")
#: placeholder -> the setting it comes from (``None``: not a setting)
SOURCES = {"account": "account", "project": "account", "queue": "queue", "user": None, "profile": None}


def placeholder_values(profile: Profile) -> dict[str, str | None]:
    """What each placeholder stands for; ``None`` where the setting is not set."""
    user = profile.ssh_host.split("@", 1)[0] if profile.ssh_host and "@" in profile.ssh_host else _login()
    return {"account": profile.account, "project": profile.account, "queue": profile.queue, "user": user,
            "profile": profile.name}


def _login() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: {user} cannot be filled
        return None


def fill_profile(profile: Profile) -> Profile:
    """``profile`` with every placeholder in :data:`FILLED_KEYS` filled; ``UsageError`` naming the key and how
    to set what is missing (``ConfigError`` for a placeholder that does not exist)."""
    values = placeholder_values(profile)
    changes: dict[str, Any] = {}
    for key in FILLED_KEYS:
        value = getattr(profile, key)
        if isinstance(value, list):
            changes[key] = [_fill(profile, key, item, values) for item in value]
        elif isinstance(value, dict):
            changes[key] = {k: _fill(profile, f"{key}.{k}", v, values) for k, v in value.items()}
        elif value is not None:
            changes[key] = _fill(profile, key, value, values)
    # filled values reach directive lines too (extra_directives): check them as the profile's own values
    return validate(profile.replaced(changes))


def _fill(profile: Profile, key: str, text: str, values: dict[str, str | None]) -> str:
    top = key.split(".", 1)[0]
    for literal in LITERAL_PLACEHOLDERS:
        if literal in text:
            raise UsageError(f"profile {profile.name}: {key} is {text!r}, which still holds {literal}: "
                             f"{how_to_set(top)} (or use {{account}} in the profile)")

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ConfigError(f"{profile.source}: key {key!r} has an unknown placeholder {{{name}}}: only "
                              f"{', '.join('{' + k + '}' for k in values)} are filled in")
        value = values[name]
        if value is None:
            setting = SOURCES[name]
            fix = how_to_set(setting) if setting else "set USER"
            raise UsageError(f"profile {profile.name}: {key} {text!r} needs {{{name}}}: {fix} "
                             f"(or set {top} itself: {how_to_set(top)})")
        return value

    return PLACEHOLDER.sub(one, text)


def unfilled(profile: Profile) -> list[str]:
    """Keys whose values still hold a placeholder (``config show`` marks them instead of failing)."""
    keys = []
    for key in FILLED_KEYS:
        value = getattr(profile, key)
        items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        if any(isinstance(v, str) and (PLACEHOLDER.search(v) or any(lit in v for lit in LITERAL_PLACEHOLDERS))
               for v in items):
            keys.append(key)
    return keys
