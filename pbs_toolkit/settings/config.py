"""Settings in one documented order: command-line flag, then ``PBSTK_*`` environment variable, then the
user's ``$XDG_CONFIG_HOME/pbstk/config.yaml``, then the chosen site profile, then package defaults.

``config.yaml`` example::

    profile: polaris          # default profile
    preset: dp4               # default preset
    account: MYPROJECT        # any profile key applies to every profile ...
    env:                      # merged over the profile's env; a null value removes that variable
      http_proxy: null
    profiles:
      polaris:                # ... or to one profile only (wins over the lines above)
        pbs: {queue: preemptable}   # a backend's section, as in a profile file
        hf_home: /eagle/MYPROJECT/hf_cache
    default_presets:          # written by `pbstk tune --save`
      Qwen/Qwen3-VL-2B-Instruct: dp4
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError
from pbs_toolkit.schedulers import BACKENDS
from pbs_toolkit.settings.yamlio import user_config

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
    "hf_home": "PBSTK_HF_HOME",
    "vllm_cache_root": "PBSTK_VLLM_CACHE_ROOT",
    "idle_cancel": "PBSTK_IDLE_CANCEL",
    "text_only": "PBSTK_TEXT_ONLY",
}
#: the command-line flag of a setting, where it is not ``--`` + the key with dashes
FLAG_NAMES = {"ssh_host": "--ssh"}
#: settings that choose things rather than override profile fields
SELECTORS = {"profile", "preset"}
DEFAULT_PROFILE = "local"
DEFAULT_PRESET = "auto"


@functools.lru_cache(maxsize=1)
def profile_kinds() -> dict[str, str]:
    """Every profile key config.yaml may set -> the kind of value it takes (bool, int, list, map, str).

    Read from the ``Profile`` dataclass itself (and every backend's section), so a new profile key is settable in
    config.yaml at once."""
    from pbs_toolkit.settings.profiles import profile_defaults

    kinds: dict[str, str] = {}
    for key, value in profile_defaults().items():
        kinds[key] = ("bool" if isinstance(value, bool) else "int" if isinstance(value, int)
                         else "list" if isinstance(value, list) else "map" if isinstance(value, dict) else "str")
    return kinds


#: settings that also have a command-line flag (render, launch, tune; ``--ssh``/``--scheduler``: launch)
FLAGGED = {"queue", "account", "walltime", "nodes", "gpus_per_node", "port", "venv", "runs_root", "vllm_version",
           "hf_home", "vllm_cache_root", "scheduler", "ssh_host", "idle_cancel", "text_only"}


def flag_name(key: str) -> str:
    return FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def how_to_set(key: str) -> str:
    """``pass --hf-home, set PBSTK_HF_HOME or add 'hf_home:' to config.yaml``: every way to set ``key``."""
    ways = [f"pass {flag_name(key)}"] if key in FLAGGED else []
    if key in ENV_VARS:
        ways.append(f"set {ENV_VARS[key]}")
    ways.append(f"add '{key}:' to {paths.user_config_dir() / 'config.yaml'}")
    return ", ".join(ways[:-1]) + (" or " if len(ways) > 1 else "") + ways[-1]


@dataclass
class Settings:
    profile: str = DEFAULT_PROFILE
    preset: str | None = None
    #: profile field overrides from flags, env and user config (already merged in precedence order)
    profile_overrides: dict[str, Any] = field(default_factory=dict)
    default_presets: dict[str, str] = field(default_factory=dict)
    #: where each override (and ``profile``/``preset``) came from: ``flag --queue``, ``PBSTK_QUEUE``,
    #: ``config.yaml (profiles.polaris)``, ``config.yaml (global)``
    sources: dict[str, str] = field(default_factory=dict)
    #: ``env:`` mappings from config.yaml, weakest first, merged over the profile's ``env`` (``None`` removes)
    env_layers: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)

    def merged_env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` (the profile's ``env``) with every config.yaml ``env:`` layer applied in order."""
        env = dict(base)
        for _, layer in self.env_layers:
            for key, value in layer.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
        return env


def _checked(source: str, where: str, key: str, value: Any) -> Any:
    """``value`` of setting ``key`` from config.yaml (at ``where``) in the type the profile expects.

    YAML gives whatever was written (``port: abc``, ``preset: [1]``); refusing here names the file and key,
    instead of a traceback (or a wrong job script) far from the cause.
    """
    if value is None:
        return None
    kind = profile_kinds().get(key, "str")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: key {where!r} must be an integer, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: key {where!r} must be true or false, got {value!r}")
        return value
    if kind == "list":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(_scalar(v) for v in items):
            raise ConfigError(f"{source}: key {where!r} must be a list of strings, got {value!r}")
        return [str(v) for v in items]
    if kind == "map":
        return _checked_env(source, where, value)
    if not _scalar(value):
        raise ConfigError(f"{source}: key {where!r} must be a string, got {value!r}")
    return str(value)


def _scalar(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (str, int, float))


def _checked_env(source: str, where: str, value: Any) -> dict[str, str | None]:
    """An ``env:`` mapping: names to strings (numbers and booleans as the profile loader writes them); a
    ``null`` value stays ``None``, which removes that variable from the profile's ``env``."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: key {where!r} must be a mapping of names to strings, got {value!r}")
    out: dict[str, str | None] = {}
    for k, v in value.items():
        if isinstance(v, bool):
            v = "1" if v else "0"
        if v is not None and not _scalar(v):
            raise ConfigError(f"{source}: key '{where}.{k}' must be a string (or null to remove it), got {v!r}")
        out[str(k)] = None if v is None else str(v)
    return out


#: what a boolean ``PBSTK_*`` variable may say
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _env_value(key: str) -> Any:
    raw = os.environ.get(ENV_VARS[key])
    if key == "ssh_host" and raw is not None and not raw.strip():
        return ""  # PBSTK_SSH_HOST= (set, empty): no SSH, whatever the profile says
    if raw is None or raw == "":
        return None
    if profile_kinds().get(key) == "bool":
        if raw.lower() not in _BOOL_WORDS:
            raise ConfigError(f"{ENV_VARS[key]}={raw!r} is not one of {', '.join(_BOOL_WORDS)}")
        return _BOOL_WORDS[raw.lower()]
    if profile_kinds().get(key) == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{ENV_VARS[key]}={raw!r} is not an integer") from None
    return raw


def resolve_settings(flags: dict[str, Any]) -> Settings:
    """Merge ``flags`` (``None`` = not given) with env and the user config, in the documented order."""
    source = str(paths.user_config_dir() / "config.yaml")
    cfg = _checked_top_level(user_config(), source)
    sources: dict[str, str] = {}

    def pick(key: str) -> Any:
        if flags.get(key) is not None:
            sources[key] = f"flag {flag_name(key)}"
            return flags[key]
        env = _env_value(key) if key in ENV_VARS else None
        if env is not None:
            sources[key] = ENV_VARS[key]
        return env

    profile = pick("profile")
    if profile is None and cfg.get("profile") is not None:
        profile, sources["profile"] = cfg["profile"], "config.yaml (global)"
    profile = str(profile or DEFAULT_PROFILE)
    per_profile = _checked_profile_sections(cfg, source).get(profile) or {}
    #: config.yaml's layers, strongest first
    layers = [(f"config.yaml (profiles.{profile})", per_profile), ("config.yaml (global)", cfg)]

    def pick_all(key: str) -> Any:
        value = pick(key) if key in ENV_VARS else None
        for where, layer in layers:
            if value is None and layer.get(key) is not None:
                value, sources[key] = layer[key], where
        return value

    overrides = {key: pick_all(key) for key in profile_kinds() if key != "env"}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if str(overrides.get("ssh_host", "")).strip().lower() == "none":  # --ssh none: no SSH (docs: login node)
        overrides["ssh_host"] = ""
    env_layers = [(where, layer["env"]) for where, layer in reversed(layers) if layer.get("env")]
    preset = pick_all("preset")
    presets = _checked_default_presets(cfg, source)
    return Settings(
        profile=profile,
        preset=preset,
        profile_overrides=overrides,
        default_presets={str(k): str(v) for k, v in presets.items()},
        sources=sources,
        env_layers=env_layers,
    )


def _lift_backend_sections(level: dict[str, Any], source: str, prefix: str) -> dict[str, Any]:
    """``level`` with the keys of a backend section (``pbs: {queue: ...}``) lifted next to the plain ones, as in
    a profile file; a key the backend does not own, or one given both ways, is refused."""
    out = {k: v for k, v in level.items() if k not in BACKENDS}
    for name in BACKENDS:
        if name not in level:
            continue
        section = level[name]
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: key '{prefix}{name}' must be a mapping of {name} settings")
        owned = BACKENDS[name].profile_keys
        for key, value in section.items():
            if key not in owned:
                raise ConfigError(f"{source}: unknown key '{prefix}{name}.{key}' (known: {', '.join(sorted(owned))})")
            if key in out:
                raise ConfigError(f"{source}: key '{prefix}{key}' is given both directly and in section "
                                  f"'{prefix}{name}'")
            out[key] = value
    return out


def _checked_top_level(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """``cfg`` with unknown top-level keys refused and plain settings in the type the profile expects.

    The ``profiles`` and ``default_presets`` mappings pass through unchanged; they are checked on their own.
    """
    cfg = _lift_backend_sections(cfg, source, "")
    # ssh_persist: how long a held SSH login lives (transports.ssh_mux reads it)
    known = set(profile_kinds()) | SELECTORS | {"profiles", "default_presets", "ssh_persist"}
    for key in cfg:
        if key not in known:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(known | set(BACKENDS)))})")
    return {k: v if k in ("profiles", "default_presets") else _checked(source, k, k, v) for k, v in cfg.items()}


def _checked_profile_sections(cfg: dict[str, Any], source: str) -> dict[Any, Any]:
    """The ``profiles:`` mapping, every section checked (and its values converted).

    Every section, not only the chosen one: a typo should not wait until someone picks its profile.
    """
    all_profiles = cfg.get("profiles") or {}
    if not isinstance(all_profiles, dict):
        raise ConfigError(f"{source}: key 'profiles' must be a mapping of profile name: settings")
    per_profile_known = set(profile_kinds()) | {"preset"}
    checked: dict[Any, Any] = {}
    for name, section in all_profiles.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: key 'profiles.{name}' must be a mapping")
        section = _lift_backend_sections(section, source, f"profiles.{name}.")
        for key in section:
            if key not in per_profile_known:
                raise ConfigError(f"{source}: unknown key 'profiles.{name}.{key}' "
                                  f"(known: {', '.join(sorted(per_profile_known | set(BACKENDS)))})")
        checked[name] = {k: _checked(source, f"profiles.{name}.{k}", k, v) for k, v in section.items()}
    return checked


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
