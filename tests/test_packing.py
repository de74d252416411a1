"""The packing planner (services/models/packing.py, issue 31): pure, so every rule is checked on plain values.

Before: no planner; `pbstk serve` took one model and every model was a job of its own.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pbs_toolkit.errors import UsageError
from pbs_toolkit.services.models.packing import ASLEEP_GB, SHARE_CAP, ModelNeed, PackingPlan, Resources, pack


def need(served: str, params_b: float | None, **kw: object) -> ModelNeed:
    return ModelNeed(served=served, model=f"org/{served}", preset=str(kw.pop("preset", "auto")), params_b=params_b,
                     **kw)  # type: ignore[arg-type]


def where(plan: PackingPlan) -> dict[str, tuple[int, int, tuple[int, ...], float | None, int]]:
    """Each model's job, node, GPUs, what it needs of them (the share it was placed by) and port."""
    return {p.served: (p.job, p.node, p.gpus, p.need, p.port) for p in plan.placements}


def filled(plan: PackingPlan) -> None:
    """Every GPU shared by models that do not swap is given out whole: their shares add up to the cap, each at
    least what it needs (issue 42: a 0.6B and a 1.7B got 0.10 each of an H200)."""
    for gpu, total in shares_per_gpu(plan).items():
        tenants = [p for p in plan.placements if (p.job, p.node) == gpu[:2] and gpu[2] in p.gpus]
        if len(tenants) == 1 and len(tenants[0].gpus) > 1 or any(p.swap for p in tenants):
            continue
        assert round(total, 2) == SHARE_CAP or len(tenants) == 1 and total >= SHARE_CAP, (gpu, tenants)
        assert all((p.share or 0) >= (p.need or 0) for p in tenants), tenants


def shares_per_gpu(plan: PackingPlan) -> dict[tuple[int, int, int], float]:
    total: dict[tuple[int, int, int], float] = {}
    for p in plan.placements:
        for g in p.gpus:
            total[(p.job, p.node, g)] = total.get((p.job, p.node, g), 0.0) + (p.share or 0.0)
    return total


SMALL = [need("q06", 0.6), need("q17", 1.7), need("q4", 4.0)]


def test_small_models_share_one_gpu_with_split_memory_shares() -> None:
    plan = pack(SMALL, Resources(gpus_per_node=1, gpu_memory_gb=80))
    assert plan.jobs == 1
    # 1.2 GB, 3.4 GB and 8 GB of bf16 weights, each at most 70% of its share of 80 GB: 0.10 (the floor), 0.10, 0.15
    assert where(plan) == {"q06": (1, 0, (0,), 0.1, 8000), "q17": (1, 0, (0,), 0.1, 8001),
                           "q4": (1, 0, (0,), 0.15, 8002)}
    assert all(total <= SHARE_CAP < 0.95 for total in shares_per_gpu(plan).values())
    for p in plan.placements:  # each need leaves its KV cache room: weights at most 70% of it
        assert p.weights_gb is not None and p.need is not None and p.weights_gb <= 0.7 * p.need * 80
    filled(plan)
    assert {p.served: p.share for p in plan.placements} == {"q06": 0.26, "q17": 0.26, "q4": 0.38}


def test_models_that_cannot_share_a_gpu_take_a_job_each_on_one_gpu() -> None:
    plan = pack([need("m14", 14.0), need("m24", 24.0)], Resources(gpus_per_node=1, gpu_memory_gb=80))
    assert plan.jobs == 2  # 28 GB -> 0.50 and 48 GB -> 0.90 add up past the cap
    assert where(plan) == {"m24": (1, 0, (0,), 0.9, 8000), "m14": (2, 0, (0,), 0.5, 8000)}
    filled(plan)


def test_two_gpus_a_tensor_parallel_model_and_the_small_ones_in_the_next_job() -> None:
    needs = [need("m8", 8.0), need("m32", 32.0), need("q06", 0.6)]
    plan = pack(needs, Resources(gpus_per_node=2, gpu_memory_gb=80))
    # 64 GB of weights: TP2 (auto's rule: weights <= 70% of 0.95 x 80 GB per GPU); whole GPUs at the default 0.95
    assert where(plan) == {"m32": (1, 0, (0, 1), 0.95, 8000), "m8": (2, 0, (0,), 0.3, 8000),
                           "q06": (2, 0, (0,), 0.1, 8001)}
    filled(plan)  # the small ones' GPU: 0.9 split 0.3 to 0.1


