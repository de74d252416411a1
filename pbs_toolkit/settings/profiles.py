"""Site profiles: everything about a cluster that a job script needs, as YAML data.

Shipped profiles live in ``pbs_toolkit/settings/profiles/``; users add or override them in
``$XDG_CONFIG_HOME/pbstk/profiles/NAME.yaml`` or pass a path. No cluster is hard-coded in code.
"""

from __future__ import annotations

import re
import string
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbs_toolkit import paths
from pbs_toolkit.errors import ConfigError, UsageError
from pbs_toolkit.schedulers import BACKENDS, DEFAULT_BACKEND
from pbs_toolkit.schedulers.base import ProfileSection
from pbs_toolkit.settings.vllm_flags import DEFAULT_VLLM_VERSION, version_tuple
from pbs_toolkit.settings.yamlio import Fields, load_yaml_mapping, require_file

#: the registered scheduler backends (schedulers/__init__.py is the one list)
SCHEDULERS = tuple(BACKENDS)
ADDRESS_RULES = ("short", "fqdn", "ip", "loopback")
#: how a multi-node job starts one start script per node, whatever the scheduler (a backend adds its own:
#: ``Scheduler.node_launchers``; the local scheduler always uses its own, ``local``)
NODE_LAUNCHERS = ("mpiexec", "ssh")
#: how vLLM spans nodes: its own engines (native DP, ``--nnodes``), or a Ray cluster started per job
MULTINODE_ENGINES = ("native", "ray")
#: names a socket interface may have (``hsn0``, ``ib0``, ``eth0,eth1``, ``^lo,docker``); reaches a shell line quoted
_IFNAME = re.compile(r"^\^?[A-Za-z0-9_.:=-]+(,[A-Za-z0-9_.:=-]+)*$")
ENTRYPOINTS = ("serve", "api_server")
#: where a service's router may run (``job``: in a small CPU job of the profile's scheduler)
ROUTER_PLACES = ("auto", "local", "login", "job")
#: how the router is kept from other users: netns (its own network namespace behind pbstk's front) or none
ROUTER_ISOLATIONS = ("netns", "none")
ROUTER_POLICIES = ("round_robin", "power_of_two", "random", "cache_aware", "kv_aware", "consistent_hash",
                   "sticky_least_loaded")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    scheduler: str = DEFAULT_BACKEND
    queue: str | None = None
    account: str | None = None
    account_required: bool = False
    #: the keys only the profile's scheduler reads (its ``Scheduler.section_type``: a node request, a quality of
    #: service, ...); a profile file nests them under a section named after the backend, or keeps them flat
    backend: ProfileSection = field(default_factory=ProfileSection)
    walltime: str = "01:00:00"
    nodes: int = 1
    gpus_per_node: int = 4
    cpus_per_node: int = 32
    #: shell lines run before vLLM starts (modules, conda); trusted site configuration, rendered as written
    setup: list[str] = field(default_factory=list)
    venv: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    hf_home: str | None = None
    hf_hub_offline: bool = False
    #: a node-local directory (e.g. /local/scratch): each node copies the staged weights there at job start and
    #: vLLM loads that copy (docs/weights.md); empty: vLLM reads the shared filesystem
    stage_to: str = ""
    #: at most this many nodes copy to ``stage_to`` at once (the shared filesystem's readers)
    stage_to_parallel: int = 8
    vllm_cache_root: str | None = None
    #: a container image (Apptainer/Singularity .sif, or docker://...) that vLLM runs in; empty: no container
    container: str = ""
    #: the runtime that runs ``container``: apptainer or singularity (docs/coldstart.md)
    container_runtime: str = "apptainer"
    runs_root: str = "~/pbstk-runs"
    ssh_host: str | None = None
    #: this cluster's login nodes (shell patterns of the host name): there, with the scheduler's submit program
    #: on PATH, ``ssh_host`` is not used (settings/login_host.py)
    login_hosts: list[str] = field(default_factory=list)
    address: str = "short"
    address_suffix: str = ""
    bind_host: str = "0.0.0.0"
    port: int = 8000
    vllm_version: str = DEFAULT_VLLM_VERSION
    vllm_entrypoint: str = "serve"
    # -- several nodes (docs/vllm.md "Several nodes")
    #: how the job starts one start script per node: mpiexec (Cray PALS, --ppn 1), ssh, or the scheduler's own
    #: (``Scheduler.node_launchers``); empty: the scheduler's default
    node_launcher: str = ""
    #: ``native`` (vLLM's DP / --nnodes engines) or ``ray``
    multinode_engine: str = "native"
    #: exported as NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME on every node when set (hosts with several interfaces)
    nccl_socket_ifname: str = ""
    gloo_socket_ifname: str = ""
    #: memory of one GPU in GB, for ``auto`` sizing by weights; 0 = unknown (auto sizes by parameter count)
    gpu_memory_gb: int = 0
    # -- services (``pbstk serve``; docs/services.md)
    #: where a service's router runs: auto (local without ssh_host, else login), local, login, job
    router: str = "auto"
    #: the router program, split like a shell line (no shell runs it)
    router_command: str = "vllm-router"
    #: the router's load-balancing policy. power_of_two (with two workers: the one with fewer requests in flight):
    #: round_robin is blind to load and let two replicas drift apart under a closed-loop load on 2x H100 (0.91x of
    #: the same replicas driven directly); cache_aware measured -16% (benchmarks/README.md)
    router_policy: str = "power_of_two"
    #: the address the router binds ("" = 127.0.0.1 for a local router, ``bind_host`` on the login node)
    router_bind: str = ""
    #: netns: the router in a private network namespace, only service traffic passed on (its admin API: the
    #: owner's); none: the router itself on router_bind, its admin API open to anyone who reaches the port
    router_isolation: str = "netns"
    #: ``router: job``: the queue (partition) of the router's CPU job ("" = the profile's queue)
    router_job_queue: str = ""
    #: ``router: job``: the router job's walltime ("" = the profile's walltime)
    router_job_walltime: str = ""
    #: the queue's running-job limit per user (0 = unknown or none); keep-alive needs replicas x 2 to run at once
    max_running_jobs: int = 0
    #: idle reclaim (docs/idle.md): a server with no request for this long (``30m``) is stopped; "" = off
    idle_cancel: str = ""
    #: a vision-language model serves text only: no image or video per prompt (settings/multimodal.py)
    text_only: bool = False
    #: a service's restart policy (services/keeper/restarts.py; docs/services.md "Self-healing"): a failed replica is
    #: replaced at most max_restarts times in restart_window, waiting restart_backoff (doubling) before each
    max_restarts: int = 3
    restart_window: str = "30m"
    restart_backoff: str = "10s"
    #: a service's replica in the router leaves it after this many failed looks in a row (services/health.py) ...
    replica_unhealthy_looks: int = 3
    #: ... spanning at least this long (vllm-router's own 3 checks x 5 s)
    replica_unhealthy_after: str = "15s"
    source: str = "builtin"

    def __post_init__(self) -> None:
        # the section is always the scheduler's own type: a new scheduler (``--scheduler``) gets its keys, with
        # the values of keys both backends know carried over (as flat profiles always had them)
        wanted = section_type(self.scheduler)
        if type(self.backend) is not wanted:
            carried = {k: v for k, v in vars(self.backend).items() if k in _names(wanted)}
            object.__setattr__(self, "backend", wanted(**carried))

    if not TYPE_CHECKING:  # at run time only: typed code reads ``profile.backend``
        def __getattr__(self, key: str) -> Any:
            """A backend's key read flat (``getattr(profile, "qos")``: config show, placeholders, older code): the
            section's value, or, for a key only other backends read, its default there."""
            if key in BACKEND_KEYS and "backend" in self.__dict__:
                return getattr(self.backend, key, BACKEND_KEYS[key])
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def select_statement(self) -> str:
        """The backend's node request (``select``) with the node, GPU and CPU counts filled in; ``""`` for a
        backend that has none."""
        template = getattr(self.backend, "select", None)
        if template is None:
            return ""
        values = {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "cpus_per_node": self.cpus_per_node}
        return fill_placeholders(template, values, f"{self.source}: key 'select'")

    def replaced(self, changes: dict[str, Any]) -> Profile:
        """A copy with ``changes`` (flat keys, a backend's among them) applied, not validated. A key only other
        backends read is dropped, as a flat profile's always was (config.yaml may set it for all profiles)."""
        unknown = set(changes) - _KEYS
        if unknown:
            raise UsageError(f"unknown profile setting {sorted(unknown)[0]!r}")
        profile = replace(self, **{k: v for k, v in changes.items() if k not in BACKEND_KEYS})
        own = {k: v for k, v in changes.items() if k in _names(type(profile.backend))}
        return replace(profile, backend=replace(profile.backend, **own)) if own else profile

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        """A copy with ``overrides`` applied (flag, env and user-config values), validated again."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        # errors about overridden values must not blame the profile file
        source = self.source
        if clean:
            source = f"{self.source} with {', '.join(sorted(clean))} from flags/PBSTK_*/config.yaml"
        from pbs_toolkit.settings.this_host import without_ssh_here

        return without_ssh_here(validate(self.replaced({**clean, "source": source})), set(clean))

    def to_dict(self) -> dict[str, Any]:
        """A ``profile`` object (``profiles --json``; docs/json.md): every setting (a backend's flat, as in a flat
        profile file), ``gpus`` added, and the value of an ``env`` entry whose name looks secret (TOKEN, KEY,
        SECRET, PASSWORD) replaced by ``<hidden>``."""
        from dataclasses import asdict

        from pbs_toolkit.schema import stamp

        data: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "backend":
                data.update({k: getattr(self, k) for k in BACKEND_KEYS})
            else:
                data[key] = value
        data["env"] = {k: "<hidden>" if _SECRET_NAME.search(k) else v for k, v in self.env.items()}
        data["gpus"] = self.gpus
        return stamp("profile", data)


def section_type(scheduler: str) -> type[ProfileSection]:
    """The type of ``scheduler``'s profile section (the plain, empty one for a name not registered: ``validate``
    refuses that name)."""
    backend = BACKENDS.get(scheduler)
    return backend.section_type if backend is not None else ProfileSection


def _names(cls: type[ProfileSection]) -> set[str]:
    return {f.name for f in fields(cls)}


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


#: every backend's own keys -> its default (the first backend's, for a key several read)
BACKEND_KEYS: dict[str, Any] = {}
for _backend in BACKENDS.values():
    for _f in fields(_backend.section_type):
        BACKEND_KEYS.setdefault(_f.name, _default(_f))


def profile_defaults() -> dict[str, Any]:
    """Every profile key (a backend's too) -> its default, in the order ``config show`` lists them."""
    default = Profile(name="")
    out: dict[str, Any] = {}
    for f in fields(Profile):
        if f.name == "backend":
            out.update(BACKEND_KEYS)
        elif f.name not in ("name", "source"):
            out[f.name] = getattr(default, f.name)
    return out


#: environment variable names whose values ``Profile.to_dict`` does not print
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)


