"""Expert parallelism (engine.expert_parallel) on a 2-rank gloo group: each rank holds half of every layer's
experts and tokens travel to them; the update, log-probs, routing, checkpoint and relayed weights are one rank's."""

import copy

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.cluster.config import ClusterConfig
from relayrl.config.schema import Config
from relayrl.engines.training.base import OptimConfig
from relayrl.engines.training.expert_parallel import ExpertParallelError, expert_modules, shard_experts
from relayrl.engines.training.torch_engine import TrainEngineConfig
from tests.engines.moe_workers import ExpertsWorker, moe_dir, with_routes
from tests.engines.test_lora_fsdp import LOSS, _assert_metrics_match, _batch
from tests.models.architectures import EAGER, build

ENGINE = TrainEngineConfig(token_budget=48, optim=OptimConfig(lr=1e-2))


def _matches(m1: dict, m2: list[dict], load: float | None = None) -> None:
    """One rank's update metrics on both expert-parallel ranks, which also report how evenly the experts' ranks
    were loaded (the same figure on both; ``load``: the figure expected)."""
    loads = [m.pop("actor/expert_load_imbalance") for m in m2]
    assert loads[0] == loads[1] and 1.0 <= loads[0] <= 2.0
    if load is not None:
        assert loads[0] == pytest.approx(load)
    _assert_metrics_match(m1, m2)


def _updates_match(kw: dict, batch, name: str, *, one=None, ep_kw: dict | None = None,
                   load: float | None = None) -> ExpertsWorker:
    """Two updates of ``batch`` on one rank (``one``, or a new worker of ``kw``) and on two expert-parallel ranks
    (``ep_kw``, else ``kw``) give the same metrics, trained state and relayed (merged, gathered) weights; the
    one-rank worker."""
    one = one or ExpertsWorker(**kw)
    ep = _group(ep_kw or kw, name)
    try:
        for step in range(2):
            _matches(one.update(batch, LOSS, seed=step), ep.split("update", batch, LOSS, seed=step), load)
        got = ep.all_rank0("state")["model"]
        weights = dict(ep.all_rank0("named_weights"))
    finally:
        ep.shutdown()
    own = one.state()["model"]
    assert set(got) == set(own)
    for n, t in own.items():
        torch.testing.assert_close(got[n], t, atol=2e-4, rtol=1e-3, msg=n)
    for n, t in one.named_weights():
        torch.testing.assert_close(weights[n], t, atol=2e-4, rtol=1e-3, msg=n)
    return one


def _group(kw, name="ep"):
    """Two ranks splitting the experts; a collective that waits a minute fails (an exchange one rank skips would
    hang the test otherwise)."""
    ep = {**kw, "engine": kw["engine"].model_copy(update={"expert_parallel": True})}
    return WorkerGroup(ExpertsWorker, ResourcePool(name, devices=2), "actor", init_kwargs=ep,
                       backend=ClusterConfig(backend="local", collective_timeout_s=60))


