"""Environment-written tokens are context: never trained on, never counted, skipped by GAE."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.schema import AlgorithmConfig
from relayrl.engines.training.base import LOSS_MASK_FIELD, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.estimate import advantage_rows
from relayrl.workflows.losses import PolicyLoss, SFTLoss


def _batch(with_mask: bool) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (4,), generator=g) for _ in range(3)]
    responses = [torch.randint(5, 100, (n,), generator=g) for n in (6, 5, 7)]
    masks = [torch.tensor(m, dtype=torch.float32) for m in ([1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 1])]
    fields = {LOSS_MASK_FIELD: masks} if with_mask else {}
    return SequenceBatch(prompts, responses, fields)


def test_num_tokens_counts_model_tokens_only():
    assert _batch(True).num_tokens == 4 + 3 + 4 and _batch(False).num_tokens == 18


class Spy:
    """A token-mean SFT loss that records what the engine handed it."""

    normalized_by = "tokens"

    def __init__(self) -> None:
        self.seen = []

    def __call__(self, mb):
        self.seen.append((mb.mask.clone(), mb.global_tokens))
        return SFTLoss()(mb)


@pytest.mark.parametrize("packing", ["none", "shared_prompt"])
def test_the_loss_sees_the_loss_mask_and_its_token_count(tiny_model, packing):
    engine = TorchTrainingEngine(tiny_model, TrainEngineConfig(packing=packing), total_steps=1)
    batch = _batch(True)
    lp, _ = engine.logprobs(batch)
    spy = Spy()
    metrics = engine.train_step(batch, spy, mini_batches=1)
    mask, tokens = spy.seen[0]
    assert tokens == 11
    assert sorted(mask.sum(-1).tolist()) == [3.0, 4.0, 4.0]
    # token-mean NLL over the model's tokens only, computed by hand from the log-probs before the step
    by_hand = -sum(float((l * m).sum()) for l, m in zip(lp, batch.fields[LOSS_MASK_FIELD])) / 11
    assert metrics["sft/loss"] == pytest.approx(by_hand, rel=1e-4)


def test_masked_tokens_get_no_gradient(tiny_model):
    """Changing the environment's tokens' advantages (or their targets) does not change the update."""
    import copy

    grads = []
    for adv_env in (0.0, 123.0):
        model = copy.deepcopy(tiny_model)
        engine = TorchTrainingEngine(model, TrainEngineConfig(packing="none"), total_steps=1)
        batch = _batch(True)
        adv = [torch.where(m > 0, torch.ones_like(m), torch.full_like(m, adv_env)) for m in batch.fields[LOSS_MASK_FIELD]]
        batch.fields["advantages"] = adv
        engine.runner.train()
        loss_fn = PolicyLoss(agg="token-mean")
        engine._backward(batch, loss_fn, 1.0, False, False, (batch.num_tokens, len(batch), 0.0),
                         __import__("relayrl.engines.training.accumulate", fromlist=["MetricSums"]).MetricSums((), False))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1])


def test_gae_skips_environment_tokens():
    """gamma=0.5, lam=1: the return of a model token is discounted once per *model* token to the end."""
    a = AlgorithmConfig(advantage="gae", gamma=0.5, lam=1.0)
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    values = [torch.zeros(5)]
    out, _ = advantage_rows(a, torch.tensor([1.0]), [5], torch.tensor([0]), values=values, loss_masks=[mask])
    assert out["returns"][0].tolist() == pytest.approx([0.25, 0.5, 0.0, 0.0, 1.0])
    assert out["advantages"][0][2:4].tolist() == [0.0, 0.0]
    # the same as GAE on the squeezed row
    ref, _ = advantage_rows(a, torch.tensor([1.0]), [3], torch.tensor([0]), values=[torch.zeros(3)])
    assert out["returns"][0][mask.bool()].tolist() == pytest.approx(ref["returns"][0].tolist())


def test_group_advantages_are_per_model_token():
    a = AlgorithmConfig(advantage="grpo")
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])]
    out, _ = advantage_rows(a, torch.tensor([1.0, 0.0]), [3, 4], torch.tensor([0, 0]), loss_masks=masks)
    assert out["advantages"][0][1] == 0 and out["advantages"][1][2:].tolist() == [0.0, 0.0]
    assert out["advantages"][0][0] > 0 > out["advantages"][1][0]
    with pytest.raises(ValueError, match="loss mask"):
        advantage_rows(a, torch.tensor([1.0, 0.0]), [3, 5], torch.tensor([0, 0]), loss_masks=masks)


def test_a_row_with_no_model_token_is_no_sequence_to_a_seq_mean_loss(tiny_model):
    """A row whose loss_mask is all 0 (the model sampled none of its tokens) counts toward neither the token
    nor the sequence count the engine hands the loss, as ``aggregate`` itself counts a fully masked row."""

    class SeqSpy(Spy):
        normalized_by = "seqs"

        def __call__(self, mb):
            self.seen.append((mb.mask.clone(), mb.global_seqs))
            return SFTLoss()(mb)

    batch = _batch(True)
    batch.fields[LOSS_MASK_FIELD][1] = torch.zeros(5)
    spy = SeqSpy()
    TorchTrainingEngine(tiny_model, TrainEngineConfig(), total_steps=1).train_step(batch, spy, mini_batches=1)
    assert batch.num_seqs == 2 and spy.seen[0][1] == 2
