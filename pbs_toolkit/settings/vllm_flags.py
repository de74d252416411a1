"""Which vLLM flags exist in which version: the data presets and ``doctor`` consult.

Sources: docs/vllm.md "Flags by version" (removed flags, automatic defaults) and vLLM release notes.
"""

from __future__ import annotations

import re

#: what we assume when a profile names no version: the newest release on PyPI when this was written
DEFAULT_VLLM_VERSION = "0.33.0"

#: flag -> first version in which it no longer exists (the server exits with "unrecognized arguments")
REMOVED_FLAGS: dict[str, tuple[int, ...]] = {
    "--disable-log-requests": (0, 17),
    "--swap-space": (0, 18),
}
#: environment variables that vLLM stopped reading
REMOVED_ENV: dict[str, tuple[int, ...]] = {"VLLM_USE_V1": (0, 12)}
#: flag -> version from which it is the default (rendering it is redundant; dropped with a note)
AUTOMATIC_SINCE: dict[str, tuple[int, ...]] = {"--async-scheduling": (0, 14)}
#: flag -> first version that knows it (rendering it for an older version fails)
ADDED_IN: dict[str, tuple[int, ...]] = {
    "--enable-log-requests": (0, 10),
    "--api-server-count": (0, 10),
    "--config": (0, 6),  # vllm-project/vllm#7737: ``vllm serve --config FILE.yaml`` (YAML keys are flag names)
    # vllm-project/vllm#23190 (merged 2025-08-19, after 0.10.1 was tagged) renamed
    # --enable-multimodal-encoder-data-parallel to this
    "--mm-encoder-tp-mode": (0, 10, 2),
}


_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.22.1"`` -> ``(0, 22, 1)``; ``"v0.11.0rc2.dev5+g1a2b"`` -> ``(0, 11, 0)``. ``ValueError`` otherwise."""
    match = _VERSION.match(str(version))
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def removed_since(name: str, version: str) -> str | None:
    """The version that removed flag or variable ``name`` (``--flag=v`` / ``VAR=v`` accepted) if
    ``version`` is that or newer, else ``None``."""
    key = name.split("=", 1)[0]
    since = REMOVED_FLAGS.get(key) or REMOVED_ENV.get(key)
    if since is None or version_tuple(version) < since:
        return None
    return _fmt(since)


def flag_name(arg: str) -> str:
    """``--max-num-seqs=8`` -> ``--max-num-seqs``."""
    return arg.split("=", 1)[0]


def _fmt(v: tuple[int, ...]) -> str:
    """``(0, 17)`` -> ``0.17``; a patch release only where it matters: ``(0, 10, 2)`` -> ``0.10.2``."""
    return ".".join(str(part) for part in (v if len(v) > 2 and any(v[2:]) else v[:2]))


def check_flag(flag: str, version: tuple[int, ...]) -> str | None:
    """Why ``flag`` cannot be passed to vLLM ``version``, or ``None`` when it can."""
    name = flag_name(flag)
    if name in REMOVED_FLAGS and version >= REMOVED_FLAGS[name]:
        return f"{name} was removed in vLLM {_fmt(REMOVED_FLAGS[name])}"
    if name in ADDED_IN and version < ADDED_IN[name]:
        return f"{name} does not exist before vLLM {_fmt(ADDED_IN[name])}"
    return None


def is_automatic(flag: str, version: tuple[int, ...]) -> bool:
    name = flag_name(flag)
    return name in AUTOMATIC_SINCE and version >= AUTOMATIC_SINCE[name]


def api_key_channel(version: str) -> str:
    """How the job hands vLLM its API key: ``"config"`` (a 0600 YAML file passed as ``--config``, vLLM >= 0.6) or
    ``"env"`` (``VLLM_API_KEY``, older vLLM). Not the environment where avoidable: vLLM <= 0.22 hashes every
    ``VLLM_*`` variable into its compile cache's key and writes the values into ``cache_key_factors.json``."""
    return "config" if version_tuple(version) >= ADDED_IN["--config"] else "env"


def check_env(name: str, version: tuple[int, ...]) -> str | None:
    if name in REMOVED_ENV and version >= REMOVED_ENV[name]:
        return f"environment variable {name} is ignored since vLLM {_fmt(REMOVED_ENV[name])}"
    return None
