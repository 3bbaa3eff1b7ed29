"""``rollout.vllm.tensor_parallel_size``: how many devices a rollout rank owns, what the plan gives the rollout,
and the placements the config refuses before anything starts (naming the keys)."""

from __future__ import annotations

import pytest

from relayrl.config.plan import rollout_pool, step_plan
from relayrl.config.schema import Config
from relayrl.engines.generation.config import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="rollout.engine=vllm is validated against an install")


def tp(n: int, **over) -> dict:
    """A config on CPU cores with a vLLM rollout of ``n`` devices per rank (cores may be fewer: oversubscribed)."""
    data = {"model": {"device": "cpu"}, "cluster": {"oversubscribe": True, **over.pop("cluster", {})},
            "rollout": {"engine": "vllm", "vllm": {"tensor_parallel_size": n}}}
    return {**data, **over}


def refused(data: dict, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        Config.model_validate(data)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_a_rollout_rank_owns_tensor_parallel_size_devices():
    cfg = Config.model_validate(tp(2, cluster={"devices": 4, "oversubscribe": True}))
    assert cfg.rollout.devices_per_rank == 2
    native = Config.model_validate({"model": {"device": "cpu"}})
    assert native.rollout.devices_per_rank == 1


def test_an_off_policy_rollout_gets_a_pool_of_one_rank():
    """The pool an off-policy run adds for its rollout holds one rollout rank: N devices with TP=N."""
    cfg = Config.model_validate(tp(2, trainer={"off_policy_steps": 1}))
    assert rollout_pool(cfg) == ("rollout", {"rollout": 2})
    assert step_plan(cfg).pools["rollout"] == "rollout"
    one = Config.model_validate({"model": {"device": "cpu"}, "trainer": {"off_policy_steps": 1}})
    assert rollout_pool(one) == ("rollout", {"rollout": 1})


def test_split_and_colocated_placements_that_divide_are_accepted():
    Config.model_validate(tp(2, cluster={"devices": 2, "oversubscribe": True}))  # colocated: the trainer's devices
    Config.model_validate(tp(2, placement={"pools": {"gen": 4}, "rollout": "gen"}))  # 2 rollout ranks of 2
    Config.model_validate(tp(2, workflow="sft", cluster={"devices": 2, "oversubscribe": True}))  # its evaluations
    # the Ray backend: ranks of two devices per node, on one node or two (cluster.devices is per node)
    Config.model_validate(tp(2, cluster={"devices": 2, "backend": "ray"}))
    Config.model_validate(tp(2, cluster={"devices": 2, "nodes": 2, "backend": "ray"}))
    Config.model_validate(tp(2, cluster={"backend": "ray"}, placement={"pools": {"gen": 2}, "rollout": "gen"}))


def test_the_rollouts_pool_is_packed_in_runs_of_its_ranks_devices():
    """``pool_pack``: the pool the rollout runs on is made with ``pack`` = its ranks' devices (the Ray backend
    keeps each run on one node); every other pool, and every pool of a run without tensor parallelism, has 1."""
    from relayrl.config.rollout_devices import pool_pack

    colocated = Config.model_validate(tp(2, cluster={"devices": 2, "backend": "ray"}))
    assert pool_pack(colocated, "main") == 2
    split = Config.model_validate(tp(2, cluster={"backend": "ray"}, algorithm={"kl_coef": 0.1},  # (a reference)
                                     placement={"pools": {"gen": 4, "ref": 1}, "rollout": "gen", "reference": "ref"}))
    assert [pool_pack(split, p) for p in ("main", "gen", "ref")] == [1, 2, 1]
    ahead = Config.model_validate(tp(2, trainer={"off_policy_steps": 1}))
    assert pool_pack(ahead, "rollout") == 2 and pool_pack(ahead, "main") == 1
    assert pool_pack(Config.model_validate({"model": {"device": "cpu"}}), "main") == 1


@pytest.mark.parametrize("data,words", [
    (tp(2), ["rollout.vllm.tensor_parallel_size=2", "more than the rollout's pool has (cluster.devices=1)",
             "set cluster.devices >= 2"]),
    (tp(2, cluster={"devices": 3, "oversubscribe": True}),
     ["cannot be cut into ranks of 2", "set cluster.devices to a multiple of 2", "rollout ranks = cluster.devices / 2"]),
    (tp(2, placement={"pools": {"gen": 3}, "rollout": "gen"}),
     ["rollout's pool (placement.pools.gen=3)", "set placement.pools.gen to a multiple of 2"]),
    (tp(4, placement={"pools": {"gen": 2}, "rollout": "gen"}), ["more than the rollout's pool has (placement.pools.gen=2)"]),
    (tp(2, workflow="dpo"), ["(cluster.devices=1)"]),
    (tp(2, cluster={"devices": 3, "nodes": 2, "backend": "ray"}), ["set cluster.devices to a multiple of 2"]),
])
def test_a_rollout_that_cannot_be_cut_into_ranks_of_n_devices_is_refused(data, words):
    refused(data, *words)


def test_the_key_needs_the_vllm_engine():
    refused({"model": {"device": "cpu"}, "rollout": {"vllm": {"tensor_parallel_size": 2}}},
            "rollout.vllm is read by rollout.engine=vllm only")


def test_the_count_must_be_positive():
    refused(tp(0), "tensor_parallel_size", "greater than or equal to 1")


def test_vllm_refuses_temperatures_above_two_before_it_starts():
    """vLLM samples at temperatures up to 2 and refuses more with a traceback from its engine; the config says so
    first, naming the key (the native engine samples at any temperature)."""
    refused({"model": {"device": "cpu"}, "rollout": {"engine": "vllm", "temperature": 3.0}},
            "rollout.temperature=3", "set rollout.temperature <= 2, or rollout.engine=native")
    Config.model_validate({"model": {"device": "cpu"}, "rollout": {"engine": "vllm", "temperature": 2.0}})
    Config.model_validate({"model": {"device": "cpu"}, "rollout": {"temperature": 3.0}})


def test_vllm_refuses_an_eval_temperature_above_two():
    """eval.k answers are sampled on the rollout's engine: with vLLM, eval.temperature stops at 2 as well."""
    base = {"model": {"device": "cpu"}, "rollout": {"engine": "vllm"}}
    refused({**base, "eval": {"k": 4, "temperature": 2.5}}, "eval.temperature=2.5", "set eval.temperature <= 2")
    Config.model_validate({**base, "eval": {"k": 4, "temperature": 2.0}})
    Config.model_validate({"model": {"device": "cpu"}, "eval": {"k": 4, "temperature": 2.5}})  # (the native engine)
