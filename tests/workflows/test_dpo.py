"""DPO: the loss over packed pairs, pair drawing, and engine micro-batching that leaves the figures unchanged."""

import pytest
import torch

from relayrl.algorithms.dpo import dpo_loss
from relayrl.data.tasks import Problem
from relayrl.engines.training.base import MicroBatch, OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.dpo import take_pairs
from relayrl.workflows.losses import DPOLoss


def _mb(order, global_pairs=None):
    """Three pairs (rows in ``order``), per-row summed log-probs = row log-probs over 2 tokens."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 2, generator=g).requires_grad_()
    pair = torch.tensor([0., 0., 1., 1., 2., 2.])
    chosen = torch.tensor([1., 0., 1., 0., 1., 0.])
    ref = torch.randn(6, generator=g)
    o = torch.tensor(order)
    mb = MicroBatch(lp[o], torch.ones(6, 2), {"pair": pair[o], "chosen": chosen[o], "ref_logp": ref[o]},
                    global_tokens=12, global_seqs=2 * (global_pairs or 3))
    return mb, lp.sum(-1), ref


def test_dpo_loss_matches_pairs_in_any_row_order_and_scales_by_its_share():
    mb, seq, ref = _mb([0, 1, 2, 3, 4, 5])
    want, want_m = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=0.2)
    loss, m = DPOLoss(beta=0.2)(mb)
    loss, want = loss.detach(), want.detach()
    assert float(loss) == pytest.approx(float(want)) and m["dpo/reward_margin"] == pytest.approx(want_m["dpo/reward_margin"])
    shuffled, _, _ = _mb([5, 2, 0, 3, 1, 4])
    assert float(DPOLoss(beta=0.2)(shuffled)[0].detach()) == pytest.approx(float(want))
    half, _, _ = _mb([0, 1, 2, 3, 4, 5], global_pairs=6)  # these 3 pairs are half of the mini-batch's
    loss_h, m_h = DPOLoss(beta=0.2)(half)
    assert float(loss_h.detach()) == pytest.approx(float(want) / 2) and m_h["dpo/reward_accuracy"] == pytest.approx(
        want_m["dpo/reward_accuracy"] / 2)
    rpo, m_r = DPOLoss(beta=0.2, nll_weight=0.5)(mb)
    nll = float(-(seq[0::2] / 2).mean().detach())
    assert float(rpo.detach()) == pytest.approx(float(want) + 0.5 * nll, rel=1e-5)
    assert m_r["dpo/nll_chosen"] == pytest.approx(nll, rel=1e-5)


def test_an_incomplete_pair_is_an_error_naming_the_fix():
    mb, _, _ = _mb([0, 1, 2, 3, 4, 5])
    mb.fields["chosen"] = torch.tensor([1., 0., 1., 1., 1., 0.])
    with pytest.raises(ValueError, match="incomplete .* raise engine.token_budget"):
        DPOLoss()(mb)


def test_take_pairs_skips_problems_without_a_rejected_answer():
    pool = iter([Problem("a", "1"), Problem("b", "2", {"rejected": "3"}), Problem("c", "4", {"rejected": "5"})] * 5)
    got = take_pairs(lambda k: [next(pool) for _ in range(k)], 3)
    assert [p.prompt for p in got] == ["b", "c", "b"]
    with pytest.raises(ValueError, match="carries=inner"):
        take_pairs(lambda k: [Problem("a", "1")] * k, 2)


@pytest.mark.parametrize("loss_fn", [DPOLoss(beta=0.1, nll_weight=0.3), DPOLoss(kind="apo_zero"),
                                     DPOLoss(kind="simpo", beta=2.0, gamma=0.5), DPOLoss(kind="orpo"),
                                     DPOLoss(kind="cpo", nll_weight=1.0, label_smoothing=0.1)],
                         ids=["rpo", "apo_zero", "simpo", "orpo", "cpo"])
def test_micro_batched_dpo_step_reports_the_whole_batch(tiny_dir, tiny_tokenizer, loss_fn):
    """Pairs packed per prompt; a small token budget gives several micro-batches, with the same gradient and
    the same pair-mean figures as one micro-batch (the reference-free kinds without any ref_logp)."""
    from relayrl.models.load import load_model

    g = torch.Generator().manual_seed(3)
    prompts = [torch.tensor(tiny_tokenizer(f"{i}{i}+{i}7=")["input_ids"]) for i in range(6)]
    batch = SequenceBatch([p for p in prompts for _ in range(2)],
                          [torch.randint(5, 200, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
                           for _ in range(12)],
                          {"pair": [float(i // 2) for i in range(12)], "chosen": [1.0, 0.0] * 6,
                           "ref_logp": torch.randn(12, generator=g).tolist()},
                          groups=[i // 2 for i in range(12)])
    if loss_fn.reference_free:
        del batch.fields["ref_logp"]
    out = []
    for budget in (10_000, 24):
        torch.manual_seed(0)
        eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(token_budget=budget,
                                  optim=OptimConfig(lr=1e-2, max_grad_norm=None)), total_steps=1)
        out.append((len(eng._plan(batch)), eng.train_step(batch, loss_fn)))
    (n1, m1), (n2, m2) = out
    assert n1 == 1 and n2 > 1
    for k in ("dpo/loss", "dpo/reward_accuracy", "dpo/reward_margin", "dpo/logps_chosen", "dpo/nll_chosen",
              "actor/grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k


def test_reference_free_kinds_take_each_rows_token_mean_and_no_reference():
    """SimPO / ORPO read the average log-prob over each row's own tokens (rows of 1 to 3 tokens here) and no
    ``ref_logp``; the DPO sums are unchanged beside them."""
    from relayrl.algorithms.orpo import orpo_loss
    from relayrl.algorithms.simpo import simpo_loss

    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(4, 3, generator=g)
    mask = torch.tensor([[1., 1., 1.], [1., 0., 0.], [1., 1., 0.], [1., 1., 1.]])
    fields = {"pair": torch.tensor([0., 0., 1., 1.]), "chosen": torch.tensor([1., 0., 1., 0.])}
    mb = MicroBatch(lp, mask, fields, global_tokens=9, global_seqs=4)
    avg = (lp * mask).sum(-1) / mask.sum(-1)
    loss, m = DPOLoss(kind="simpo", beta=2.0, gamma=0.3)(mb)
    want, want_m = simpo_loss(avg[0::2], avg[1::2], beta=2.0, gamma=0.3)
    assert float(loss) == pytest.approx(float(want)) and m["dpo/reward_margin"] == pytest.approx(
        want_m["dpo/reward_margin"])
    loss, m = DPOLoss(kind="orpo", beta=0.2)(mb)
    want, want_m = orpo_loss(avg[0::2], avg[1::2], beta=0.2)
    assert float(loss) == pytest.approx(float(want)) and m["dpo/log_odds_ratio"] == pytest.approx(
        want_m["dpo/log_odds_ratio"])
    assert m["dpo/nll_chosen"] == pytest.approx(float(-avg[0::2].mean()))  # ORPO's NLL term, reported as RPO's
    with pytest.raises(KeyError):  # a kind with a reference needs ref_logp
        DPOLoss(kind="sigmoid")(mb)
    with pytest.raises(ValueError, match="nll_weight must be 0"):
        DPOLoss(kind="orpo", nll_weight=1.0)
    with pytest.raises(ValueError, match="only defined for kind='sigmoid'"):
        DPOLoss(kind="simpo", label_smoothing=0.1)


def test_cpo_takes_each_rows_summed_log_prob_and_no_reference():
    """CPO reads the sums (not SimPO's averages) and no ``ref_logp``; with nll_weight=1 its loss is the paper's
    L_prefer + L_NLL (TRL's default cpo_alpha=1)."""
    from relayrl.algorithms.cpo import cpo_loss

    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(4, 3, generator=g)
    mask = torch.tensor([[1., 1., 1.], [1., 0., 0.], [1., 1., 0.], [1., 1., 1.]])
    mb = MicroBatch(lp, mask, {"pair": torch.tensor([0., 0., 1., 1.]), "chosen": torch.tensor([1., 0., 1., 0.])},
                    global_tokens=9, global_seqs=4)
    seq = (lp * mask).sum(-1)
    fn = DPOLoss(kind="cpo", beta=0.5, label_smoothing=0.1)
    assert fn.reference_free
    loss, m = fn(mb)
    want, want_m = cpo_loss(seq[0::2], seq[1::2], beta=0.5, label_smoothing=0.1)
    assert float(loss) == pytest.approx(float(want)) and m["dpo/reward_margin"] == pytest.approx(
        want_m["dpo/reward_margin"]) and m["dpo/logps_chosen"] == pytest.approx(float(seq[0::2].mean()))
    avg = seq / mask.sum(-1)
    assert float(loss) != pytest.approx(float(cpo_loss(avg[0::2], avg[1::2], beta=0.5, label_smoothing=0.1)[0]),
                                        rel=1e-3)  # not the averages
    full, m_full = DPOLoss(kind="cpo", beta=0.5, nll_weight=1.0)(mb)
    nll = float(-avg[0::2].mean())
    assert float(full) == pytest.approx(float(cpo_loss(seq[0::2], seq[1::2], beta=0.5)[0]) + nll, rel=1e-6)
    assert m_full["dpo/nll_chosen"] == pytest.approx(nll, rel=1e-6)
