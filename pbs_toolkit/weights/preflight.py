"""The launch-time check that a job will find its weights: before anything is queued, never on a compute node.

A profile whose compute nodes are offline (``hf_hub_offline: true``) and that names the cache they read
(``hf_home``) needs a Hub model fully staged there: a manifest from ``pbstk stage`` for the revision's commit,
and every file it lists present with its size. Sizes only, by design: hashing hundreds of GB would cost every
launch minutes; ``pbstk stage --verify-only`` is the full check (docs/weights.md). A model directory is checked
for ``config.json`` and its weight files (the shards its index names, else at least one weight file).

:func:`preflight_weights` is the one entry point (``launch``, ``serve`` and ``run`` call it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from pbs_toolkit.errors import PbstkError, WeightsError
from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.transports.base import Runner
from pbs_toolkit.weights.manifest import HF_ID, commit_of, file_sizes, load_manifest

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: config.json, the weight files and the index files of a model directory, in one command
_LIST_DIR = ('cd -- "$1" 2>/dev/null || { echo nodir; exit 0; }; [ -f config.json ] && echo config; '
             'for f in *; do [ -f "$f" ] && printf "file %s\\n" "$f"; done; exit 0')


def is_hub_model(model: str, runner: Runner) -> bool:
    """Whether ``model`` names a Hub repository rather than a directory (as ``render`` decides it)."""
    if model.startswith(("/", "./", "../", "~")) or not HF_ID.match(model):
        return False
    return runner.name != "local" or not os.path.isdir(os.path.expanduser(model))


def revision_of(vllm_args: Sequence[str]) -> str:
    """The ``--revision`` a launch passes to vLLM (``main`` when none)."""
    for k, arg in enumerate(vllm_args):
        if arg.startswith("--revision="):
            return arg.split("=", 1)[1] or "main"
        if arg == "--revision" and k + 1 < len(vllm_args):
            return vllm_args[k + 1]
    return "main"


def staged_problem(runner: Runner, profile: Profile, model: str, revision: str = "main") -> str | None:
    """Why Hub model ``model`` is not fully staged in the profile's ``hf_home`` (``None``: it is)."""
    if not profile.hf_home:
        return "the profile has no hf_home: pbstk cannot tell which cache the nodes read"
    hf_home = runner.expanduser(profile.hf_home)
    commit = commit_of(runner, hf_home, model, revision)
    if commit is None:
        return f"it is not in {hf_home} (no revision {revision})"
    manifest = load_manifest(runner, hf_home, model, commit)
    if manifest is None:
        return f"{hf_home} has commit {commit[:12]} but no verified manifest of it"
    sizes = file_sizes(runner, [f"{manifest.snapshot}/{f.file}" for f in manifest.files])
    for entry, size in zip(manifest.files, sizes):
        if size != entry.size:
            return f"{entry.file} is {'missing' if size is None else f'{size} bytes, not {entry.size}'}"
    return None


def model_dir_problem(runner: Runner, path: str) -> str | None:
    """Why model directory ``path`` cannot be served (``None``: config.json and its weight files are there)."""
    try:
        out = runner.run(["bash", "-c", _LIST_DIR, "pbstk-model-dir", path], timeout=60.0).stdout.splitlines()
    except PbstkError:
        return None  # the runner's own failure is reported by the launch that follows
    if "nodir" in out:
        return "it is not a directory"
    if "config" not in out:
        return "it has no config.json"
    names = [line[5:] for line in out if line.startswith("file ")]
    indexes = [n for n in names if n.endswith(".index.json")]
    shards: set[str] = set()
    for index in indexes:
        try:
            weight_map = json.loads(runner.read_bytes(f"{path}/{index}")).get("weight_map")
        except (OSError, ValueError, AttributeError, PbstkError):
            return f"its {index} is not readable JSON"
        if isinstance(weight_map, dict):
            shards.update(str(v) for v in weight_map.values())
    missing = sorted(shards - set(names))
    if missing:
        return f"{missing[0]} (named by its index) is missing" + (f", and {len(missing) - 1} more"
                                                                 if len(missing) > 1 else "")
    if not shards and not any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
        return "it has no weight files (*.safetensors, *.bin, *.pt, *.gguf)"
    return None


def preflight_weights(runner: Runner, model: str, profile: Profile, *, stage: bool = False,
                      vllm_args: Sequence[str] = (), note: Callable[[str], object] | None = None) -> None:
    """Refuse (``WeightsError``, exit 11) a launch whose compute nodes would not find the weights, before
    anything is queued. Only for profiles with ``hf_hub_offline: true``: their nodes cannot fetch. ``stage``:
    stage (download and verify) a Hub model that is not fully staged, then go on. ``runner``: where the files
    are (the login node); ``note`` hears a line before staging starts."""
    if not profile.hf_hub_offline:
        return
    if not is_hub_model(model, runner):
        path = runner.expanduser(model) if runner.name != "local" else os.path.abspath(os.path.expanduser(model))
        problem = model_dir_problem(runner, path)
        if problem:
            raise WeightsError(f"model directory {model}: {problem}; the compute nodes of profile {profile.name} "
                               f"cannot fetch anything (hf_hub_offline)")
        return
    if not profile.hf_home:  # the nodes read the user's default cache, which pbstk neither stages nor checks
        return
    revision = revision_of(vllm_args)
    problem = staged_problem(runner, profile, model, revision)
    if problem is None:
        return
    if not stage:
        rev = "" if revision == "main" else f" --revision {revision}"
        raise WeightsError(f"{model} is not staged for profile {profile.name} ({problem}); its compute nodes are "
                           f"offline: run `pbstk stage {model} --profile {profile.name}{rev}` first, or pass --stage")
    from pbs_toolkit.weights.stage import require_ok, stage_model

    if note is not None:
        note(f"staging {model} into {profile.hf_home} ({problem})")
    require_ok(stage_model(runner, profile, model, revision=revision))
