"""Online DPO in the GRPO pipeline: the advantage stage's rows (:func:`~relayrl.workflows.estimate.advantage_rows`)
trained by the actor's loss (:class:`~relayrl.workflows.losses.PolicyLoss` as the step builds it) through the
training engine give the model's parameters the gradient of DPO on the same pairs, also when micro-batches cut
the pairs apart; and ``recipes/arith_online_dpo.yaml`` runs end to end (slow)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from relayrl.algorithms.dpo import dpo_loss
from relayrl.algorithms.online_dpo import best_worst_pairs
from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.estimate import advantage_rows
from relayrl.workflows.losses import PolicyLoss

RECIPE = "recipes/arith_online_dpo.yaml"


def _batch(tok, seed: int = 0) -> tuple[SequenceBatch, torch.Tensor]:
    """Three prompt groups of four responses (one group with a tie for the best, rows of the groups in rollout
    order) and their rewards."""
    g = torch.Generator().manual_seed(seed)
    groups = [0] * 4 + [1] * 4 + [2] * 4
    prompts = [torch.tensor(tok(f"{k}+{k + 4}=")["input_ids"]) for k in groups]
    responses = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 9, (12,), generator=g)]
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2, 0.3, 0.9, 0.1, 0.4])
    return SequenceBatch(prompts, responses, {}, groups=groups), rewards


def _engine(tiny_dir, **cfg) -> tuple[TorchTrainingEngine, list[torch.Tensor]]:
    """A training engine on the tiny model whose optimizer step records the gradient it was given."""
    from relayrl.models.load import load_model

    eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(dropout="none", **cfg), total_steps=4)
    grads: list[torch.Tensor] = []
    eng.optimizer.register_step_pre_hook(
        lambda *_: grads.append(torch.cat([p.grad.flatten() for p in eng.model.parameters()])))
    return eng, grads


def _direct_dpo(tiny_dir, batch: SequenceBatch, ref: list[torch.Tensor], rewards: torch.Tensor, beta: float):
    """DPO written out on the model: each response's summed log-prob from a plain forward, dpo_loss on the
    best-worst pairs; its value and the gradient of every parameter."""
    from relayrl.models.load import load_model

    model = load_model(tiny_dir)
    sums = []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        ids = torch.cat([p, r])[None]
        logits = model(ids).logits[0, len(p) - 1:-1]
        sums.append(torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).sum())
    s = torch.stack(sums)
    ref_s = torch.stack([x.sum() for x in ref])
    c, w, _ = best_worst_pairs(rewards, torch.tensor(batch.groups))
    loss, _ = dpo_loss(s[c], s[w], ref_s[c], ref_s[w], beta=beta)
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("cut", [False, True], ids=["one-micro-batch", "micro-batches-cut-the-pairs"])
def test_the_step_trains_the_parameters_with_dpos_gradient(tiny_dir, tiny_tokenizer, cut, one_torch_thread):
    cfg = load_config(Config, RECIPE, ["algorithm.online_dpo.beta=0.3"])
    a = cfg.algorithm
    batch, rewards = _batch(tiny_tokenizer)
    engine_cfg = dict(optim=OptimConfig(lr=1e-3, max_grad_norm=None))
    if cut:  # rows one or two at a time: a pair's responses meet in different micro-batches
        engine_cfg.update(packing="none", token_budget=24)
    eng, grads = _engine(tiny_dir, **engine_cfg)
    if cut:  # some pair's two responses are in two micro-batches
        where = {i: k for k, rows in enumerate(eng._plan(batch)) for i in rows}
        c, w, _ = best_worst_pairs(rewards, torch.tensor(batch.groups))
        assert len(set(where.values())) >= 4 and any(where[i] != where[j] for i, j in zip(c.tolist(), w.tolist()))
    old = eng.logprobs(batch)[0]  # the pipeline's pi_old pass
    gen = torch.Generator().manual_seed(1)
    ref = [-torch.rand(len(r), generator=gen) * 4 for r in batch.response_ids]  # a reference's log-probs
    out, metrics = advantage_rows(a, rewards, [len(r) for r in batch.response_ids], torch.tensor(batch.groups),
                                  ref_logprobs=ref, old_logprobs=old)
    batch.fields.update(advantages=out["advantages"], old_logprobs=old, ref_logprobs=ref)
    loss = PolicyLoss(agg=a.loss_agg, kind=a.policy_loss, kl_coef=a.kl_coef,
                      agg_constant=float(cfg.rollout.max_new_tokens))  # (as the step builds it: parts.build_parts)
    m = eng.train_step(batch, loss)
    value, want = _direct_dpo(tiny_dir, batch, ref, rewards, beta=0.3)
    assert len(grads) == 1 and bool(want.abs().sum() > 0)
    torch.testing.assert_close(grads[0], want, atol=1e-6, rtol=1e-4)
    assert metrics["online_dpo/loss"] == pytest.approx(value, rel=1e-5)
    assert metrics["online_dpo/pairs"] == 3 and metrics["online_dpo/pair_frac"] == 1.0
    assert "actor/pg_loss" in m and "actor/ref_kl_k1" in m  # the surrogate's value, and the KL reported, no term


def _run(run_dir, student, *over: str) -> list[dict]:
    from relayrl.workflows.pipeline import GRPOPipeline

    cfg = load_config(Config, RECIPE, [
        f"run.dir={run_dir}", f"trainer.init_from={student}", "trainer.steps=3", "eval.size=8", "eval.every=0",
        "data.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=8", "telemetry.sinks=[jsonl]",
        "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0", "run.save_every=0", "run.threads=1",
        "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length", *over])
    GRPOPipeline(cfg).run()
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]


KEYS = ("online_dpo/loss", "online_dpo/pairs", "online_dpo/pair_frac", "online_dpo/reward_accuracy",
        "online_dpo/reward_margin", "online_dpo/rewards_chosen", "online_dpo/rewards_rejected",
        "online_dpo/logps_chosen", "online_dpo/logps_rejected", "online_dpo/nll_chosen", "online_dpo/score_margin")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    [],
    ["trainer.mode=periodic", "placement.pools={gen: 1}", "placement.rollout=gen"],
    ["trainer.off_policy_steps=1"],
], ids=["sync", "periodic", "semi-online-k1"])
def test_the_recipe_trains_and_logs_dpos_figures(tmp_path, tiny_dir, mode):
    """Three steps of the recipe from the tiny model (a reward by length, so groups differ): every step logs the
    online_dpo/* figures, finite; the first step's policy is the reference, so its margins are 0 and its loss is
    log 2; the update moves the policy (its margins then differ from 0)."""
    recs = _run(tmp_path, tiny_dir, *mode)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in KEYS:
            assert k in r and math.isfinite(r[k]), (r["step"], k)
        assert 1 <= r["online_dpo/pairs"] <= 2 and 0 < r["online_dpo/pair_frac"] <= 1
        assert r["online_dpo/score_margin"] > 0 and r["actor/grad_norm"] > 0
    assert recs[0]["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert recs[0]["online_dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(r["online_dpo/reward_margin"]) > 1e-4 for r in recs[1:])
    assert "eval/accuracy" in recs[-1]


@pytest.mark.slow
def test_a_reference_reset_makes_the_next_margins_zero(tmp_path, tiny_dir):
    """trainer.ref_sync_every=1 with alpha 1 (ProRL's reset) moves the reference online DPO builds onto the policy
    after every step, so each next step's pre-update policy is its reference: loss log 2 every step."""
    recs = _run(tmp_path, tiny_dir, "trainer.ref_sync_every=1", "trainer.ref_sync_alpha=1.0")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-5), r["step"]
        assert r["online_dpo/reward_margin"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.slow
def test_dynamic_sampling_keeps_only_groups_that_give_a_pair(tmp_path, tiny_dir):
    """A reward under which some prompts' responses all score 1 (dataflow_rewards:half_uniform): dynamic sampling
    drops those groups and draws others, so every group the step trains on gives a pair."""
    recs = _run(tmp_path, tiny_dir, "reward.user_fn=dataflow_rewards:half_uniform", "algorithm.dynamic_sampling=true",
                "data.prompts_per_step=4", "trainer.steps=2")
    assert sum(r["dapo/dropped_groups"] for r in recs) > 0
    for r in recs:
        assert r["online_dpo/pair_frac"] == 1.0 and r["online_dpo/pairs"] == 4 - r["dapo/missing_prompts"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_data_parallel_ranks_train_with_dpos_figures(tmp_path, tiny_dir):
    """cluster.devices=2 (two actor ranks under FSDP2, two reference and two rollout ranks): the pairs' advantages
    are computed on the whole batch before the ranks split its rows, so the first step is still DPO at the
    reference (loss log 2, margins 0) and the update moves the margins; both rollout ranks sample with the relayed
    weights. (The two runs' rows differ from one rank's: each rollout rank draws its own seed.)"""
    recs = _run(tmp_path, tiny_dir, "cluster.devices=2", "data.prompts_per_step=4")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in KEYS:
            assert k in r and math.isfinite(r[k]), (r["step"], k)
        assert r["actor/grad_norm"] > 0 and r["rollout/logprob_error_max"] < 1.001
    assert recs[0]["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert recs[0]["online_dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(r["online_dpo/reward_margin"]) > 1e-4 for r in recs[1:])


@pytest.mark.slow
def test_lora_trains_the_adapters_with_dpos_figures(tmp_path, tiny_dir):
    """model.lora.enabled: the reference is the frozen base (the adapters off), so the first step's loss is log 2;
    the adapters' update moves the margins."""
    recs = _run(tmp_path, tiny_dir, "model.lora.enabled=true", "model.lora.r=8", "engine.optim.lr=1e-2")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(r["actor/grad_norm"] > 0 for r in recs)
    assert any(abs(r["online_dpo/reward_margin"]) > 1e-4 for r in recs[1:])
    assert all(r["rollout/logprob_error_max"] < 1.001 for r in recs)  # (merged adapters reached the rollout)
