"""Settings in one documented order: command-line flag, then ``PBSTK_*`` environment variable, then the
user's ``$XDG_CONFIG_HOME/pbstk/config.yaml``, then the chosen site profile, then package defaults.

``config.yaml`` example::

    profile: polaris          # default profile
    preset: dp4               # default preset
    account: MYPROJECT        # any profile setting applies to every profile ...
    profiles:
      polaris:                # ... or to one profile only (wins over the line above)
        queue: preemptable
    default_presets:          # written by `pbstk tune --save`
      Qwen/Qwen3-VL-2B-Instruct: dp4
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError
from pbs_toolkit.settings.yamlio import load_yaml_mapping

#: setting -> environment variable; integers are converted
ENV_VARS: dict[str, str] = {
    "profile": "PBSTK_PROFILE",
    "preset": "PBSTK_PRESET",
    "scheduler": "PBSTK_SCHEDULER",
    "ssh_host": "PBSTK_SSH_HOST",
    "queue": "PBSTK_QUEUE",
    "account": "PBSTK_ACCOUNT",
    "walltime": "PBSTK_WALLTIME",
    "nodes": "PBSTK_NODES",
    "gpus_per_node": "PBSTK_GPUS_PER_NODE",
    "venv": "PBSTK_VENV",
    "runs_root": "PBSTK_RUNS_ROOT",
    "vllm_version": "PBSTK_VLLM_VERSION",
    "port": "PBSTK_PORT",
}
INT_SETTINGS = {"nodes", "gpus_per_node", "port"}
#: settings that choose things rather than override profile fields
SELECTORS = {"profile", "preset"}
DEFAULT_PROFILE = "local"
DEFAULT_PRESET = "auto"


@dataclass
class Settings:
    profile: str = DEFAULT_PROFILE
    preset: str | None = None
    #: profile field overrides from flags, env and user config (already merged in precedence order)
    profile_overrides: dict[str, Any] = field(default_factory=dict)
    default_presets: dict[str, str] = field(default_factory=dict)


def user_config() -> dict[str, Any]:
    path = paths.user_config_dir() / "config.yaml"
    if not path.is_file():
        return {}
    return load_yaml_mapping(path)


def _checked(source: str, where: str, key: str, value: Any) -> Any:
    """``value`` of setting ``key`` from config.yaml (at ``where``) in the type the profile expects.

    YAML gives whatever was written (``port: abc``, ``preset: [1]``); refusing here names the file and key,
    instead of a traceback (or a wrong job script) far from the cause.
    """
    if value is None:
        return None
    if key in INT_SETTINGS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: key {where!r} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{source}: key {where!r} must be a string, got {value!r}")
    return str(value)


def _env_value(key: str) -> Any:
    raw = os.environ.get(ENV_VARS[key])
    if raw is None or raw == "":
        return None
    if key in INT_SETTINGS:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{ENV_VARS[key]}={raw!r} is not an integer") from None
    return raw


def resolve_settings(flags: dict[str, Any]) -> Settings:
    """Merge ``flags`` (``None`` = not given) with env and the user config, in the documented order."""
    source = str(paths.user_config_dir() / "config.yaml")
    cfg = _checked_top_level(user_config(), source)

    def pick(key: str) -> Any:
        if flags.get(key) is not None:
            return flags[key]
        env = _env_value(key) if key in ENV_VARS else None
        return env

    profile = pick("profile") or cfg.get("profile") or DEFAULT_PROFILE
    per_profile = _checked_profile_sections(cfg, source).get(profile) or {}
    overrides: dict[str, Any] = {}
    for key in ENV_VARS:
        if key in SELECTORS:
            continue
        value = pick(key)
        if value is None:
            value = per_profile.get(key, cfg.get(key))
        if value is not None:
            overrides[key] = value
    presets = _checked_default_presets(cfg, source)
    return Settings(
        profile=str(profile),
        preset=pick("preset") or per_profile.get("preset") or cfg.get("preset"),
        profile_overrides=overrides,
        default_presets={str(k): str(v) for k, v in presets.items()},
    )


def _checked_top_level(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """``cfg`` with unknown top-level keys refused and plain settings in the type the profile expects.

    The ``profiles`` and ``default_presets`` mappings pass through unchanged; they are checked on their own.
    """
    known = set(ENV_VARS) | {"profiles", "default_presets", "ssh_persist"}  # ssh_persist: transports.ssh_mux
    for key in cfg:
        if key not in known:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    return {k: v if k in ("profiles", "default_presets") else _checked(source, k, k, v) for k, v in cfg.items()}


def _checked_profile_sections(cfg: dict[str, Any], source: str) -> dict[Any, Any]:
    """The ``profiles:`` mapping, every section checked (and its values converted in place).

    Every section, not only the chosen one: a typo should not wait until someone picks its profile.
    """
    all_profiles = cfg.get("profiles") or {}
    if not isinstance(all_profiles, dict):
        raise ConfigError(f"{source}: key 'profiles' must be a mapping of profile name: settings")
    per_profile_known = set(ENV_VARS) - {"profile"}
    for name, section in all_profiles.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: key 'profiles.{name}' must be a mapping")
        for key in section:
            if key not in per_profile_known:
                raise ConfigError(f"{source}: unknown key 'profiles.{name}.{key}' "
                                  f"(known: {', '.join(sorted(per_profile_known))})")
            section[key] = _checked(source, f"profiles.{name}.{key}", key, section[key])
    return all_profiles


def _checked_default_presets(cfg: dict[str, Any], source: str) -> dict[Any, Any]:
    """The ``default_presets:`` mapping (model: preset name), each name checked to be a string."""
    presets = cfg.get("default_presets") or {}
    if not isinstance(presets, dict):
        raise ConfigError(f"{source}: key 'default_presets' must be a mapping of model: preset")
    for model, name in presets.items():
        _checked(source, f"default_presets.{model}", "preset", name)
    return presets


def save_default_preset(model: str, preset: str) -> str:
    """Record ``preset`` as the user's default for ``model`` in config.yaml; returns the file path."""
    import yaml

    path = paths.user_config_dir() / "config.yaml"
    cfg = user_config()
    cfg.setdefault("default_presets", {})[model] = preset
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return str(path)