def test_two_nodes_per_job_hold_what_took_two_jobs() -> None:
    needs = [need("m8", 8.0), need("m32", 32.0), need("q06", 0.6)]
    plan = pack(needs, Resources(gpus_per_node=2, gpu_memory_gb=80, nodes_per_job=2))
    assert plan.jobs == 1
    assert where(plan) == {"m32": (1, 0, (0, 1), 0.95, 8000), "m8": (1, 1, (0,), 0.3, 8001),
                           "q06": (1, 1, (0,), 0.1, 8002)}


def test_the_plan_does_not_depend_on_the_order_models_are_given() -> None:
    needs = [need("m8", 8.0), need("m32", 32.0), need("q06", 0.6), need("q17", 1.7), need("named", None, gpus=1,
                                                                                          preset="single")]
    res = Resources(gpus_per_node=2, gpu_memory_gb=80, nodes_per_job=2)
    plans = {pack(list(order), res) for order in itertools.permutations(needs)}
    assert len(plans) == 1


def test_a_model_too_big_for_any_node_is_refused_naming_it_its_need_and_the_largest_gpu_set() -> None:
    with pytest.raises(UsageError) as err:
        pack([need("q06", 0.6), need("huge", 405.0)], Resources(gpus_per_node=2, gpu_memory_gb=80))
    message = str(err.value)
    assert "model huge" in message and "810 GB of weights" in message, message
    assert "one node of 2 GPU(s) x 80 GB" in message and "\n" not in message, message


def test_a_named_preset_wider_than_a_node_and_an_unknown_size_are_refused() -> None:
    with pytest.raises(UsageError, match="model wide: preset tp4 needs 4 GPUs.*one node of 2 GPU"):
        pack([need("wide", None, gpus=4, preset="tp4")], Resources(gpus_per_node=2, gpu_memory_gb=80))
    with pytest.raises(UsageError, match="model blind: size unknown.*:preset="):
        pack([need("blind", None)], Resources(gpus_per_node=2, gpu_memory_gb=80))


def test_the_job_limit_is_kept() -> None:
    with pytest.raises(UsageError, match="model m14: no room left in 1 job"):
        pack([need("m14", 14.0), need("m24", 24.0)], Resources(gpus_per_node=1, gpu_memory_gb=80, max_jobs=1))


def test_unknown_gpu_memory_falls_back_to_whole_gpus_by_parameter_count() -> None:
    plan = pack([need("q06", 0.6), need("m8", 8.0)], Resources(gpus_per_node=4, gpu_memory_gb=0))
    assert where(plan) == {"m8": (1, 0, (0, 1), 0.95, 8000), "q06": (1, 0, (2,), 0.95, 8001)}


def test_a_cpu_profile_runs_every_model_in_one_job() -> None:
    plan = pack(SMALL, Resources(gpus_per_node=0, gpu_memory_gb=0, port=9000))
    assert where(plan) == {"q06": (1, 0, (), None, 9000), "q17": (1, 0, (), None, 9001),
                           "q4": (1, 0, (), None, 9002)}


# --- swapping (serve --max-awake K): models that fit nowhere awake share a GPU set, at most K awake ---

def test_max_awake_puts_models_that_fit_nowhere_awake_on_one_gpu_set_instead_of_new_jobs() -> None:
    models = [need("m14", 14.0), need("m24", 24.0), need("m20", 20.0)]
    assert pack(models, Resources(gpus_per_node=1, gpu_memory_gb=80)).jobs == 3  # without swapping: a job each
    plan = pack(models, Resources(gpus_per_node=1, gpu_memory_gb=80, max_awake=1))
    placed = {p.served: p for p in plan.placements}
    # m24 needs 0.90 (48 GB at most 70% of 0.90 x 80 GB): no room left for a sleeper's 2.5 GB, so it runs alone;
    # m20 (0.75) and m14 (0.50) swap on one GPU of a second job, one awake at a time
    assert plan.jobs == 2
    assert (placed["m24"].job, placed["m24"].swap, placed["m24"].share) == (1, False, 0.9)
    assert {placed["m20"].job, placed["m14"].job} == {2} and placed["m20"].swap and placed["m14"].swap
    slack = SHARE_CAP - 0.75 - ASLEEP_GB / 80  # what the awake one and the sleeper leave, given to each
    assert placed["m20"].share == pytest.approx(0.75 + slack, abs=0.01)
    assert placed["m14"].share == pytest.approx(0.50 + slack, abs=0.01)
    for p in (placed["m20"], placed["m14"]):  # either awake beside the other asleep fits in the cap
        assert p.share is not None and p.share + ASLEEP_GB / 80 <= SHARE_CAP + 1e-9
        assert p.weights_gb is not None and p.weights_gb <= 0.7 * p.share * 80  # its KV cache still has room


