"""What a launch would use, key by key, and where each value came from (``pbstk config show``,
``pbstk profiles show``).

Five layers set a profile key (flag, ``PBSTK_*``, config.yaml's ``profiles.NAME`` section, config.yaml's top
level, the profile file) over the package default; when a job script holds a surprising value, the question is
always "which layer set it", so each value is shown with its layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit.errors import UsageError
from pbs_toolkit.schema import stamp
from pbs_toolkit.settings.config import DEFAULT_PRESET, how_to_set, profile_kinds, resolve_settings
from pbs_toolkit.settings.placeholders import fill_profile, unfilled
from pbs_toolkit.settings.profiles import Profile, load_profile, profile_file_keys

DEFAULT = "package default"


@dataclass
class Resolved:
    """The resolved profile (placeholders filled where they can be) and the source of every key."""

    profile: Profile
    profile_source: str
    preset: str
    preset_source: str
    #: key -> (value, source, the value as written before placeholders were filled, or None)
    values: dict[str, tuple[Any, str, Any]] = field(default_factory=dict)
    #: what would stop a launch with these settings (an unfilled placeholder)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        keys = {}
        for key, (value, source, template) in self.values.items():
            keys[key] = {"value": value, "source": source, **({"template": template} if template is not None else {})}
        return stamp("settings", {
            "profile": self.profile.name, "profile_source": self.profile_source,
            "profile_file": self.profile.source.split(" with ", 1)[0], "preset": self.preset,
            "preset_source": self.preset_source, "settings": keys, "problems": self.problems})


def resolve(flags: dict[str, Any]) -> Resolved:
    """The settings ``flags`` (``None``: not given) resolve to, with the layer each came from."""
    settings = resolve_settings(flags)
    base = load_profile(settings.profile)
    from_file = profile_file_keys(settings.profile)
    overrides = dict(settings.profile_overrides)
    if settings.env_layers:
        overrides["env"] = settings.merged_env(base.env)
    written = base.with_overrides(overrides)
    problems: list[str] = []
    if written.account_required and not written.account:
        problems.append(f"profile {written.name} needs an account: {how_to_set('account')}")
    try:
        filled = fill_profile(written)
    except UsageError as exc:
        filled = written
        problems.append(exc.message)
    if not problems and unfilled(filled):
        problems = [f"unfilled placeholder in {', '.join(unfilled(filled))}"]
    values: dict[str, tuple[Any, str, Any]] = {}
    for key in profile_kinds():
        value, template = getattr(filled, key), getattr(written, key)
        values[key] = (value, _source(key, settings, from_file, base.name), template if template != value else None)
    preset = settings.preset  # a model's default_presets entry is not known here: no model
    preset_source = settings.sources.get("preset", DEFAULT)
    if preset is None:
        preset = "cpu" if filled.gpus == 0 else DEFAULT_PRESET
    return Resolved(profile=filled, profile_source=settings.sources.get("profile", DEFAULT), preset=str(preset),
                    preset_source=preset_source, values=values, problems=problems)


def _source(key: str, settings: Any, from_file: set[str], profile: str) -> str:
    if key == "env" and settings.env_layers:
        layers = [where for where, _ in settings.env_layers]
        return " + ".join(([f"profile {profile}"] if "env" in from_file else []) + layers)
    if key in settings.sources:
        return str(settings.sources[key])
    return f"profile {profile}" if key in from_file else DEFAULT