@pytest.mark.multiproc
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_two_rank_expert_parallel_trains_as_one_rank(tiny_tokenizer, tmp_path, arch):
    """Each rank holds 2 of the 4 experts of every layer (Qwen3-MoE, Mixtral; GPT-OSS with their biases) and
    sends tokens to them. The updates replay recorded routes; a one-rank checkpoint loads onto the split experts, and the next
    update's metrics, the parameters after it (gathered whole, as a checkpoint and the relay gather them), the
    log-probs and the routing the old-policy pass records are the one-rank run's."""
    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe", arch)), engine=ENGINE, total_steps=4,
              threads=1, seed=0, routing_replay=True, attn_implementation="eager" if arch in EAGER else "sdpa")
    batch = _batch(tiny_tokenizer)
    g = torch.Generator().manual_seed(2)
    batch.response_ids[0] = torch.randint(5, 200, (40,), generator=g)  # rank 0 gets more micro-batches
    batch.fields["advantages"][0] = torch.randn(40, generator=g)
    one = ExpertsWorker(**kw)
    batch = with_routes(batch, one.routes(batch))  # the updates replay these (R2)
    m0 = one.update(batch, LOSS, seed=0)
    state = copy.deepcopy(one.state())
    m1 = one.update(batch, LOSS, seed=1)
    ep = _group(kw)
    try:
        layout = ep.all("experts")
        _matches(m0, ep.split("update", batch, LOSS, seed=0))  # (from the same start)
        ep.all("load_state", state)
        _matches(m1, ep.split("update", batch, LOSS, seed=1))
        got = ep.all_rank0("state")
        weights = dict(ep.all_rank0("named_weights"))
        logprobs = ep.split("logprobs", batch)
        routes = ep.split(ExpertsWorker.routes, batch)
    finally:
        ep.shutdown()
    for rank in layout:
        assert len(rank) == 2 and all(dispatching for _, dispatching, _ in rank)  # one experts module a layer
        assert all(shape[0] == 2 for _, _, shapes in rank for shape in shapes)  # 2 of 4 experts on each rank
    own = one.state()
    assert set(got["model"]) == set(own["model"])
    for n, t in own["model"].items():
        torch.testing.assert_close(got["model"][n], t, atol=2e-4, rtol=1e-3, msg=n)
    assert got["scheduler"]["last_epoch"] == 2
    assert set(got["optimizer"]["state"]) == set(own["optimizer"]["state"])  # Adam's moments, gathered whole
    for n, moments in own["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optimizer"]["state"][n][key], moments[key], atol=1e-5, rtol=1e-3,
                                       msg=f"{n} {key}")
    for n, t in one.named_weights():
        torch.testing.assert_close(weights[n], t, atol=2e-4, rtol=1e-3, msg=n)
    for a, b in zip(one.logprobs(batch), logprobs, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for a, b in zip(one.routes(batch), routes, strict=True):
        assert torch.equal(a, b)


@pytest.mark.multiproc
def test_a_rank_whose_experts_get_no_token_still_steps_with_the_others(tiny_tokenizer, tmp_path):
    """Every token replayed to experts 0 and 1 (rank 0's): rank 1 receives no pair in any layer, yet joins every
    exchange and gives its experts a zero gradient, so the clip and the optimizer step run on both ranks alike;
    the updates and weights are one rank's. With transformers' eager experts loop, which touches no weight of an
    expert without tokens (its grouped products read them all)."""
    import json

    path = moe_dir(tiny_tokenizer, tmp_path / "moe")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "experts_implementation": "eager"}))
    kw = dict(model_path=str(path), engine=ENGINE, total_steps=4, threads=1, seed=0, routing_replay=True)
    batch = _batch(tiny_tokenizer, seed=7)
    one = ExpertsWorker(**kw)
    batch = with_routes(batch, [torch.zeros_like(r) + torch.tensor([0, 1], dtype=r.dtype) for r in one.routes(batch)])
    _updates_match(kw, batch, "epidle", one=one, load=2.0)  # (rank 0 received every pair: twice the mean)


@pytest.mark.multiproc
def test_two_rank_expert_parallel_in_bf16_mixed_precision(tiny_tokenizer, tmp_path):
    """Float32 master weights computed in bf16: the local experts run in the compute dtype, as FSDP2 gathers the
    other parameters in it, so two updates split by experts are two FSDP2 updates on the same ranks to bf16
    rounding (the products are summed in other orders), and the masters stay float32. One rank's autocast is
    not the reference here: FSDP2's mixed precision casts at other points."""
    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), engine=ENGINE, total_steps=4, threads=1,
              seed=0, dtype="float32", compute_dtype="bfloat16")
    batch = _batch(tiny_tokenizer, seed=3)
    runs = []
    for group in (WorkerGroup(ExpertsWorker, ResourcePool("dp16", devices=2), "actor", backend="local",
                              init_kwargs=kw), _group(kw, "ep16")):
        try:
            runs.append(([group.split("update", batch, LOSS, seed=step)[0] for step in range(2)],
                         group.all_rank0("state")["model"]))
        finally:
            group.shutdown()
    (dp, dp_state), (ep, ep_state) = runs
    for a, b in zip(dp, ep, strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-2)
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-2, abs=1e-4)
    for n, t in dp_state.items():  # (Adam turns a near-zero gradient's bf16 rounding into a step either way: an
        assert ep_state[n].dtype == torch.float32  # odd element moves by up to lr 1e-2 a step in each run, so
        # the two runs' two steps can be up to 4e-2 apart: 0.021 held on one CPU, 0.024 was seen on another)
        torch.testing.assert_close(ep_state[n], t, atol=4.1e-2, rtol=0, msg=n)
        assert float((ep_state[n] - t).abs().mean()) < 2e-4, n