def fill_placeholders(template: str, values: dict[str, int], where: str) -> str:
    """``template`` with each plain ``{name}`` replaced from ``values``; anything else is a ``ConfigError``.

    ``str.format`` would also evaluate ``{nodes.__class__}``, ``{nodes[0]}``, ``{nodes!r}`` and format specs:
    a profile is data, so only the fixed placeholders are filled, and ``{{``/``}}`` stay literal braces.
    """
    out: list[str] = []
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:  # a lone "{" or "}"
        raise ConfigError(f"{where} is not a valid template: {exc}") from None
    for literal, field_name, spec, conversion in parts:
        out.append(literal)
        if field_name is None:
            continue
        if field_name not in values or spec or conversion:
            shown = "{" + field_name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ConfigError(f"{where} has an unknown placeholder {shown}: only "
                              f"{', '.join('{' + k + '}' for k in values)} are filled in")
        out.append(str(values[field_name]))
    return "".join(out)


_KEYS = ({f.name for f in fields(Profile)} - {"backend"}) | set(BACKEND_KEYS)
_WALLTIME_RE = re.compile(r"^(?:(\d+):)?([0-5]?\d):([0-5]\d)$")
_SECONDS_RE = re.compile(r"()()(\d+)")  # same groups as _WALLTIME_RE: hours, minutes, seconds
#: upper bounds: far above any real queue or node, far below what overflows a scheduler or a job script
MAX_WALLTIME_HOURS = 10000
MAX_NODES = 10000
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_NODE = 4096
MAX_GPU_MEMORY_GB = 4096