def test_max_awake_two_keeps_any_two_awake_within_the_cap() -> None:
    models = [need(f"m{k}", 7.0) for k in range(5)]  # 14 GB each: 0.25 of 80 GB
    plan = pack(models, Resources(gpus_per_node=1, gpu_memory_gb=80, max_awake=2))
    assert plan.jobs == 1
    swapping = [p for p in plan.placements if p.swap]
    assert len(swapping) == 5
    top_two = sorted((p.share or 0.0 for p in swapping), reverse=True)[:2]
    assert sum(top_two) + 3 * ASLEEP_GB / 80 <= SHARE_CAP + 1e-9


def test_max_awake_fills_free_gpus_first_and_swaps_only_where_needed() -> None:
    plan = pack([need("a", 33.0), need("b", 33.0), need("c", 33.0)],  # 66 GB: 0.60 of 160 GB, two do not fit
                Resources(gpus_per_node=2, gpu_memory_gb=160, max_awake=1))
    placed = {p.served: p for p in plan.placements}
    assert plan.jobs == 1
    assert sorted(p.gpus for p in placed.values()) == [(0,), (0,), (1,)]
    alone = [p for p in placed.values() if not p.swap]
    assert len(alone) == 1 and alone[0].need == 0.6  # fits awake on its GPU: no sleep mode for it
    assert alone[0].share == SHARE_CAP  # and, alone there, gets the whole of it


def test_a_model_too_big_to_swap_beside_a_sleeper_gets_a_job_of_its_own() -> None:
    plan = pack([need("big", 24.5), need("other", 24.5)], Resources(gpus_per_node=1, gpu_memory_gb=80, max_awake=1))
    assert plan.jobs == 2 and not any(p.swap for p in plan.placements)  # 0.90 each: no room for a sleeper's 2.5 GB


def test_max_awake_changes_nothing_when_every_model_fits_awake() -> None:
    res = Resources(gpus_per_node=1, gpu_memory_gb=80)
    assert pack(SMALL, replace(res, max_awake=1)).placements == pack(SMALL, res).placements


# --- one full-length request's KV cache (measured on 4x H100, vLLM 0.22.1: a Qwen3-1.7B-shaped model packed at
# 0.10 of 80 GB had 3.98 GiB for its KV cache and needed 4.38 GiB for one 40,960-token request; vLLM refused to
# start, three times; benchmarks/README.md "Many models in one allocation")

#: Qwen3-1.7B: 2 x 28 layers x 8 KV heads x 128 x 2 bytes a token, 40,960 tokens
Q17_KV_GB = 2 * 28 * 8 * 128 * 2 * 40960 / 1e9


def test_a_packed_share_holds_one_full_length_request_beside_the_weights() -> None:
    plan = pack([need("q17", 1.72, kv_gb=Q17_KV_GB)], Resources(gpus_per_node=1, gpu_memory_gb=79))
    (p,) = plan.placements
    assert p.need is not None and p.weights_gb is not None
    # weights 3.4 GB, one request 4.7 GB (x1.1), activations 1.5 GB: 10.1 GB of 79 -> 0.15 (was 0.10, by weights alone)
    assert p.need == 0.15
    assert p.need * 79 - p.weights_gb - 1.5 >= 1.1 * Q17_KV_GB
    assert p.share == SHARE_CAP  # alone on its GPU: all of it


def test_a_shorter_context_needs_less_and_a_model_of_unknown_shape_is_sized_by_its_weights() -> None:
    res = Resources(gpus_per_node=1, gpu_memory_gb=79)
    short = pack([need("q17", 1.72, kv_gb=Q17_KV_GB / 10)], res).placements[0]  # --max-model-len 4096
    unknown = pack([need("q17", 1.72)], res).placements[0]
    assert short.need == unknown.need == 0.1


def test_a_swap_set_counts_each_models_full_length_request() -> None:
    kv = {"q17": Q17_KV_GB, "q4": 6.04, "q8": 6.04}
    needs = [need("q17", 1.72, kv_gb=kv["q17"]), need("q4", 4.02, kv_gb=kv["q4"]), need("q8", 8.19, kv_gb=kv["q8"])]
    plan = pack(needs, Resources(gpus_per_node=1, gpu_memory_gb=36, max_awake=1))
    assert plan.jobs == 1 and all(p.swap for p in plan.placements)
    for p in plan.placements:  # each share, awake alone, has room for its weights and one full-length request
        assert p.share is not None and p.weights_gb is not None
        assert p.share * 36 - p.weights_gb - 1.5 >= 1.1 * kv[p.served]
    # at 32 GB the 8B's need (24.5 GB) and two sleepers no longer fit 0.9: the 1.7B gets a job of its own
    assert pack(needs, Resources(gpus_per_node=1, gpu_memory_gb=32, max_awake=1)).jobs == 2
