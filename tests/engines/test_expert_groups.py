"""Expert parallelism in groups smaller than the trainer (engine.expert_parallel=2 on 4 gloo ranks): two expert
groups of two ranks, each holding every expert, each expert shard replicated over the groups. The update, the
clip across the experts' mesh and FSDP2's, the replicas' gradient sum, checkpoints and relayed weights are one
rank's; a checkpoint saved in groups of 2 loads in one group of 4 and without expert parallelism."""

import copy

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.cluster.config import ClusterConfig
from relayrl.config.schema import Config
from relayrl.engines.training.base import OptimConfig
from relayrl.engines.training.expert_parallel import ExpertParallelError, shard_experts
from relayrl.engines.training.torch_engine import TrainEngineConfig
from tests.engines.moe_workers import ExpertsWorker, moe_dir
from tests.engines.test_lora_fsdp import LOSS, _batch
from tests.models.architectures import build

MAX_NORM = 0.05  # (below every update's gradient norm here: the clip scales, so its norm must be the global one)
ENGINE = TrainEngineConfig(token_budget=48, optim=OptimConfig(lr=1e-2, max_grad_norm=MAX_NORM))


def _group(kw: dict, name: str, expert_parallel: bool | int) -> WorkerGroup:
    """Four ranks with ``engine.expert_parallel``; a collective that waits a minute fails (a skipped exchange
    would hang the test otherwise)."""
    ep = {**kw, "engine": kw["engine"].model_copy(update={"expert_parallel": expert_parallel})}
    return WorkerGroup(ExpertsWorker, ResourcePool(name, devices=4), "actor", init_kwargs=ep,
                       backend=ClusterConfig(backend="local", collective_timeout_s=60, oversubscribe=True))


def _close(got: dict, want: dict, atol: float = 2e-4) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, atol=atol, rtol=1e-3, msg=n)


def _kw(tiny_tokenizer, tmp_path) -> dict:
    return dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), engine=ENGINE, total_steps=4, threads=1,
                seed=0)


@pytest.mark.multiproc
def test_two_groups_of_two_ranks_train_as_one_rank(tiny_tokenizer, tmp_path):
    """Each rank holds 2 of the 4 experts of every layer, ranks 0 and 2 the same ones (as 1 and 3); tokens only
    travel inside a group. A one-rank checkpoint loads onto the replicated shards, and two updates' metrics
    (loss, the clipped grad norm: the experts' mesh and FSDP2's summed once), parameters, Adam moments and
    relayed weights are the one-rank run's. Without the replicas' sum each group would step on half the batch's
    expert gradient and the experts would differ."""
    kw = _kw(tiny_tokenizer, tmp_path)
    batch = _batch(tiny_tokenizer, rows=12, seed=4)
    one = ExpertsWorker(**kw)
    m0 = one.update(batch, LOSS, seed=0)
    state = copy.deepcopy(one.state())
    m1 = [one.update(batch, LOSS, seed=s) for s in (1, 2)]
    ep = _group(kw, "epg2", 2)
    try:
        layout = ep.all("experts")
        ep.all("load_state", state)
        m2 = [ep.split("update", batch, LOSS, seed=s) for s in (1, 2)]
        got = ep.all_rank0("state")
        weights = dict(ep.all_rank0("named_weights"))
    finally:
        ep.shutdown()
    assert m0["actor/grad_norm"] > MAX_NORM
    for rank in layout:
        assert all(shape[0] == 2 for _, _, shapes in rank for shape in shapes)  # 2 of 4 experts on each rank
    for a, b in zip(m1, m2, strict=True):
        assert b[0]["actor/grad_norm"] > MAX_NORM
        for k, v in a.items():
            if not k.endswith("forward_tokens"):
                assert all(r[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for r in b), k
        loads = {r["actor/expert_load_imbalance"] for r in b}
        assert len(loads) == 1 and 1.0 <= loads.pop() <= 2.0  # (the same figure on every rank: over all four)
    own = one.state()
    _close(got["model"], own["model"])
    for n, moments in own["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optimizer"]["state"][n][key], moments[key], atol=1e-5, rtol=1e-3,
                                       msg=f"{n} {key}")
    _close(weights, dict(one.named_weights()))