def walltime_seconds(text: str) -> int:
    """``HH:MM:SS`` (hours may exceed 24), ``MM:SS`` or plain seconds -> seconds; ``UsageError`` otherwise.

    Plain seconds are one scheduler's own form, and what YAML 1.1 makes of an unquoted ``walltime: 02:00:00`` (7200).
    """
    match = _WALLTIME_RE.fullmatch(str(text).strip()) or _SECONDS_RE.fullmatch(str(text).strip())
    if not match:
        raise UsageError(f"bad walltime {text!r}: expected HH:MM:SS with minutes and seconds below 60")
    groups = match.groups()
    if any(len(g) > 12 for g in groups if g):  # int() of a huge digit string is slow and pointless
        raise UsageError(f"bad walltime {text!r}: at most {MAX_WALLTIME_HOURS} hours")
    hours, minutes, seconds = (int(g) if g else 0 for g in groups)
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise UsageError(f"bad walltime {text!r}: must be positive")
    if total > MAX_WALLTIME_HOURS * 3600:
        raise UsageError(f"bad walltime {text!r}: at most {MAX_WALLTIME_HOURS} hours")
    return total


def validate(p: Profile) -> Profile:
    """Check the generic values here, and let the profile's backend check the ones it uses itself (values that
    reach job-script directive lines have no shell there: refused instead of quoted)."""
    where = p.source
    if p.scheduler not in SCHEDULERS:
        raise ConfigError(f"{where}: key 'scheduler' must be one of {', '.join(SCHEDULERS)}, got {p.scheduler!r}")
    BACKENDS[p.scheduler]().validate_profile(p, where)
    if p.address not in ADDRESS_RULES:
        raise ConfigError(f"{where}: key 'address' must be one of {', '.join(ADDRESS_RULES)}, got {p.address!r}")
    if p.vllm_entrypoint not in ENTRYPOINTS:
        raise ConfigError(f"{where}: key 'vllm_entrypoint' must be one of {', '.join(ENTRYPOINTS)}")
    walltime_seconds(p.walltime)
    for key, low, high in (("nodes", 1, MAX_NODES), ("gpus_per_node", 0, MAX_GPUS_PER_NODE),
                           ("cpus_per_node", 1, MAX_CPUS_PER_NODE), ("port", 1, 65535)):
        value = getattr(p, key)
        if isinstance(value, bool) or not isinstance(value, int):  # from config.yaml or PBSTK_* overrides
            raise ConfigError(f"{where}: key {key!r} must be an integer, got {value!r}")
        if not low <= value <= high:
            raise UsageError(f"bad {key.replace('_', ' ')} {value}: must be between {low} and {high}")
    if any(c.isspace() or not c.isprintable() for c in str(p.vllm_version)):
        raise ConfigError(f"{where}: key 'vllm_version' must be a version like 0.11.0, got {p.vllm_version!r}")
    try:
        version_tuple(p.vllm_version)
    except ValueError as exc:
        raise ConfigError(f"{where}: key 'vllm_version': {exc}") from exc
    _validate_multinode(p, where)
    _validate_router(p, where)
    _validate_container(p, where)
    for key in ("runs_root", "venv", "hf_home", "vllm_cache_root"):
        value = getattr(p, key)
        if value is not None and ("\n" in value or not value.strip()):
            raise ConfigError(f"{where}: key {key!r} must be a path on one line")
    _validate_stage_to(p, where)
    return p


