"""``pbstk serve M1 M2 ... --dry-run``: the plan of a multi-model service as a table or ``--json`` (issue 31,
docs/multi-model.md), and the plan that ``serve`` runs for several models."""

from __future__ import annotations

from typing import Any

import click

from pbs_toolkit.cli.options import build_request, echo_json, scale_spec, table
from pbs_toolkit.durations import parse
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.plan import slug
from pbs_toolkit.services.models.multi import plan_rows
from pbs_toolkit.services.models.plan import plan_service
from pbs_toolkit.services.models.spec import parse_models, split_options


def single_or_plan(models: tuple[str, ...], models_file: str | None, dry_run: bool, as_json: bool,
                   kw: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``serve``'s models: ``(MODEL, kw)`` for one model served as before (its ``:preset=``/``:name=`` applied to
    ``kw``), for several the first one and ``kw["models"]``, the plan's rows; ``None`` once the plan is printed
    (``--dry-run``)."""
    specs = parse_models(models, models_file)
    several = len(specs) > 1 or models_file is not None
    swapping = swap_options(kw.pop("max_awake", None), kw.pop("sleep_after", None), several)
    if several:
        for flag, key in (("--served-model-name", "served_model_name"), ("--replicas", "replicas"),
                          ("--min-replicas", "min_replicas"), ("--max-replicas", "max_replicas")):
            if kw.get(key) is not None:
                raise UsageError(f"{flag} is for one model; several models take :name=... each and run one "
                                 "copy each")
    if dry_run:  # what a real serve refuses, a dry run refuses too (docs/settings.md "Durations")
        scale_spec(kw.get("replicas"), kw.get("min_replicas"), kw.get("max_replicas"), kw.get("scale_up_waiting"),
                   kw.get("scale_down_idle"))
    if dry_run or several:
        name = kw.get("name") or (None if several else slug(specs[0].model))
        if name is None:
            raise UsageError("several models need --name NAME, the service's name")
        render = {k: v for k, v in kw.items() if k not in ("replicas", "min_replicas", "max_replicas",
                                                          "scale_up_waiting", "scale_down_idle")}
        plan = plan_service(specs, build_request(specs[0].model, **render), name, swapping.get("max_awake", 0),
                            kw.get("replicas") or kw.get("min_replicas") or 1)
        if not dry_run:  # served: the plan's rows, the first job's first model as the service's model
            rows = [{**row, **swapping} if row["swap"] else row for row in plan_rows(plan.to_dict())]
            return rows[0]["model"], {**kw, "models": rows, "served_model_name": rows[0]["served_model_name"]}
        if as_json:
            echo_json(plan.to_dict())
        else:
            click.echo(f"service {plan.name}: {len(specs)} model(s) in {plan.packing.jobs} job(s) of profile "
                       f"{plan.profile} (dry run: nothing written or queued)")
            click.echo(table(plan.rows(), plan.headers()))
        return None
    model, options = split_options(models[0], "MODEL argument 1")  # one model: as ever
    if "preset" in options:
        kw["preset"] = options["preset"]
    if "name" in options:
        kw["served_model_name"] = options["name"]
    return model, kw


def swap_options(max_awake: int | None, sleep_after: str | None, several: bool) -> dict[str, Any]:
    """``--max-awake K`` and ``--sleep-after D`` as the plan's swapping rows carry them (``max_awake``,
    ``sleep_after_s``); refused in one line for one model, and ``--sleep-after`` without ``--max-awake``."""
    if sleep_after is not None and max_awake is None:
        raise UsageError("--sleep-after is for models that swap: give --max-awake K too")
    if max_awake is None:
        return {}
    if not several:
        raise UsageError("--max-awake is for several models sharing GPUs; one model has nothing to swap with")
    return {"max_awake": max_awake, "sleep_after_s": parse(sleep_after, "--sleep-after") if sleep_after else 0.0}