@pytest.mark.multiproc
def test_a_checkpoint_saved_in_groups_of_two_loads_in_one_group_and_without_expert_parallelism(tiny_tokenizer,
                                                                                              tmp_path):
    """An update at engine.expert_parallel=2 saves a state; four ranks at expert_parallel=true (one group, one
    expert each) load it and hold its weights and moments, and their next update is a one-rank worker's from the
    same state (expert_parallel off), weights and all."""
    kw = _kw(tiny_tokenizer, tmp_path)
    batch = _batch(tiny_tokenizer, rows=12, seed=5)
    ep = _group(kw, "epsave2", 2)
    try:
        assert all(shape[0] == 2 for rank in ep.all("experts") for _, _, shapes in rank for shape in shapes)
        ep.split("update", batch, LOSS, seed=0)
        saved = ep.all_rank0("state")
    finally:
        ep.shutdown()
    ep = _group(kw, "epload4", True)
    try:
        layout = ep.all("experts")
        ep.all("load_state", saved)
        loaded = ep.all_rank0("state")
        m4 = ep.split("update", batch, LOSS, seed=1)
        after = ep.all_rank0("state")["model"]
    finally:
        ep.shutdown()
    assert all(shape[0] == 1 for rank in layout for _, _, shapes in rank for shape in shapes)  # (e=4: one each)
    _close(loaded["model"], saved["model"], atol=0)
    for n, moments in saved["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optimizer"]["state"][n][key], moments[key]), f"{n} {key}"
    one = ExpertsWorker(**kw)  # (off: the experts whole on one rank)
    first = copy.deepcopy(one.state()["model"])
    one.load_state(saved)
    _close(one.state()["model"], saved["model"], atol=0)
    assert any(not torch.equal(saved["model"][n], t) for n, t in first.items())  # (the update moved them)
    m1 = one.update(batch, LOSS, seed=1)
    for k, v in m1.items():
        if not k.endswith("forward_tokens"):
            assert all(r[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for r in m4), k
    _close(after, one.state()["model"])


def test_a_group_larger_than_a_layers_experts_is_refused_naming_the_key():
    """4 experts a layer in groups of 8 ranks: four ranks of each group would hold nothing (a 1-rank mesh of 8 is
    not needed to see it: the check reads the mesh's sizes only)."""

    class Mesh:  # (the two sizes shard_experts reads before it places anything)
        ndim = 2

        def size(self, dim=None):
            return {None: 16, 1: 8}[dim]

        def get_local_rank(self, dim):
            return 0

        def get_group(self, dim):
            return None

    with pytest.raises(ExpertParallelError, match=r"group of 8 ranks.* 4 experts a layer.* set "
                                                  r"engine.expert_parallel to one of 2, 4"):
        shard_experts(build("qwen3_moe"), Mesh(), None)


@pytest.mark.parametrize("size, ranks, match", [
    (3, 4, r"engine.expert_parallel=3 puts the trainer's ranks in groups of 3, and cluster.devices x "
           r"cluster.nodes = 4 .* set engine.expert_parallel to one of 2, 4"),
    (8, 4, r"engine.expert_parallel=8 .* one of 2, 4"),
    (2, 1, r"engine.expert_parallel=2 splits .* cluster.devices x cluster.nodes = 1"),
    (0, 4, r"engine.expert_parallel=0: give true .* or false"),
])
def test_the_config_refuses_a_group_size_that_does_not_divide_the_ranks(size, ranks, match):
    with pytest.raises(ValueError, match=match):
        Config.model_validate({"engine": {"expert_parallel": size},
                               "cluster": {"devices": ranks, "oversubscribe": True}})


@pytest.mark.parametrize("size, group", [(True, 4), (2, 2), (4, 4), (1, 1), (False, 1)])
def test_the_config_takes_true_a_divisor_of_the_ranks_or_off(size, group):
    cfg = Config.model_validate({"engine": {"expert_parallel": size}, "cluster": {"devices": 4, "oversubscribe": True}})
    assert cfg.engine.expert_group(4) == group and cfg.engine.expert_parallel == size


def test_the_plan_says_how_the_groups_hold_the_experts():
    from relayrl.config.plan import step_plan

    cfg = Config.model_validate({"engine": {"expert_parallel": 2}, "cluster": {"devices": 4, "oversubscribe": True}})
    note, = [n for n in step_plan(cfg).notes if n.startswith("engine.expert_parallel")]
    assert "each of the trainer's 4 ranks holds 1/2 of every MoE layer's experts (2 groups of 2 ranks" in note