def _validate_stage_to(p: Profile, where: str) -> None:
    """``stage_to``: an absolute path on the nodes' own disk; ``stage_to_parallel``: a node count."""
    if p.stage_to and (not isinstance(p.stage_to, str) or not p.stage_to.startswith("/")
                       or not p.stage_to.isprintable()):
        raise ConfigError(f"{where}: key 'stage_to' must be an absolute path on the nodes' local disk, "
                          f"got {p.stage_to!r}")
    parallel = p.stage_to_parallel
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= MAX_NODES:
        raise ConfigError(f"{where}: key 'stage_to_parallel' must be a whole number of nodes from 1 to {MAX_NODES}, "
                          f"got {parallel!r}")


def _validate_multinode(p: Profile, where: str) -> None:
    """The multi-node keys: a launcher and engine pbstk knows, interface names, a plausible GPU memory."""
    backend = BACKENDS[p.scheduler]
    launchers = sorted({*NODE_LAUNCHERS, *backend.node_launchers})
    # a backend with a fixed launcher ignores the key (a cluster profile tried with --scheduler local keeps its own)
    if p.node_launcher and p.node_launcher not in launchers and not backend.fixed_node_launcher:
        raise ConfigError(f"{where}: key 'node_launcher' must be one of {', '.join(launchers)}, "
                          f"got {p.node_launcher!r}")
    if p.multinode_engine not in MULTINODE_ENGINES:
        raise ConfigError(f"{where}: key 'multinode_engine' must be one of {', '.join(MULTINODE_ENGINES)}, "
                          f"got {p.multinode_engine!r}")
    for key in ("nccl_socket_ifname", "gloo_socket_ifname"):
        value = getattr(p, key)
        if value and not _IFNAME.fullmatch(str(value)):
            raise ConfigError(f"{where}: key {key!r} must be interface names like hsn0 or eth0,eth1, got {value!r}")
    gb = p.gpu_memory_gb
    if isinstance(gb, bool) or not isinstance(gb, int) or not 0 <= gb <= MAX_GPU_MEMORY_GB:
        raise ConfigError(f"{where}: key 'gpu_memory_gb' must be a whole number of GB between 0 (unknown) and "
                          f"{MAX_GPU_MEMORY_GB}, got {gb!r}")


