"""An update's metrics over its optimizer steps (``trainer.mini_batches`` x ``trainer.epochs``) are what their
names say over the whole batch: token means over every trained token, extremes over every token, token counts
summed (docs/metrics.md). They were plain means of the mini-batches' figures: ``actor/forward_tokens`` a
mini-batch's share, ``actor/ratio_max`` a mean of maxima, ``actor/entropy`` a mean of mini-batch means."""

import pytest
import torch

from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.steps import over_steps
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss, SFTLoss


def _uneven_batch() -> SequenceBatch:
    """Six rows of 1 to 20 response tokens: mini-batches of 2 rows hold very different token counts."""
    g = torch.Generator().manual_seed(0)
    lens = [1, 2, 3, 10, 12, 20]
    batch = SequenceBatch([torch.randint(5, 100, (4,), generator=g) for _ in lens],
                          [torch.randint(5, 100, (n,), generator=g) for n in lens])
    batch.fields["advantages"] = [torch.randn(n, generator=g) for n in lens]
    return batch


def test_policy_update_metrics_over_mini_batches_are_the_batch_figures(tiny_model):
    batch = _uneven_batch()
    # the figures by hand, from a plain forward of each row (the weights do not move: lr 1e-12)
    lp, ent = [], []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        with torch.no_grad():
            logp = torch.log_softmax(tiny_model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float(), -1)
        lp.append(logp.gather(-1, r[:, None]).squeeze(-1))
        ent.append(-(logp.exp() * logp).sum(-1))
    g = torch.Generator().manual_seed(1)  # pi_old: the policy's log-probs moved, ratios on both sides of the clip
    batch.fields["old_logprobs"] = [x + 0.3 * torch.randn(len(x), generator=g) for x in lp]
    lp, ent = torch.cat(lp), torch.cat(ent)
    adv, old = torch.cat(batch.fields["advantages"]), torch.cat(batch.fields["old_logprobs"])
    ratio = (lp - old).exp()
    want = {"actor/entropy": ent.mean(), "actor/ratio_mean": ratio.mean(), "actor/ratio_max": ratio.max(),
            "actor/ratio_min": ratio.min(), "actor/clip_frac_low": ((ratio < 0.8) & (adv < 0)).float().mean(),
            "actor/clip_frac_high": ((ratio > 1.2) & (adv > 0)).float().mean()}
    assert 0 < want["actor/clip_frac_low"] < 1 and 0 < want["actor/clip_frac_high"] < 1  # (the test sees both)

    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(packing="sequences", optim=OptimConfig(lr=1e-12)),
                              total_steps=20)
    one = eng.train_step(batch, PolicyLoss(agg="token-mean"), with_entropy=True)
    for mb, epochs in ((3, 1), (2, 2)):
        m = eng.train_step(batch, PolicyLoss(agg="token-mean"), mini_batches=mb, epochs=epochs, with_entropy=True,
                           generator=torch.Generator().manual_seed(1))
        for k, v in want.items():
            assert m[k] == pytest.approx(float(v), rel=1e-4, abs=1e-6), (k, mb, epochs)
        # every epoch's passes take every row's tokens (and the packs' padding, which depends on the grouping)
        tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
        assert epochs * tokens <= m["actor/forward_tokens"] <= epochs * 2 * one["actor/forward_tokens"]
        assert m["actor/nonfinite_grad"] == 0.0 and m["actor/lr"] > 0


def test_over_steps_combines_each_kind_by_hand():
    steps = [({"actor/entropy": 1.0, "actor/ratio_max": 1.5, "actor/ratio_min": 0.9, "actor/forward_tokens": 30,
               "actor/loss": 0.2, "actor/grad_norm": 2.0, "actor/nonfinite_grad": 0.0,
               "correction/seq_capped_frac": 0.5}, 10, 2),
             ({"actor/entropy": 4.0, "actor/ratio_max": 1.1, "actor/ratio_min": 0.5, "actor/forward_tokens": 50,
               "actor/loss": 0.6, "actor/grad_norm": 4.0, "actor/nonfinite_grad": 1.0,
               "correction/seq_capped_frac": 0.0}, 30, 6)]
    m = over_steps(steps, "actor")
    assert m == {"actor/entropy": (1.0 * 10 + 4.0 * 30) / 40, "actor/ratio_max": 1.5, "actor/ratio_min": 0.5,
                 "actor/forward_tokens": 80, "actor/loss": 0.4, "actor/grad_norm": 3.0, "actor/nonfinite_grad": 1.0,
                 "correction/seq_capped_frac": 1 / 8}  # one capped response of the 8, by responses not tokens
    # a loss's own normalised names are averaged, as its loss is; a name one step lacks: over those that have it
    m = over_steps([({"dpo/reward_accuracy": 0.5}, 4, 2), ({"dpo/reward_accuracy": 1.0, "x/y": 2.0}, 12, 2)],
                   "actor", summed=("dpo/reward_accuracy",))
    assert m == {"dpo/reward_accuracy": 0.75, "x/y": 2.0}


@pytest.mark.parametrize("budget,mini_batches", [(10_000, 1), (16, 1), (16, 3)])
def test_sft_perplexity_is_the_batch_perplexity(tiny_model, budget, mini_batches):
    """``sft/ppl`` is exp of the batch's token-mean NLL however it is cut (micro-batches of
    ``engine.token_budget``, mini-batches); it was the token mean of the micro-batches' perplexities, which
    read 563k for a batch whose perplexity is 294k."""
    batch = _uneven_batch()
    nll = []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        with torch.no_grad():
            logp = torch.log_softmax(tiny_model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float(), -1)
        nll.append(-logp.gather(-1, r[:, None]).squeeze(-1))
    want = torch.cat(nll).mean().exp().item()
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(token_budget=budget, optim=OptimConfig(lr=1e-12)),
                              total_steps=20)
    m = eng.train_step(batch, SFTLoss(), mini_batches=mini_batches, generator=torch.Generator().manual_seed(0))
    assert m["sft/ppl"] == pytest.approx(want, rel=1e-4)
    assert m["sft/tokens"] == sum(len(r) for r in batch.response_ids)
