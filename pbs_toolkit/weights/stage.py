"""``pbstk stage``: fetch a Hub model into the profile's ``hf_home`` and verify it, where the job will read it.

It runs on the machine pbstk submits through (the login node over the held SSH connection, or here), never on a
compute node, with the Python the job gets (the profile's ``setup`` lines and ``venv``) so the cache is laid out
by the ``huggingface_hub`` that vLLM reads it with. The work is done by ``server/stage_weights.py``, sent over
stdin (nothing is copied there); it answers with one JSON line. The token goes on stdin too, never in argv.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pbs_toolkit.errors import UsageError, WeightsError
from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.weights.manifest import HF_ID, hub_cache

WORKER = Path(__file__).resolve().parent.parent / "server" / "stage_weights.py"
RESULT_PREFIX = "PBSTK-STAGE-RESULT "
#: the environment's setup lines (trusted site configuration, as the start script runs them; stdin kept for the
#: worker, their output kept off stdout), then its venv, then its Python runs the worker that comes on stdin
_RUN_WORKER = r"""
venv=$1 n=$2 boot=$3
shift 3
setup=("${@:1:$n}")
shift "$n"
if [ "$n" -gt 0 ]; then
  eval "$(printf '%s\n' "${setup[@]}")" </dev/null >&2
fi
if [ -n "$venv" ]; then
  # shellcheck disable=SC1090,SC1091
  . "$venv/bin/activate" </dev/null >&2 || { echo "pbstk-stage: cannot activate $venv" >&2; exit 98; }
fi
py=$(command -v python3 || command -v python) \
  || { echo "pbstk-stage: no python3 in the job environment" >&2; exit 127; }