def _validate_container(p: Profile, where: str) -> None:
    """The container keys: a runtime pbstk knows, an image named on one line."""
    from pbs_toolkit.server.coldstart import CONTAINER_RUNTIMES

    if p.container_runtime not in CONTAINER_RUNTIMES:
        raise ConfigError(f"{where}: key 'container_runtime' must be one of {', '.join(CONTAINER_RUNTIMES)}, "
                          f"got {p.container_runtime!r}")
    if p.container and ("\n" in p.container or not p.container.strip() or not p.container.isprintable()):
        raise ConfigError(f"{where}: key 'container' must be an image path or URI on one line")


def _validate_router(p: Profile, where: str) -> None:
    """The service keys: a known placement and policy, a router command on one line, a sane bind address."""
    if p.router not in ROUTER_PLACES:
        raise ConfigError(f"{where}: key 'router' must be one of {', '.join(ROUTER_PLACES)}, got {p.router!r}")
    if p.router_policy not in ROUTER_POLICIES:
        raise ConfigError(f"{where}: key 'router_policy' must be one of {', '.join(ROUTER_POLICIES)}, "
                          f"got {p.router_policy!r}")
    if p.router_isolation not in ROUTER_ISOLATIONS:
        raise ConfigError(f"{where}: key 'router_isolation' must be one of {', '.join(ROUTER_ISOLATIONS)}, "
                          f"got {p.router_isolation!r}")
    if not str(p.router_command).strip() or "\n" in str(p.router_command):
        raise ConfigError(f"{where}: key 'router_command' must be a command on one line")
    if p.router_bind and not re.fullmatch(r"[A-Za-z0-9.:_-]+", str(p.router_bind)):
        raise ConfigError(f"{where}: key 'router_bind' must be an address like 127.0.0.1, got {p.router_bind!r}")
    if p.router_job_queue and not re.fullmatch(r"[A-Za-z0-9_.@-]+", str(p.router_job_queue)):
        raise ConfigError(f"{where}: key 'router_job_queue' must be a queue name (letters, digits, _ . @ -), "
                          f"got {p.router_job_queue!r}")
    if p.router_job_walltime:
        walltime_seconds(str(p.router_job_walltime))
    jobs = p.max_running_jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 0 <= jobs <= 100000:
        raise ConfigError(f"{where}: key 'max_running_jobs' must be a whole number >= 0 (0: unknown), got {jobs!r}")
    looks = p.replica_unhealthy_looks
    if isinstance(looks, bool) or not isinstance(looks, int) or not 1 <= looks <= 1000:
        raise ConfigError(f"{where}: key 'replica_unhealthy_looks' must be a whole number from 1 to 1000, "
                          f"got {looks!r}")
    _validate_idle(p, where)


