"""One launch's settings, resolved once: :func:`resolve_launch_settings` turns a :class:`RenderRequest` (model,
preset, profile, flags) plus ``PBSTK_*`` and the user's config.yaml into one immutable :class:`LaunchSettings`
that remembers where each value came from.

Five layers set a profile key (flag, ``PBSTK_*``, config.yaml's ``profiles.NAME`` section, config.yaml's top
level, the profile file) over the package default; when a job script holds a surprising value, the question is
always "which layer set it", so each value keeps its layer (``pbstk config show``, ``pbstk profiles show``).

Everything downstream takes the object and never goes back to the files: choosing the runner (the profile's
``ssh_host``), planning the layout (jobs/plan.py), rendering, launching, a service's replicas, ``tune``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from pbs_toolkit.errors import PbstkError, UsageError
from pbs_toolkit.schema import stamp
from pbs_toolkit.settings.config import DEFAULT_PRESET, Settings, how_to_set, profile_kinds, resolve_settings
from pbs_toolkit.settings.config import flag_name as setting_flag
from pbs_toolkit.settings.machine_gpus import learn
from pbs_toolkit.settings.placeholders import fill_profile, unfilled
from pbs_toolkit.settings.profiles import Profile, load_profile_and_keys

DEFAULT = "package default"


@dataclass
class RenderRequest:
    """Everything ``render`` needs. ``None`` means "take it from env / user config / profile / preset"."""

    model: str
    preset: str | None = None
    profile: str | None = None
    name: str | None = None
    served_model_name: str | None = None
    port: int | str | None = None  # a number, "auto", or None (profile's port, auto-advance)
    queue: str | None = None
    account: str | None = None
    walltime: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    venv: str | None = None
    runs_root: str | None = None
    vllm_version: str | None = None
    hf_home: str | None = None
    vllm_cache_root: str | None = None
    scheduler: str | None = None
    ssh_host: str | None = None
    eager: bool | None = None
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    run_dir: str | None = None
    #: ``--idle-cancel``: stop the server after this long without a request (``30m``; ``off``); None: profile's
    idle_cancel: str | None = None
    #: the lease of ``pbstk run`` in whole seconds (campaigns/lease.py): the job ends itself once the run has not
    #: renewed it for this long; 0: no lease (``launch``, ``serve``, ``run --keep``)
    lease_s: int = 0
    #: ``--text-only``/``--no-text-only``: a vision-language model takes no image or video; None: profile's/preset's
    text_only: bool | None = None
    #: a job of a multi-model service (docs/multi-model.md): every model it serves, ``model`` first, each a
    #: mapping ``model``, ``preset``, ``served_model_name``, ``gpus`` (planned GPU indices), ``share``
    #: (``--gpu-memory-utilization``, None: the preset's); empty (the usual): one model, rendered as ever
    models: list[dict[str, Any]] = field(default_factory=list)


def request_flags(req: RenderRequest) -> dict[str, Any]:
    """The settings ``req`` gives as flags (``None``: not given), for :func:`resolve_settings`."""
    return {
        "profile": req.profile, "preset": req.preset, "queue": req.queue, "account": req.account,
        "walltime": req.walltime, "nodes": req.nodes, "gpus_per_node": req.gpus_per_node,
        "venv": req.venv, "runs_root": req.runs_root, "vllm_version": req.vllm_version,
        "hf_home": req.hf_home, "vllm_cache_root": req.vllm_cache_root,
        "scheduler": req.scheduler, "ssh_host": req.ssh_host,
        "port": req.port if isinstance(req.port, int) else None, "idle_cancel": req.idle_cancel,
        "text_only": req.text_only,
    }


#: request fields that take part in resolution (the rest only shape the job: its name, vLLM arguments, ...)
_RESOLVING = frozenset(request_flags(RenderRequest(model="")))


@dataclass(frozen=True)
class NodesAsked:
    """A node count the user asked for (flag, ``PBSTK_NODES``, config.yaml, or a profile that says more than
    one), and how to name it in an error; ``count`` ``None``: the preset decides."""

    count: int | None = None
    named: str = "--nodes"


@dataclass(frozen=True)
class LaunchSettings:
    """What one launch uses, resolved once, with the layer each value came from. Build it with
    :func:`resolve_launch_settings`; change a job-shaping field with :meth:`with_request`."""

    #: what was asked: the model, the flags, the job's name, vLLM arguments (``env`` may hold a token)
    request: RenderRequest = field(repr=False)
    #: the profile with every layer applied, placeholders as written
    written: Profile = field(repr=False)
    #: ``written`` with its placeholders filled (``written`` itself where that failed: ``fill_error``)
    profile: Profile = field(repr=False)
    #: profile key -> its layer (``flag --queue``, ``PBSTK_QUEUE``, ``config.yaml (...)``, ``profile NAME``,
    #: ``package default``)
    sources: Mapping[str, str]
    profile_source: str
    #: the preset a flag, ``PBSTK_PRESET``, config.yaml or the model's ``default_presets`` entry names; ``None``:
    #: the profile's default (:attr:`preset_name`)
    preset: str | None
    preset_source: str
    #: the settings a flag, ``PBSTK_*`` or config.yaml set (``profile``, ``preset`` and profile keys)
    explicit: frozenset[str]
    #: the GPU count per node was set by the user (a smaller preset does not shrink it)
    gpus_given: bool
    nodes_asked: NodesAsked
    #: why the placeholders could not be filled; raised by :meth:`launchable`
    fill_error: PbstkError | None = field(default=None, repr=False, compare=False)

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def preset_name(self) -> str:
        """The preset to launch: the one named, else ``cpu`` for a profile without GPUs, else ``auto``."""
        return self.preset or ("cpu" if self.profile.gpus == 0 else DEFAULT_PRESET)

    def launchable(self) -> Profile:
        """The filled profile, or the first reason it cannot launch: an account the site requires is missing,
        a placeholder cannot be filled. Cheap and offline: checked before any SSH login."""
        if self.written.account_required and not self.written.account:
            raise UsageError(
                f"profile {self.written.name} needs an account: pass --account, set PBSTK_ACCOUNT, "
                "or add 'account:' to your pbstk config.yaml"
            )
        if self.fill_error is not None:
            raise self.fill_error
        return self.profile

    def with_request(self, **changes: Any) -> LaunchSettings:
        """These settings for a request with ``changes`` to fields that do not take part in resolution (name,
        env, run_dir, vLLM arguments, ...), or to ``preset`` (as a flag names it: ``tune``); no file is read."""
        resolving = set(changes) & _RESOLVING - ({"preset"} if changes.get("preset") is not None else set())
        if resolving:
            raise ValueError(f"with_request cannot change {sorted(resolving)}: resolve the request again")
        settings = replace(self, request=_copy(replace(self.request, **changes)))
        if "preset" in changes:
            settings = replace(settings, preset=changes["preset"], preset_source=f"flag {setting_flag('preset')}")
        return settings

    def values(self) -> dict[str, tuple[Any, str, Any]]:
        """Profile key -> (value, source, the value as written before placeholders were filled, or ``None``)."""
        out: dict[str, tuple[Any, str, Any]] = {}
        for key in profile_kinds():
            value, template = getattr(self.profile, key), getattr(self.written, key)
            out[key] = (value, self.sources[key], template if template != value else None)
        return out

    def problems(self) -> list[str]:
        """What would stop a launch with these settings, one line each (``config show`` warns instead of
        failing); a placeholder that does not exist is a ``ConfigError`` here as well."""
        problems: list[str] = []
        if self.written.account_required and not self.written.account:
            problems.append(f"profile {self.written.name} needs an account: {how_to_set('account')}")
        if isinstance(self.fill_error, UsageError):
            problems.append(self.fill_error.message)
        elif self.fill_error is not None:
            raise self.fill_error
        if not problems and unfilled(self.profile):
            problems = [f"unfilled placeholder in {', '.join(unfilled(self.profile))}"]
        return problems

    def to_dict(self) -> dict[str, Any]:
        """A ``settings`` object (``config show --json``, ``profiles show --json``; docs/json.md)."""
        keys = {}
        for key, (value, source, template) in self.values().items():
            keys[key] = {"value": value, "source": source, **({"template": template} if template is not None else {})}
        return stamp("settings", {
            "profile": self.profile.name, "profile_source": self.profile_source,
            "profile_file": self.profile.source.split(" with ", 1)[0], "preset": self.preset_name,
            "preset_source": self.preset_source, "settings": keys, "problems": self.problems()})


def resolve_launch_settings(req: RenderRequest) -> LaunchSettings:
    """The one resolution: ``req``'s flags over ``PBSTK_*`` over config.yaml over the profile file over the
    package defaults, the profile file and config.yaml read once each. ``req.model`` ``""``: no model (``config
    show``; a model's ``default_presets`` entry then does not apply). Bad settings raise here (``ConfigError``,
    ``UsageError``), except what :meth:`LaunchSettings.launchable` reports."""
    settings = resolve_settings(request_flags(req))
    base, from_file = load_profile_and_keys(settings.profile)
    overrides = dict(settings.profile_overrides)
    if settings.env_layers:
        overrides["env"] = settings.merged_env(base.env)
    written, learnt = learn(base.with_overrides(overrides),
                            lambda key: key in from_file or key in settings.profile_overrides)
    try:
        filled, fill_error = fill_profile(written), None
    except PbstkError as exc:
        filled, fill_error = written, exc
    preset = settings.preset or settings.default_presets.get(req.model)
    if settings.preset is not None:
        preset_source = settings.sources.get("preset", DEFAULT)
    else:
        preset_source = f"config.yaml (default_presets.{req.model})" if preset is not None else DEFAULT
    return LaunchSettings(
        request=_copy(req), written=written, profile=filled, profile_source=settings.sources.get("profile", DEFAULT),
        sources=MappingProxyType({key: learnt.get(key) or _source(key, settings, from_file, base.name)
                                  for key in profile_kinds()}),
        preset=preset, preset_source=preset_source, explicit=frozenset(settings.sources),
        gpus_given="gpus_per_node" in settings.profile_overrides, nodes_asked=_nodes_asked(settings, written),
        fill_error=fill_error)


def _copy(req: RenderRequest) -> RenderRequest:
    """A copy of ``req`` that later changes to the caller's request (its lists and mappings too) leave alone."""
    return replace(req, vllm_args=list(req.vllm_args or ()), env=dict(req.env or {}))


def settings_of(value: RenderRequest | LaunchSettings) -> LaunchSettings:
    """``value`` resolved (:func:`resolve_launch_settings`) unless it already is."""
    return value if isinstance(value, LaunchSettings) else resolve_launch_settings(value)


def _nodes_asked(settings: Settings, profile: Profile) -> NodesAsked:
    if "nodes" in settings.profile_overrides:
        source = settings.sources.get("nodes", "")
        return NodesAsked(profile.nodes, setting_flag("nodes") if source.startswith("flag") else f"nodes ({source})")
    if profile.nodes > 1:  # a profile of one node is the default, not a request: a larger preset widens it
        return NodesAsked(profile.nodes, f"nodes (profile {profile.name})")
    return NodesAsked()


def _source(key: str, settings: Settings, from_file: frozenset[str], profile: str) -> str:
    if key == "env" and settings.env_layers:
        layers = [where for where, _ in settings.env_layers]
        return " + ".join(([f"profile {profile}"] if "env" in from_file else []) + layers)
    if key in settings.sources:
        return str(settings.sources[key])
    return f"profile {profile}" if key in from_file else DEFAULT
