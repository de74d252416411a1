"""Our own exceptions. The CLI turns every ``PbstkError`` into one line on stderr and its ``exit_code``.

Exit codes (documented in the README):
  0  success
  1  generic failure (``PbstkError``)
  2  bad input: options, presets, profiles, model names (``UsageError``/``ConfigError``)
  3  the scheduler refused or failed (``SchedulerError``)
  4  transport failure: SSH unreachable, host key unknown, authentication (``TransportError``)
  5  the server failed or the job ended before it was ready (``ServerFailed``)
  6  timed out waiting (``WaitTimeout``)
  7  unknown job (``JobNotFound``)
  8  an endpoint registry could not be read or written (``RegistryError``)
  9  the scheduler did not answer in time (hung, killed, garbled output): try again (``SchedulerUnavailable``)
 10  the local job store is unusable: locked too long, disk full, corrupt (``StoreError``)
 11  the model's weights are not staged, incomplete or corrupt, or cannot be fetched (``WeightsError``)
"""

from __future__ import annotations


class PbstkError(Exception):
    """Base class of every error the toolkit raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: extra lines (log excerpts, stderr) shown after the one-line message
        self.details = details or []

    def __str__(self) -> str:
        return self.message


class UsageError(PbstkError):
    exit_code = 2


class ConfigError(UsageError):
    """A preset, profile or user config that does not load or validate. The message names file and key."""


class SchedulerError(PbstkError):
    exit_code = 3


class SchedulerUnavailable(SchedulerError):
    """A transient failure talking to the scheduler: ``cannot connect to server`` (exit 255), a query that hung
    past its timeout, was killed, or printed output that does not parse. Status degrades to UNKNOWN."""

    exit_code = 9


class TransportError(PbstkError):
    exit_code = 4


class ServerFailed(PbstkError):
    exit_code = 5


class WaitTimeout(PbstkError):
    exit_code = 6


class JobNotFound(PbstkError):
    exit_code = 7


class RegistryError(PbstkError):
    exit_code = 8


class StoreError(PbstkError):
    """The job store cannot be read or written (locked for too long, disk full, corrupt). Names the path."""

    exit_code = 10


class WeightsError(PbstkError):
    """Model weights missing, truncated or corrupt where the job would read them, or not fetchable (gated, no
    token, no such model, Hub unreachable): ``pbstk stage`` and the launch preflight (docs/weights.md)."""

    exit_code = 11
