"""Where an SSH runner goes, resolved from ``~/.ssh/config`` like OpenSSH does: host name, port, user, keys,
proxies, timeouts, known_hosts. ``SSHRunner`` is one; ssh_auth.py and ssh_mux.py read only these fields, so
they take an ``SSHDestination`` and never import the runner (ssh.py imports them)."""

from __future__ import annotations

import getpass
import os
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import paramiko

from pbs_toolkit.errors import ConfigError, TransportError

#: ``password_prompt(prompt, echo) -> answer``: asks the user one keyboard-interactive question
PasswordPrompt = Callable[[str, bool], str]

CONNECT_TIMEOUT_S = 10.0
#: keyboard-interactive waits for a person (MFA codes, push approvals): give them time
AUTH_TIMEOUT_S = 180.0
KEEPALIVE_S = 30
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class SSHDestination:
    """``host`` (config alias, or ``user@host:port``) resolved through the SSH config."""

    def __init__(self, host: str, *, accept_unknown_host: bool = False,
                 config_path: str | os.PathLike[str] | None = None,
                 known_hosts_path: str | os.PathLike[str] | None = None,
                 password_prompt: PasswordPrompt | None = None) -> None:
        self.host = host
        self.accept_unknown_host = accept_unknown_host
        self.password_prompt = password_prompt
        config_file = Path(config_path or os.environ.get("PBSTK_SSH_CONFIG") or "~/.ssh/config").expanduser()
        self.config_path = config_file
        try:
            self.ssh_config = (
                paramiko.SSHConfig.from_path(str(config_file))
                if config_file.exists()
                else paramiko.SSHConfig()
            )
        except (OSError, paramiko.ssh_exception.ConfigParseError) as exc:
            raise TransportError(f"cannot read SSH config {config_file}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"cannot read SSH config {config_file}: not UTF-8 text (byte {exc.start})") from None
        except ValueError as exc:  # shlex inside paramiko: ``Match exec "false`` (no closing quotation)
            raise ConfigError(f"cannot read SSH config {config_file}: {exc}") from None
        user, alias, port = split_destination(host)
        cfg = self.ssh_config.lookup(alias)
        self.hostname: str = cfg.get("hostname", alias)
        self.port: int = port or config_number(cfg, "port", 22, config_file, alias, integer=True)
        self.user: str = user or cfg.get("user") or getpass.getuser()
        self.identity_files: list[str] = list(cfg.get("identityfile", []))
        self.identities_only = cfg.get("identitiesonly", "no").lower() == "yes"
        self.proxy_command: str | None = (
            cfg.get("proxycommand") if cfg.get("proxycommand", "none") != "none" else None
        )
        if self.proxy_command is not None:
            try:  # paramiko splits it only when connecting: a bad one is a config error, found now
                shlex.split(self.proxy_command)
            except ValueError as exc:
                raise ConfigError(f"{config_file}: host {alias}: bad proxycommand: {exc}") from None
        self.proxy_jump: str | None = cfg.get("proxyjump") if cfg.get("proxyjump", "none") != "none" else None
        self.connect_timeout = config_number(cfg, "connecttimeout", CONNECT_TIMEOUT_S, config_file, alias)
        user_known = cfg.get("userknownhostsfile", "").split()
        self.known_hosts_path = Path(
            known_hosts_path
            or os.environ.get("PBSTK_KNOWN_HOSTS")
            or (user_known[0] if user_known else "")
            or "~/.ssh/known_hosts"
        ).expanduser()


def config_number(cfg: Mapping[str, Any], key: str, default: float, config_file: Path, alias: str,
                  *, integer: bool = False) -> Any:
    """A numeric ``~/.ssh/config`` value (``Port``, ``ConnectTimeout``) checked like ssh(1) does, so
    ``Port notaport`` is one clear line naming the file and the key instead of a traceback."""
    raw = cfg.get(key)
    if raw is None:
        return int(default) if integer else default
    try:
        value = int(raw) if integer else float(raw)
    except (TypeError, ValueError):
        value = None
    low, high = (1, 65535) if integer else (0.001, 86400.0)
    if value is None or not low <= value <= high:  # NaN fails the comparison too
        raise ConfigError(f"{config_file}: host {alias}: bad {key} {raw!r} (expected a number "
                          f"from {low:g} to {high:g})")
    return value


def split_destination(destination: str) -> tuple[str | None, str, int | None]:
    """``user@host:port`` -> (user, host, port); host may be an ``~/.ssh/config`` alias or ``[v6]:port``."""
    user = None
    if "@" in destination:
        user, destination = destination.rsplit("@", 1)
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", destination) or re.fullmatch(
        r"([^:]+):(\d+)", destination
    )
    if match:
        return user or None, match.group(1), int(match.group(2)) if match.group(2) else None
    return user or None, destination, None
