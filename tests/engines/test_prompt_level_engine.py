"""Prompt-level aggregation (``loss_agg=prompt-mean-token-mean``, ScaleRL) through the training engine: the
engine fills each row's group token count where the batch is whole, counts the groups over micro-batches and
mini-batches, and a streamed update refuses a group cut across chunks."""

import random

import pytest
import torch

from relayrl.algorithms.aggregation import aggregate
from relayrl.engines.training.base import GROUP_TOKENS_FIELD, OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss

GROUP = 4


class PromptNLL:
    """The negative log-likelihood averaged per prompt, then over prompts: the simplest loss of the mode."""

    normalized_by = "groups"

    def __call__(self, mb):
        loss = aggregate(-mb.logprobs, mb.mask, "prompt-mean-token-mean", group_tokens=mb.fields[GROUP_TOKENS_FIELD],
                         global_groups=mb.global_groups)
        return loss, {"nll/loss": loss.detach()}


def _batch(tok, prompts=4, seed=0):
    """``prompts`` groups of GROUP rows, the rows of the groups interleaved (so micro-batches cut groups), with a
    loss mask: group 1 has no token to train on (every response cut), one row of group 0 is half masked."""
    g = torch.Generator().manual_seed(seed)
    order = list(range(prompts * GROUP))
    random.Random(seed).shuffle(order)
    groups = [i // GROUP for i in order]
    prompt = {k: torch.tensor(tok(f"{k}+{k + 3}=")["input_ids"]) for k in range(prompts)}
    resp = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 12, (len(order),), generator=g)]
    loss_mask = [torch.ones(len(r)) for r in resp]
    for i, k in enumerate(groups):
        if k == 1:
            loss_mask[i].zero_()
    half = groups.index(0)
    loss_mask[half][: len(resp[half]) // 2] = 0
    fields = {"loss_mask": loss_mask, "advantages": [torch.randn(len(r), generator=g) for r in resp]}
    return SequenceBatch([prompt[k] for k in groups], resp, fields, groups=groups)


def _reference(logprobs, batch, rows=None):
    """The prompt-level NLL written out from per-row log-probs: each prompt's token losses over its tokens
    (the whole batch's), summed over the ``rows`` given, over the groups those rows make up."""
    rows = range(len(batch)) if rows is None else rows
    lm = batch.fields["loss_mask"]
    group_tokens = {k: sum(float(lm[i].sum()) for i in range(len(batch)) if batch.groups[i] == k)
                    for k in set(batch.groups)}
    total, groups = 0.0, 0.0
    for i in rows:
        t = group_tokens[batch.groups[i]]
        if t > 0:
            total += float(-(logprobs[i] * lm[i]).sum()) / t
            groups += float(lm[i].sum()) / t
    return total / groups


def _engine(tiny_dir, **cfg):
    from relayrl.models.load import load_model

    torch.manual_seed(0)
    eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(**cfg), total_steps=4)
    grads: list[torch.Tensor] = []
    step = eng.optimizer.step

    def capture(*a, **kw):
        grads.append(torch.cat([p.grad.flatten() for p in eng.model.parameters() if p.grad is not None]))
        return step(*a, **kw)

    eng.optimizer.step = capture
    return eng, grads


def test_micro_batches_cutting_groups_give_the_formula(tiny_dir, tiny_tokenizer):
    """One micro-batch (shared-prompt packing) and many rows-at-a-time micro-batches that cut every group: the
    same loss, the formula's, and the same gradient; the masked group is not counted."""
    batch = _batch(tiny_tokenizer)
    optim = OptimConfig(lr=1e-3, max_grad_norm=None)
    whole, g_whole = _engine(tiny_dir, optim=optim)
    expected = _reference(whole.logprobs(batch)[0], batch)
    m_whole = whole.train_step(batch, PromptNLL())
    cut, g_cut = _engine(tiny_dir, optim=optim, packing="none", token_budget=40)
    assert len(cut._plan(batch)) >= 4
    m_cut = cut.train_step(batch, PromptNLL())
    assert m_whole["nll/loss"] == pytest.approx(expected, rel=1e-5)
    assert m_cut["nll/loss"] == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(g_cut[0], g_whole[0], atol=1e-7, rtol=1e-4)
    assert GROUP_TOKENS_FIELD not in batch.fields  # the engine's own copy carries it


def test_mini_batches_count_their_share_of_each_group(tiny_dir, tiny_tokenizer):
    """Two mini-batches of shuffled rows: each divides by its share of the groups (fractions), its tokens
    weighed by their whole group's count. The learning rate is tiny so both steps see the same log-probs."""
    batch = _batch(tiny_tokenizer, seed=1)
    eng, _ = _engine(tiny_dir, optim=OptimConfig(lr=1e-12, max_grad_norm=None), packing="none", token_budget=40)
    lp = eng.logprobs(batch)[0]
    m = eng.train_step(batch, PromptNLL(), mini_batches=2, generator=torch.Generator().manual_seed(5))
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(5)).tolist()
    half = len(batch) // 2
    per_step = [_reference(lp, batch, perm[:half]), _reference(lp, batch, perm[half:])]
    assert m["nll/loss"] == pytest.approx(sum(per_step) / 2, rel=1e-4)
    assert per_step[0] != pytest.approx(per_step[1])  # the two steps saw different rows


def test_streamed_chunks_of_whole_groups_and_a_split_group_refused(tiny_dir, tiny_tokenizer):
    """PolicyLoss (policy loss, KL term, entropy bonus) streamed in chunks of whole groups equals the whole
    batch's update; a chunk holding a group met in an earlier chunk is refused."""
    batch = _batch(tiny_tokenizer, seed=2)
    batch.fields["ref_logprobs"] = [torch.full((len(r),), -3.0) for r in batch.response_ids]
    loss = PolicyLoss(agg="prompt-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
    assert loss.normalized_by == "groups"
    optim = OptimConfig(lr=1e-3, max_grad_norm=None)
    full, g_full = _engine(tiny_dir, optim=optim, token_budget=64)
    m_full = full.train_step(batch, loss, with_entropy="grad")
    streamed, g_streamed = _engine(tiny_dir, optim=optim, token_budget=64)
    streamed.begin_accumulation()
    for ks in ([2], [0, 3], [1]):
        streamed.accumulate(batch.select([i for i, k in enumerate(batch.groups) if k in ks]), loss,
                            with_entropy="grad")
    m_streamed = streamed.finish_accumulation()
    torch.testing.assert_close(g_streamed[0], g_full[0], atol=1e-7, rtol=1e-4)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/loss", "actor/entropy"):
        assert m_streamed[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-7), k

    streamed.begin_accumulation()
    rows0 = [i for i, k in enumerate(batch.groups) if k == 0]
    streamed.accumulate(batch.select(rows0[:2]), loss)
    with pytest.raises(ValueError, match=r"prompt group\(s\) \[0\] were in an earlier chunk"):
        streamed.accumulate(batch.select(rows0[2:]), loss)


def test_rows_without_groups_are_refused(tiny_dir, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    eng, _ = _engine(tiny_dir)
    with pytest.raises(ValueError, match="needs the rows' prompt groups"):
        eng.train_step(SequenceBatch(batch.prompt_ids, batch.response_ids, batch.fields), PromptNLL())