def _validate_idle(p: Profile, where: str) -> None:
    """``idle_cancel`` and the restart policy's durations and count."""
    from pbs_toolkit.durations import parse

    try:
        parse(p.idle_cancel, "idle_cancel", off=True)
        parse(p.restart_window, "restart_window")
        parse(p.restart_backoff, "restart_backoff")
        parse(p.replica_unhealthy_after, "replica_unhealthy_after")
    except UsageError as exc:
        raise ConfigError(f"{where}: key {exc.message}") from None
    count = p.max_restarts
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1000:
        raise ConfigError(f"{where}: key 'max_restarts' must be a whole number from 0 (never restart) to 1000, "
                          f"got {count!r}")


def _flatten_backend_section(data: dict[str, Any], source: Path) -> dict[str, Any]:
    """Lift the keys of the backend's own section (``pbs: {queue: ...}``) to the top level, where older flat
    profiles keep them; a key given both ways, or one the backend does not own, is refused."""
    name = data.get("scheduler", DEFAULT_BACKEND)
    section = data.get(name) if isinstance(name, str) and name in BACKENDS else None
    if section is None:
        return data
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: section {name!r} must be a mapping of {name} settings")
    owned = BACKENDS[name].profile_keys
    flat = {k: v for k, v in data.items() if k != name}
    for key, value in section.items():
        if key not in owned:
            raise ConfigError(f"{source}: section {name!r} has unknown key {key!r} (known: {', '.join(sorted(owned))})")
        if key in flat:
            raise ConfigError(f"{source}: key {key!r} is given both at the top level and in section {name!r}")
        flat[key] = value
    return flat


def _parse(data: dict[str, Any], source: Path) -> Profile:
    data = _flatten_backend_section(data, source)
    f = Fields(data, str(source), _KEYS - {"source"})
    values: dict[str, Any] = {}
    for key, current in profile_defaults().items():
        if key not in data:
            continue
        if isinstance(current, bool):
            values[key] = f.get_bool(key, current)
        elif isinstance(current, int):
            values[key] = f.get_int(key, current, minimum=0)
        elif isinstance(current, list):
            values[key] = f.get_str_list(key)
        elif isinstance(current, dict):
            values[key] = f.get_str_map(key)
        else:
            values[key] = f.get_str(key, current)
    # the scheduler first: its section takes the backend's keys
    name: Any = f.get_str("name", source.stem)
    profile = Profile(name=name, scheduler=values.pop("scheduler", DEFAULT_BACKEND), source=str(source))
    return validate(profile.replaced(values))


def _profile_files() -> dict[str, Path]:
    files = {p.stem: p for p in sorted((Path(__file__).parent / "profiles").glob("*.yaml"))}
    user_dir = paths.user_config_dir() / "profiles"
    if user_dir.is_dir():
        files.update({p.stem: p for p in sorted(user_dir.glob("*.yaml"))})
    return files


def list_profiles() -> list[Profile]:
    return [load_profile(name) for name in sorted(_profile_files())]


def profile_path(name_or_path: str) -> Path:
    """The YAML file of profile ``name_or_path`` (a name, the user's first, or a path)."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        require_file(path, "profile file")
        return path
    files = _profile_files()
    if name_or_path not in files:
        raise UsageError(f"unknown profile {name_or_path!r} (known: {', '.join(sorted(files))})")
    return files[name_or_path]


def load_profile_and_keys(name_or_path: str) -> tuple[Profile, frozenset[str]]:
    """The profile (:func:`load_profile`) and the keys its file sets itself (a backend section's keys included;
    the rest are defaults), from one read of the file."""
    path = profile_path(name_or_path)
    data = load_yaml_mapping(path)
    return _parse(data, path), frozenset(_flatten_backend_section(data, path)) - {"name"}


def load_profile(name_or_path: str) -> Profile:
    """Load a profile by name (the user's first) or from a YAML path."""
    path = profile_path(name_or_path)
    return _parse(load_yaml_mapping(path), path)
