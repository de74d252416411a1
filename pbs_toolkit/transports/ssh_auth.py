"""How ``SSHDestination`` trusts a login node and proves who the user is: known_hosts and authentication.

Host keys: a known key is checked by paramiko; an unknown one is refused unless the user opted in, and then
appended to known_hosts. Authentication follows OpenSSH's order (agent and key files), then asks the user
for keyboard-interactive or password answers, which is how most sites' MFA arrives. Imported only by
:mod:`pbs_toolkit.transports.ssh`, itself imported lazily, so paramiko stays off ``pbstk --help``.
"""

from __future__ import annotations

import base64
import getpass
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko
from paramiko.auth_strategy import AuthStrategy

from pbs_toolkit.errors import TransportError
from pbs_toolkit.transports.ssh_destination import PasswordPrompt, SSHDestination

_DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")


def terminal_prompt(prompt: str, echo: bool) -> str:
    """Default ``password_prompt``: ask on the terminal (hidden input unless the server says ``echo``)."""
    if echo:
        sys.stderr.write(prompt)
        sys.stderr.flush()
        return sys.stdin.readline().rstrip("\n")
    return getpass.getpass(prompt)


def known_hosts_name(runner: SSHDestination) -> str:
    """The runner's host as known_hosts and ``ssh-keygen -R`` spell it (``[host]:port`` off port 22)."""
    return runner.hostname if runner.port == 22 else f"[{runner.hostname}]:{runner.port}"


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host: refuse, or (opt-in) append its key to known_hosts. Changed keys never get here."""

    def __init__(self, runner: SSHDestination) -> None:
        self.runner = runner

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        path = self.runner.known_hosts_path
        if not self.runner.accept_unknown_host:
            raise TransportError(
                f"host key for {hostname} is not known (not in {path}); connect once with ssh, "
                "or pass --accept-new-host-key"
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line() or ""
        with open(path, "a", encoding="utf-8") as fh:  # append: keep the user's comments and entries
            fh.write(line)


class Authenticator(AuthStrategy):
    """Keys (agent and files, like OpenSSH), then keyboard-interactive/password prompts for MFA."""

    def __init__(self, runner: SSHDestination) -> None:
        super().__init__(ssh_config=runner.ssh_config)
        self.runner = runner
        self.prompt_error: BaseException | None = None

    def get_sources(self) -> Iterator[Any]:  # unused: authenticate() below picks the order itself
        return iter(())

    def _prompt(self) -> PasswordPrompt:
        if self.runner.password_prompt is not None:
            return self.runner.password_prompt
        if not sys.stdin.isatty():
            raise TransportError(
                f"SSH host {self.runner.host} needs interactive authentication (password or MFA) and there "
                "is no terminal to ask on; run it from a terminal, or use a key the host accepts alone"
            )
        return terminal_prompt

    def _keys(self) -> list[tuple[str, paramiko.PKey]]:
        runner = self.runner
        try:
            agent_keys = list(paramiko.Agent().get_keys())
        except paramiko.SSHException:
            agent_keys = []
        files = [os.path.expanduser(p) for p in runner.identity_files]
        if not files:
            files = [os.path.expanduser(f"~/.ssh/{name}") for name in _DEFAULT_KEYS]
        keys: list[tuple[str, paramiko.PKey]] = []
        for path in files:
            blob = _public_blob(path)
            agent_match = [k for k in agent_keys if blob is not None and k.asbytes() == blob]
            if agent_match:
                keys.append((f"{path} (agent)", agent_match[0]))
                continue
            if not os.path.isfile(path):
                continue
            try:
                keys.append((path, paramiko.PKey.from_path(path)))
            except paramiko.PasswordRequiredException:
                try:
                    passphrase = self._prompt()(f"Enter passphrase for key '{path}': ", False)
                    keys.append((path, paramiko.PKey.from_path(path, passphrase)))
                except (TransportError, paramiko.SSHException):
                    continue
            except (paramiko.SSHException, ValueError, OSError):
                continue
        if not runner.identities_only:
            offered = {key.asbytes() for _, key in keys}
            keys.extend(("agent key", k) for k in agent_keys if k.asbytes() not in offered)
        return keys

    def _interactive(self, title: str, instructions: str, prompts: list[tuple[str, bool]]) -> list[str]:
        # called on paramiko's transport thread: keep exceptions to re-raise them on ours
        answers = []
        try:
            ask = self._prompt()
            for index, (prompt, echo) in enumerate(prompts):
                header = "\n".join(x for x in (title, instructions) if x) if index == 0 else ""
                answers.append(ask(f"{header}\n{prompt}" if header else prompt, echo))
        except BaseException as exc:  # noqa: BLE001 - re-raised in authenticate()
            self.prompt_error = exc
            return [""] * len(prompts)
        return answers

    def _try_keys(self, transport: paramiko.Transport, tried: list[str], allowed: list[str]) -> list[str]:
        """Offer each key until one is accepted (``tried`` gets their labels); the methods allowed after that:
        a partial success (a second factor follows) or the server's refusal can change them."""
        for label, key in self._keys():
            tried.append(label)
            try:
                remaining = transport.auth_publickey(self.runner.user, key)
            except paramiko.BadAuthenticationType as exc:
                return list(exc.allowed_types)
            except paramiko.AuthenticationException:
                continue
            if transport.is_authenticated():
                return allowed
            return list(remaining)  # partial success: a second factor follows
        return allowed

    def authenticate(self, transport: paramiko.Transport) -> list[Any]:
        runner = self.runner
        user = runner.user
        try:
            transport.auth_none(user)
            return []
        except paramiko.BadAuthenticationType as exc:
            allowed = list(exc.allowed_types)
        except paramiko.AuthenticationException:
            allowed = ["publickey", "keyboard-interactive", "password"]
        tried: list[str] = []
        if "publickey" in allowed:
            allowed = self._try_keys(transport, tried, allowed)
            if transport.is_authenticated():
                return []
        try:
            if "keyboard-interactive" in allowed:
                transport.auth_interactive(user, self._interactive)
            elif "password" in allowed:
                password = self._prompt()(f"{user}@{runner.hostname}'s password: ", False)
                transport.auth_password(user, password)
        except paramiko.AuthenticationException:
            pass
        if self.prompt_error is not None:
            raise self.prompt_error
        if transport.is_authenticated():
            return []
        keys = ", ".join(tried) if tried else "none found"
        raise paramiko.AuthenticationException(
            f"keys tried: {keys}; the server allows: {', '.join(allowed) or 'nothing'}"
        )


def _public_blob(private_key_path: str) -> bytes | None:
    """The key blob of ``PATH.pub`` (to match agent keys without decrypting the private key)."""
    try:
        fields = Path(private_key_path + ".pub").read_text(encoding="utf-8").split()
        return base64.b64decode(fields[1])
    except (OSError, IndexError, ValueError):
        return None
