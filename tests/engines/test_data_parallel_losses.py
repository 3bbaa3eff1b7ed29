"""Two data-parallel ranks (FSDP2 over gloo) compute what one rank computes, for every loss a user runs: each
``algorithm.loss_agg`` with a KL term and an entropy bonus, one and two mini-batches; the critic's value loss;
DPO and SFT. The batches put unequal row and token counts on the ranks, so a loss normalised by a rank's own
count (instead of the mini-batch's global one) shows as a different loss, gradient norm and weights."""

import pytest
import torch

from relayrl.algorithms.names import AGG_MODES
from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.workflows.losses import DPOLoss, PolicyLoss, SFTLoss, ValueLoss
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GROUPS = [(14, 12, 10, 13), (2, 3), (3, 1, 2), (2, 2, 1)]
"""The response lengths of each prompt group's rows: the split puts 4 long rows on rank 0 and 8 short ones on
rank 1."""


def _rows(tok) -> SequenceBatch:
    g = torch.Generator().manual_seed(5)
    prompts, responses, groups = [], [], []
    for k, lengths in enumerate(GROUPS):
        p = torch.tensor(tok(f"{k}+{3 * k}=")["input_ids"])
        for n in lengths:
            prompts.append(p)
            responses.append(torch.randint(5, 200, (n,), generator=g))
            groups.append(k)
    return SequenceBatch(prompts, responses, {}, groups=groups)


def _policy_batch(tok, lp: list[torch.Tensor]) -> SequenceBatch:
    """Rows with advantages, pi_old and reference log-probs off the current ones (ratios clip, the KL is not 0)."""
    b = _rows(tok)
    g = torch.Generator().manual_seed(6)
    noise = [0.3 * torch.randn(len(x), generator=g) for x in lp]
    b.fields.update(advantages=[torch.randn(len(x), generator=g) for x in lp],
                    old_logprobs=[x + e for x, e in zip(lp, noise)],
                    ref_logprobs=[x - 0.5 * e.abs() for x, e in zip(lp, noise)])
    return b


def _unequal(batch: SequenceBatch) -> None:
    parts = batch.split(2)
    assert len(parts[0]) != len(parts[1]) and parts[0].num_tokens != parts[1].num_tokens


def _same_metrics(m1: dict, m2: list[dict], what: str, skip=("forward_tokens",)) -> None:
    assert m2[0] == pytest.approx(m2[1], nan_ok=True), what  # every rank reports the global figures
    assert set(m2[0]) == set(m1), what
    for k, v in m1.items():  # (forward_tokens counts padding, which depends on how rows were packed)
        if not k.endswith(skip):
            assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), f"{what}: {k}"


def _same_weights(w1, w2, what: str) -> None:
    w1, w2 = dict(w1), dict(w2)
    assert set(w1) == set(w2)
    for n, t in w1.items():
        torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=f"{what}: {n}")  # (Adam amplifies noise)


def _kw(tiny_dir, steps: int) -> dict:
    return dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=40, optim=OptimConfig(lr=1e-2)),
                total_steps=steps, threads=1, seed=0)


def test_every_loss_agg_with_kl_and_entropy_matches_one_rank(tiny_dir, tiny_tokenizer):
    """Each ``algorithm.loss_agg`` (PPO-clip with a k3 KL term and an entropy bonus, gradients through the
    entropy), one mini-batch then two: one update after another on the same pair of models, each update's
    metrics compared, the weights after all of them."""
    kw = _kw(tiny_dir, 4 * len(AGG_MODES))
    one = PolicyWorker(**kw)
    batch = _policy_batch(tiny_tokenizer, one.logprobs(_rows(tiny_tokenizer)))
    _unequal(batch)
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=kw)
    try:
        step = 0
        for mini_batches in (1, 2):
            for agg in AGG_MODES:
                loss = PolicyLoss(agg=agg, kl_coef=0.1, entropy_coef=0.01, agg_constant=16.0, clip_high=0.28)
                opt = dict(mini_batches=mini_batches, seed=step, with_entropy="grad")
                m1 = one.update(batch, loss, **opt)
                m2 = dp.split(PolicyWorker.update, batch, loss, **opt)
                assert m1["actor/clip_frac_high"] + m1["actor/clip_frac_low"] > 0 and m1["actor/kl_loss"] > 0
                _same_metrics(m1, m2, f"{agg}, mini_batches={mini_batches}")
                step += 1
        _same_weights(one.named_weights(), dp.all_rank0(PolicyWorker.named_weights), "policy")
    finally:
        dp.shutdown()
