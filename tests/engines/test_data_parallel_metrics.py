"""A role's update metrics on two data-parallel ranks (FSDP2 over gloo) are the batch's, reduced by their kind
over every rank's tokens and rows (docs/metrics.md): checked against figures computed by hand from a plain
forward of each row, with a ``loss_mask``, micro-batches of ``engine.token_budget`` and two mini-batches. The
per-response figures (``correction/seq_capped_frac``) were weighted by tokens over micro-batches, mini-batches and
ranks: 0.667 on one rank and 0.446 on two for a batch where 3 responses of 8 (0.375) had a capped token."""

import pytest
import torch

from relayrl.algorithms.correction import Correction
from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import LOSS_MASK_FIELD, OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.load import load_model
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import PolicyWorker


def _batch(tok) -> SequenceBatch:
    """Eight rows of 1 to 24 response tokens in groups of two, some tokens out of the loss (``loss_mask``)."""
    g = torch.Generator().manual_seed(3)
    lens = [1, 24, 3, 4, 18, 2, 9, 6]
    prompts = [torch.tensor(tok(f"{i}+{i}=")["input_ids"]) for i in range(len(lens) // 2) for _ in range(2)]
    responses = [torch.randint(5, 200, (n,), generator=g) for n in lens]
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lens]
    masks[0][:] = 1.0
    return SequenceBatch(prompts, responses, {"advantages": [torch.randn(n, generator=g) for n in lens],
                                              LOSS_MASK_FIELD: masks}, groups=[i // 2 for i in range(len(lens))])


def _by_hand(model, batch: SequenceBatch):
    lp, ent = [], []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float(), -1)
        lp.append(logp.gather(-1, r[:, None]).squeeze(-1))
        ent.append(-(logp.exp() * logp).sum(-1))
    return lp, ent


@pytest.mark.multiproc
def test_two_rank_update_metrics_are_the_batch_figures(tiny_dir, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    lp, ent = _by_hand(load_model(tiny_dir), batch)
    g = torch.Generator().manual_seed(4)
    batch.fields["old_logprobs"] = [x + 0.3 * torch.randn(len(x), generator=g) for x in lp]
    batch.fields["gen_logprobs"] = [x + 0.5 * torch.randn(len(x), generator=g) for x in batch.fields["old_logprobs"]]
    masks = batch.fields[LOSS_MASK_FIELD]
    m = torch.cat(masks).bool()
    old, gen = torch.cat(batch.fields["old_logprobs"]), torch.cat(batch.fields["gen_logprobs"])
    adv = torch.cat(batch.fields["advantages"])
    ratio = (torch.cat(lp) - old).exp()[m]
    w = (old - gen).exp()
    capped = w > 2.0
    seq_capped = [bool(((o - q).exp() > 2.0)[mk.bool()].any()) for o, q, mk in
                  zip(batch.fields["old_logprobs"], batch.fields["gen_logprobs"], masks)]
    want = {"actor/entropy": torch.cat(ent)[m].mean(), "actor/ratio_mean": ratio.mean(),
            "actor/ratio_max": ratio.max(), "actor/ratio_min": ratio.min(),
            "actor/clip_frac_high": ((ratio > 1.2) & (adv[m] > 0)).float().mean(),
            "correction/token_capped_frac": capped[m].float().mean(),
            "correction/seq_capped_frac": sum(seq_capped) / len(seq_capped),
            "correction/ratio_max": w[m].max(),
            "rollout/logprob_error": (old - gen)[m].abs().exp().mean()}
    assert 0 < want["correction/seq_capped_frac"] < 1
    kw = dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=40, optim=OptimConfig(lr=1e-12)),
              total_steps=4, threads=1, seed=0)
    loss = PolicyLoss(agg="token-mean", correction=Correction(high=2.0))
    one = PolicyWorker(**kw)
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=kw)
    try:
        m1 = one.update(batch, loss, mini_batches=2, with_entropy=True, seed=0)
        m2 = dp.split("update", batch, loss, mini_batches=2, with_entropy=True, seed=0)
    finally:
        dp.shutdown()
    assert m2[0] == pytest.approx(m2[1])
    for k, v in want.items():
        assert m1[k] == pytest.approx(float(v), rel=1e-4, abs=1e-6), ("one rank", k)
        assert m2[0][k] == pytest.approx(float(v), rel=1e-4, abs=1e-6), ("two ranks", k)