exec "$py" -c "$boot" "$@"
"""
#: reads the inputs line, then runs the rest of stdin (the worker) as ``__main__``
_BOOT = ("import json,sys;PBSTK_INPUT=json.loads(sys.stdin.readline());"
         "exec(compile(sys.stdin.read(),'stage_weights.py','exec'))")
#: variables the login node needs to reach the Hub: taken from the profile's env (a site's proxy)
_NETWORK_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "HF_ENDPOINT")
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@dataclass
class StageReport:
    """What ``pbstk stage`` found: per file ``status`` ok / missing / truncated / size / corrupt / unchecked;
    ``unchecked`` also says what could not be checked at all (the file list, offline with nothing listing it)."""

    model: str
    revision: str
    where: str
    hf_home: str
    verify_only: bool
    ok: bool
    commit: str | None = None
    snapshot: str | None = None
    manifest: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    #: partial downloads (``blobs/*.incomplete`` untouched for an hour) removed after a successful stage
    removed_partials: int = 0
    #: what was not checked: ``["completeness of the file list not checked without the Hub (...)"]`` for a
    #: ``--verify-only`` of a snapshot with no manifest and no cached listing
    unchecked: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts = {"files": len(self.files), "ok": 0, "missing": 0, "truncated": 0, "size": 0, "corrupt": 0,
                  "unchecked": 0}
        for row in self.files:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        return counts

    @property
    def bytes(self) -> int:
        return sum(int(row.get("size") or 0) for row in self.files)

    def failures(self) -> list[str]:
        """One line per bad file, naming it."""
        return [f"{row['file']}: {row['status']}" + (f" ({row['detail']})" if row.get("detail") else "")
                for row in self.files if row["status"] != "ok"]

    def to_dict(self) -> dict[str, Any]:
        from pbs_toolkit.schema import stamp

        return stamp("stage", {"model": self.model, "revision": self.revision, "where": self.where,
                               "hf_home": self.hf_home, "verify_only": self.verify_only, "ok": self.ok,
                               "commit": self.commit, "snapshot": self.snapshot, "manifest": self.manifest,
                               "bytes": self.bytes, "counts": self.counts,
                               "removed_partials": self.removed_partials, "unchecked": self.unchecked,
                               "files": self.files})


def staging_home(runner: Runner, profile: Profile) -> str:
    """The profile's ``hf_home`` as a path on the runner's machine; a profile without one cannot stage."""
    if not profile.hf_home:
        raise UsageError(f"profile {profile.name} has no hf_home: pass --hf-home (the model cache the jobs read)")
    return runner.expanduser(profile.hf_home)


def stage_model(runner: Runner, profile: Profile, model: str, *, revision: str = "main",
                verify_only: bool = False, jobs: int = 4, timeout: float | None = None) -> StageReport:
    """Download what is missing of Hub model ``model`` into the profile's ``hf_home`` (not with ``verify_only``),
    verify every file and write the manifest. Returns the report (``ok`` False when a file failed); raises
    ``WeightsError`` when nothing could be checked (gated, no token, no such model, Hub unreachable)."""
    hf_home = staging_home(runner, profile)
    env = {k: v for k, v in profile.env.items() if k in _NETWORK_ENV}
    if os.environ.get("HF_ENDPOINT"):
        env["HF_ENDPOINT"] = os.environ["HF_ENDPOINT"]
    token = next((os.environ[v] for v in TOKEN_VARS if os.environ.get(v)), None)
    argv = ["bash", "-c", _RUN_WORKER, "pbstk-stage", profile.venv or "", str(len(profile.setup)), _BOOT,
            *profile.setup, "--repo", model, "--revision", revision, "--cache", hub_cache(hf_home),
            "--jobs", str(jobs), *(["--verify-only"] if verify_only else [])]
    stdin = json.dumps({"token": token}) + "\n" + WORKER.read_text(encoding="utf-8")
    result = runner.run(argv, env=env, stdin=stdin, timeout=timeout)
    where = "this machine" if runner.name == "local" else runner.name.split(":", 1)[-1]
    doc = _result_line(result.stdout)
    if doc is None:
        tail = (result.stderr.strip().splitlines() or [f"exit code {result.rc}"])[-1]
        raise WeightsError(f"staging {model} on {where} failed: {tail}",
                           details=result.stderr.strip().splitlines()[-5:])
    error = doc.get("error")
    if isinstance(error, dict):
        raise WeightsError(f"{model} on {where}: {error.get('message')}"
                           + (_fix_hint(model, profile) if error.get("kind") == "not_staged" else ""))
    return StageReport(model=model, revision=revision, where=where, hf_home=hf_home, verify_only=verify_only,
                       ok=bool(doc.get("ok")), commit=doc.get("commit"), snapshot=doc.get("snapshot"),
                       manifest=doc.get("manifest") if doc.get("ok") else None, files=list(doc.get("files") or []),
                       removed_partials=int(doc.get("removed_partials") or 0),
                       unchecked=[str(u) for u in doc.get("unchecked") or []])


def _fix_hint(model: str, profile: Profile) -> str:
    return f": run `pbstk stage {model} --profile {profile.name}`"


def _result_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                doc = json.loads(line[len(RESULT_PREFIX):])
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


def require_ok(report: StageReport) -> StageReport:
    """``report``, or ``WeightsError`` naming each bad file (one detail line per file)."""
    if report.ok:
        return report
    bad = report.failures()
    raise WeightsError(f"{report.model}: {len(bad)} of {len(report.files)} files failed verification on "
                       f"{report.where} (nothing was marked staged)", details=bad)


def stage_request(req: Any, runner_for: Any, *, revision: str = "main", verify_only: bool = False) -> StageReport:
    """``pbstk stage``: the profile ``req`` resolves to (flags, config, profile), its runner (``runner_for(ssh
    host)``; "" is this machine), then :func:`stage_model`. ``req`` is a ``RenderRequest``."""
    from pbs_toolkit.settings.launch_settings import resolve_launch_settings

    if req.model.startswith(("/", "./", "../", "~")) or not HF_ID.match(req.model) or "/" not in req.model:
        raise UsageError(f"{req.model!r} is not a Hub model id (org/name): only Hub models are staged; a model "
                         f"directory is checked at launch")
    if not revision or "\n" in revision or revision.startswith("-") or ".." in revision:
        raise UsageError(f"--revision {revision!r} is not a branch, tag or commit")
    profile = resolve_launch_settings(req).launchable()
    return stage_model(runner_for(profile.ssh_host or ""), profile, req.model, revision=revision,
                       verify_only=verify_only)
