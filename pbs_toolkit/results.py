"""What the Python API hands back about jobs: ``Job`` (a launched job), ``Endpoint`` (what an OpenAI client
needs, its key hidden from ``repr``) and ``Cancellation`` (what ``cancel`` did). ``pbs_toolkit.client``
re-exports them; the performance results (``Metrics``, ``Diagnosis``, ``BenchResult``) live in perf/observe.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pbs_toolkit.jobs.store import JobRecord


@dataclass(frozen=True)
class Job:
    """A launched job, as the job store knows it (no secret in it: ``Client.endpoint`` gives the key)."""

    job_id: str
    name: str
    model: str
    served_model_name: str
    run_dir: str
    preset: str
    profile: str
    scheduler: str
    #: "" for this machine, else the SSH host it was submitted through
    transport: str = ""
    notes: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, record: JobRecord, notes: Sequence[str] = ()) -> Job:
        return cls(job_id=record.job_id, name=record.name, model=record.model,
                   served_model_name=record.served_model_name, run_dir=record.run_dir, preset=record.preset,
                   profile=record.profile, scheduler=record.scheduler, transport=record.transport,
                   notes=tuple(notes))

    def to_dict(self) -> dict[str, Any]:
        """A ``job`` object (docs/json.md): the record fields ``jobs --json`` prints, same names, plus ``notes``."""
        from dataclasses import asdict

        from pbs_toolkit.schema import stamp

        data = asdict(self)
        data["transport"] = self.transport or "local"
        data["notes"] = list(self.notes)
        return stamp("job", data)


@dataclass(frozen=True)
class Endpoint:
    """What an OpenAI-compatible client needs. ``repr`` hides the key so a notebook cell never prints it."""

    base_url: str
    api_key: str | None = field(repr=False)
    model: str
    job_id: str = ""
    #: the variables ``pbstk env`` exports (the key among them), by name
    env: dict[str, str] = field(default_factory=dict, repr=False)

    def to_dict(self, secrets: bool = False) -> dict[str, Any]:
        """An ``endpoint`` object (docs/json.md). The key and ``env`` only with ``secrets`` (``pbstk env --json``,
        whose whole point is to hand them out); otherwise ``has_api_key`` says whether there is one."""
        from pbs_toolkit.schema import stamp

        data: dict[str, Any] = {"job_id": self.job_id, "base_url": self.base_url, "model": self.model,
                                "has_api_key": self.api_key is not None}
        if secrets:
            data.update(api_key=self.api_key, env=dict(self.env))
        return stamp("endpoint", data)

    def exports(self) -> list[str]:
        """``env`` as shell ``export`` lines, each value quoted (``pbstk env``)."""
        import shlex

        return [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]


@dataclass(frozen=True)
class Cancellation:
    """What ``cancel`` did to one job: stopped now (``cancelled``), or it had already ended."""

    job_id: str
    name: str
    cancelled: bool

    @property
    def outcome(self) -> str:
        return "cancelled" if self.cancelled else "already ended"

    def to_dict(self) -> dict[str, Any]:
        """A ``cancellation`` object (``cancel --json`` prints a list of them)."""
        from pbs_toolkit.schema import stamp

        return stamp("cancellation", {"job_id": self.job_id, "name": self.name, "cancelled": self.cancelled,
                                      "outcome": self.outcome})