@pytest.mark.multiproc
def test_expert_parallel_with_lora_on_the_attention_trains_and_merges_as_one_rank(tiny_tokenizer, tmp_path):
    """LoRA on the attention beside split experts: the frozen experts still dispatch (no gradient of their own),
    the adapters train as on one rank, and the merged weights the rollout gets hold every expert whole."""
    from relayrl.models.lora import LoraConfig

    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), engine=ENGINE, total_steps=4, threads=1,
              seed=0, lora=LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "o_proj"]))
    one = _updates_match(kw, _batch(tiny_tokenizer, seed=6), "eplora")  # (adapters and merged weights too)
    assert all(".lora_" in n for n in one.state()["model"])
    assert dict(one.named_weights())["model.layers.0.mlp.experts.down_proj"].shape[0] == 4


@pytest.mark.multiproc
def test_a_streamed_update_with_dp_sync_step_accumulates_the_experts_as_one_rank(tiny_tokenizer, tmp_path):
    """The periodic and off-policy trainers' update: chunks of prompt groups accumulated (engine.dp_sync=step:
    FSDP2 reduces once at the step, the experts' gradients add up where they live), then one optimizer step;
    the metrics and weights are one rank's doing the same."""
    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), total_steps=4, threads=1, seed=0,
              engine=ENGINE.model_copy(update={"dp_sync": "step"}))
    batch = _batch(tiny_tokenizer, rows=18, seed=8)
    chunks = [batch.select(range(i, i + 6)) for i in (0, 6, 12)]  # two prompt groups of 3 each
    one = ExpertsWorker(**kw)
    for i, chunk in enumerate(chunks):
        one.accumulate(chunk, LOSS, fresh=i == 0)
    m1 = one.optim_step()
    ep = _group(kw, "epacc")
    try:
        for i, chunk in enumerate(chunks):
            ep.split("accumulate", chunk, LOSS, fresh=i == 0)
        _matches(m1, ep.all("optim_step"))
        got = ep.all_rank0("state")["model"]
    finally:
        ep.shutdown()
    for n, t in one.state()["model"].items():
        torch.testing.assert_close(got[n], t, atol=2e-4, rtol=1e-3, msg=n)


@pytest.mark.multiproc
def test_expert_parallel_under_sequence_parallel_matches_one_rank(tiny_tokenizer, tmp_path):
    """engine.sequence_parallel=2 beside it: the two ranks share each micro-batch, half its tokens each, and send
    those tokens to the experts' ranks as data-parallel ranks do; the updates and weights are one rank's."""
    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), total_steps=4, threads=1, seed=0,
              engine=ENGINE.model_copy(update={"token_budget": 64}))
    sp = {**kw, "engine": kw["engine"].model_copy(update={"sequence_parallel": 2})}
    _updates_match(kw, _batch(tiny_tokenizer, seed=5), "epsp", ep_kw=sp)  # (rows padded to multiples of 2)


@pytest.mark.slow  # (Inductor compiles the layers on both ranks: about 15 s)
@pytest.mark.multiproc
def test_compiled_layers_around_the_dispatch_match_one_rank(tiny_tokenizer, tmp_path):
    """engine.compile=true: each decoder layer compiled, the dispatch left to run eagerly inside it (its
    exchanges' sizes are data); the updates and weights are one uncompiled rank's."""
    kw = dict(model_path=str(moe_dir(tiny_tokenizer, tmp_path / "moe")), engine=ENGINE, total_steps=4, threads=1,
              seed=0)
    compiled = {**kw, "engine": ENGINE.model_copy(update={"compile": True})}
    _updates_match(kw, _batch(tiny_tokenizer, seed=5), "epcompile", ep_kw=compiled)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_experts_modules_are_found_and_not_the_routers(arch):
    model = build(arch)
    found = expert_modules(model)
    assert [n.rsplit(".", 2)[-2:] for n, _ in found] == [["mlp", "experts"]] * 2
    assert all(p.shape[0] == 4 for _, m in found for p in m.parameters(recurse=False))


def test_a_dense_model_is_refused_naming_the_key():
    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM has none .* set engine.expert_parallel=false"):
        shard_experts(build("llama"), None, None)


def test_the_config_refuses_one_rank_and_adapters_on_the_experts():
    with pytest.raises(ValueError, match="cluster.devices x cluster.nodes = 1"):
        Config.model_validate({"engine": {"expert_parallel": True}})
    with pytest.raises(ValueError, match="model.lora.target_parameters wraps the expert tensors"):
        Config.model_validate({"engine": {"expert_parallel": True}, "cluster": {"devices": 2},
                               "model": {"lora": {"enabled": True,
                                                  "target_parameters": ["mlp.experts.gate_up_proj"]}}})
    assert Config.model_validate({"engine": {"expert_parallel": True}, "cluster": {"devices": 2}})
