"""The last mile: register a ready server where evaluation tools look, and print shell exports for it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from pbs_toolkit.endpoints.no_proxy import no_proxy_value
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.status import JobStatus
from pbs_toolkit.jobs.store import JobRecord
from pbs_toolkit.schema import stamp


@dataclass
class EndpointUpdate:
    registry: str
    format: str
    alias: str
    model: str
    url: str
    key_env: str | None

    def to_dict(self) -> dict[str, Any]:
        """The ``registry_entry`` object of ``update-endpoint --json`` (docs/json.md)."""
        return stamp("registry_entry", self.__dict__)


def default_alias(record: JobRecord) -> str:
    """The job's ``--name`` (which defaults to a slug of the model)."""
    return record.name


#: what registries name when the server has no key (clients still want *some* value in the variable)
NO_KEY_ENV = "PBSTK_NO_KEY"
_WILDCARD_ADDRESSES = ("0.0.0.0", "::", "[::]")


def endpoint_url(st: JobStatus, local_url: str | None = None) -> str:
    """``http://host:port/v1`` that clients use: a tunnel's local URL (with or without its ``/v1``), else the
    node's address.

    Never a wildcard bind address (``0.0.0.0`` is where a server listens, not where clients connect).
    """
    if local_url:
        base = local_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"  # `--local-url http://localhost:9999/v1` too
    if not st.address or not st.port:
        raise UsageError(f"job {st.record.job_id} has no address yet (state {st.state.value})")
    if st.address in _WILDCARD_ADDRESSES:
        if not st.node:
            raise UsageError(f"job {st.record.job_id} reports the wildcard address {st.address}; "
                             "set `address:` in the site profile")
        return f"http://{st.node}:{st.port}/v1"
    return f"http://{st.address}:{st.port}/v1"


def check_registry(
    record: JobRecord,
    registry: str | None,
    fmt: str = "auto",
    alias: str | None = None,
    *,
    follow_symlink: bool = False,
    force_format: bool = False,
) -> str:
    """Refuse, before waiting for the server, a registry that the write would refuse later.

    Checks the format (and that it agrees with the suffix), that the directory exists, that the path is a
    regular file or none yet (no device, FIFO, socket, pseudo-file, or symlink leaving its directory), that the
    file and its directory are writable, that an existing file parses, and that the alias fits the format.
    Returns the format. The write itself checks all of this again under the lock.
    """
    return check_registry_for(registry, fmt, alias or default_alias(record), model=record.served_model_name,
                              key_env=record.api_key_env or NO_KEY_ENV, follow_symlink=follow_symlink,
                              force_format=force_format)


def check_registry_for(
    registry: str | None,
    fmt: str = "auto",
    alias: str | None = None,
    *,
    model: str = "model",
    key_env: str = NO_KEY_ENV,
    follow_symlink: bool = False,
    force_format: bool = False,
) -> str:
    """:func:`check_registry` before there is a job (``pbstk run`` checks before it launches one): the file, the
    format and ``alias`` (``None``: only the file and format, the job's name being pbstk's own). The format."""
    from pbs_toolkit.endpoints.entry import validate_entry
    from pbs_toolkit.endpoints.registry import EndpointEntry, check_target

    path, kind = check_target(registry, fmt, follow_symlink=follow_symlink, force_format=force_format)
    if alias is not None:
        validate_entry(EndpointEntry(alias=alias, model=model, url="http://node:1/v1", key_env=key_env), kind, path)
    return kind


def update_endpoint(
    st: JobStatus,
    *,
    registry: str | None = None,
    fmt: str = "auto",
    alias: str | None = None,
    local_url: str | None = None,
    follow_symlink: bool = False,
    force_format: bool = False,
) -> EndpointUpdate:
    """Write ``{alias: model, url, key}`` for a READY job into the registry (atomic, locked)."""
    from pbs_toolkit.endpoints.registry import EndpointEntry, default_registry_path, detect_format, write_endpoint

    record = st.record
    alias = alias or default_alias(record)
    url = endpoint_url(st, local_url)
    key_env = record.api_key_env or NO_KEY_ENV
    path = registry or str(default_registry_path())
    kind = detect_format(path, fmt, force=force_format)
    entry = EndpointEntry(alias=alias, model=record.served_model_name, url=url, key_env=key_env)
    written = write_endpoint(registry, entry, fmt=kind, follow_symlink=follow_symlink, force_format=force_format)
    return EndpointUpdate(str(written), kind, alias, record.served_model_name, url, record.api_key_env)


def env_values(st: JobStatus, local_url: str | None = None) -> dict[str, str]:
    """The variables for shells and clients (OpenAI SDK, verifiers 0.4, lm-eval, vllm bench), in order."""
    record = st.record
    base = endpoint_url(st, local_url)
    values = {
        "OPENAI_BASE_URL": base, "OPENAI_API_BASE": base, "PBSTK_BASE_URL": base,
        "PBSTK_COMPLETIONS_URL": base + "/completions", "PBSTK_SERVER_ROOT": base[: -len("/v1")],
        "PBSTK_MODEL": record.served_model_name,
    }
    if record.api_key:
        values["OPENAI_API_KEY"] = record.api_key
        if record.api_key_env:
            values[record.api_key_env] = record.api_key
    else:  # registries name NO_KEY_ENV for such servers; vLLM accepts any key when it has none
        values["OPENAI_API_KEY"] = "EMPTY"
        values[NO_KEY_ENV] = "EMPTY"

    values["NO_PROXY"] = values["no_proxy"] = no_proxy_value(base)  # a site's http_proxy cannot reach the node
    return values


def env_exports(st: JobStatus, local_url: str | None = None) -> list[str]:
    """``export`` lines of :func:`env_values`, each value quoted for the shell."""
    return [f"export {name}={shlex.quote(value)}" for name, value in env_values(st, local_url).items()]
