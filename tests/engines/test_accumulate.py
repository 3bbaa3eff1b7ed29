"""A streamed update (chunks accumulated as they arrive, one optimizer step at the end) is the update
``train_step`` takes on the whole batch (Periodic Asynchrony §4.3)."""

import random

import pytest
import torch

from relayrl.algorithms.correction import Correction
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.losses import DPOLoss, PolicyLoss, SFTLoss

GROUP = 3


def _batch(tok, prompts=5, seed=0):
    """``prompts`` groups of GROUP rows (shared prompt), with advantages, old/gen/ref log-probs near 0."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * GROUP
    ids = [torch.tensor(tok(f"{i}*{i + 7}=")["input_ids"]) for i in range(prompts) for _ in range(GROUP)]
    resp = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 14, (rows,), generator=g)]

    def near(scale):
        return [-2.0 + scale * torch.randn(len(r), generator=g) for r in resp]

    fields = {"advantages": [torch.randn(len(r), generator=g) for r in resp],
              "old_logprobs": near(0.3), "gen_logprobs": near(0.3), "ref_logprobs": near(0.5)}
    return SequenceBatch(ids, resp, fields, groups=[i // GROUP for i in range(rows)])


def _engine(tiny_dir, budget=64, max_grad_norm=0.05):
    from relayrl.models.load import load_model

    torch.manual_seed(0)
    model = load_model(tiny_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # Adam's first step is lr * g / (|g| + eps): sign-like for |g| >> eps, so float noise in a tiny gradient
    # would flip a whole step; a large eps makes the step a smooth function of the gradient.
    eng = TorchTrainingEngine(model, TrainEngineConfig(token_budget=budget, optim=OptimConfig(
        lr=1e-2, eps=1e-3, max_grad_norm=max_grad_norm)), total_steps=4)
    grads: list[torch.Tensor] = []
    step = eng.optimizer.step

    def capture(*a, **kw):  # the gradients the optimizer steps on (after scaling and clipping)
        grads.extend(p.grad.clone() for p in eng.model.parameters() if p.grad is not None)
        return step(*a, **kw)

    eng.optimizer.step = capture
    return eng, grads


def _chunks(batch, sizes, seed):
    """Prompt groups in a shuffled order, cut into chunks of ``sizes`` groups each."""
    groups = list(range(len(batch) // GROUP))
    random.Random(seed).shuffle(groups)
    out, start = [], 0
    for n in sizes:
        out.append(batch.select([g * GROUP + j for g in groups[start:start + n] for j in range(GROUP)]))
        start += n
    assert start == len(groups)
    return out


def _assert_same_update(a, b, ga, gb, ma, mb, layout_dependent=("actor/forward_tokens",)):
    """Same gradients, weights and metrics; ``layout_dependent`` metrics depend on how rows fall into
    micro-batches (in train_step too): padded tokens, or a nonlinear statistic of each micro-batch."""
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-4)
    for (n, x), (_, y) in zip(a.named_weights(), b.named_weights(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=n)
    assert set(ma) == set(mb)
    for k in ma:
        if k not in layout_dependent:
            assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("loss, with_entropy", [
    (PolicyLoss(agg="token-mean", clip_high=0.28, kl_coef=0.1, entropy_coef=0.01), "grad"),
    (PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1), True),
    (PolicyLoss(agg="seq-mean-token-sum", entropy_coef=0.01), "grad"),
    (PolicyLoss(agg="seq-mean-token-sum-norm", agg_constant=16.0, kl_coef=0.05, dual_clip=3.0), False),
    (PolicyLoss(agg="prompt-mean-token-mean", kl_coef=0.1, entropy_coef=0.01), "grad"),  # chunks of whole groups
    (PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, correction=Correction(high=1.5)), "grad"),  # seq_*
], ids=lambda x: getattr(x, "agg", str(x)))
def test_streamed_chunks_give_the_full_batch_update(tiny_dir, tiny_tokenizer, loss, with_entropy):
    batch = _batch(tiny_tokenizer)
    full, g_full = _engine(tiny_dir)
    m_full = full.train_step(batch, loss, with_entropy=with_entropy)

    chunks = _chunks(batch, [1, 3, 1], seed=1)  # shuffled groups; the middle chunk spans several micro-batches
    assert len(full._plan(chunks[1])) > 1
    streamed, g_streamed = _engine(tiny_dir)
    streamed.begin_accumulation()
    for c in chunks:
        assert streamed.accumulate(c, loss, with_entropy=with_entropy) is None
    m_streamed = streamed.finish_accumulation()

    assert m_full["actor/clip_frac"] > 0 and m_full["actor/grad_norm"] > 0.05  # clipping and clip fractions act
    if loss.kl_coef:
        assert m_full["actor/kl_loss"] > 0
    _assert_same_update(full, streamed, g_full, g_streamed, m_full, m_streamed)
    assert streamed.scheduler.last_epoch == full.scheduler.last_epoch == 1


def test_rows_split_any_way_and_sft(tiny_dir, tiny_tokenizer):
    """Chunks need not follow prompt groups (single rows, an empty chunk), and another loss streams too."""
    batch = _batch(tiny_tokenizer, prompts=3)
    full, g_full = _engine(tiny_dir, max_grad_norm=None)
    m_full = full.train_step(batch, SFTLoss(agg="seq-mean-token-mean"))
    streamed, g_streamed = _engine(tiny_dir, max_grad_norm=None)
    streamed.begin_accumulation()
    order = list(range(len(batch)))
    random.Random(3).shuffle(order)
    for rows in (order[:1], [], order[1:7], order[7:]):
        streamed.accumulate(batch.select(rows), SFTLoss(agg="seq-mean-token-mean"))
    _assert_same_update(full, streamed, g_full, g_streamed, m_full, streamed.finish_accumulation(),
                        layout_dependent=("actor/forward_tokens",))


def test_accumulation_misuse_is_refused(tiny_dir, tiny_tokenizer):
    batch = _batch(tiny_tokenizer, prompts=2)
    eng, _ = _engine(tiny_dir)
    with pytest.raises(RuntimeError, match="begin_accumulation"):
        eng.accumulate(batch, PolicyLoss())
    eng.begin_accumulation()
    with pytest.raises(ValueError, match="normalized_by"):
        eng.accumulate(batch, DPOLoss())
    eng.accumulate(batch, PolicyLoss(agg="token-mean"))
    with pytest.raises(ValueError, match="must share"):
        eng.accumulate(batch, PolicyLoss(agg="seq-mean-token-mean"))  # another normaliser mid-update
    with pytest.raises(RuntimeError, match="finish_accumulation"):
        eng.train_step(batch, PolicyLoss())
    with pytest.raises(RuntimeError, match="finish_accumulation"):
        eng.offload()
    eng.finish_accumulation()
    with pytest.raises(RuntimeError, match="without"):
        eng.finish_accumulation()
    eng.begin_accumulation()
    eng.accumulate(batch.select([]), PolicyLoss())
    with pytest.raises(ValueError, match="no rows"):
        eng.finish_accumulation()
    assert all(p.grad is None for p in eng.model.parameters())


class _PerRank:
    """``group.split`` items that give each rank a chosen chunk (an empty one included)."""

    def __init__(self, parts):
        self.parts = parts

    def split(self, n):
        assert n == len(self.parts)
        return self.parts


@pytest.mark.multiproc
@pytest.mark.parametrize("dp_sync, agg", [("step", "token-mean"), ("pass", "token-mean"),
                                          ("step", "prompt-mean-token-mean")])
def test_two_rank_streamed_tri_model_update_matches_one_rank(tiny_dir, tiny_tokenizer, dp_sync, agg):
    """FSDP2 over 2 gloo ranks, tri-model actor: the ranks get chunks of unequal micro-batch counts, one of
    them empty (padding passes, the reference's included); the counts, gradients and metrics are global.
    Equals one rank's update on the union, its reference log-probs computed in place too; whether the
    parameters are gathered and gradients reduced once per update (``step``) or in every pass (``pass``);
    with prompt-level aggregation the groups (whole on each rank) are counted over ranks."""
    from relayrl.cluster import ResourcePool, WorkerGroup
    from relayrl.workflows.trainer_workers import PolicyWorker

    batch = _batch(tiny_tokenizer, prompts=4)
    del batch.fields["ref_logprobs"]
    kw = dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=40, optim=OptimConfig(
        lr=1e-2, eps=1e-3)), total_steps=2, threads=1, seed=0, tri_model=True)
    loss = PolicyLoss(agg=agg, kl_coef=0.1, entropy_coef=0.01)
    one = PolicyWorker(**kw)
    m1 = one.update(batch, loss, with_entropy="grad")
    calls = [[batch.select(range(3, 9)), batch.select([])],  # rank 0: two groups, rank 1: nothing yet
             [batch.select(range(0, 3)), batch.select(range(9, 12))]]
    assert len(one.engine._plan(calls[0][0])) > 1
    kw["engine"] = kw["engine"].model_copy(update={"dp_sync": dp_sync})
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=kw)
    try:
        for i, parts in enumerate(calls):
            dp.split("accumulate", _PerRank(parts), loss, with_entropy="grad", fresh=i == 0)
        m2 = dp.all("optim_step")
        w2 = dict(dp.all_rank0("named_weights"))
    finally:
        dp.shutdown()
    assert m2[0] == pytest.approx(m2[1])  # every rank reports the global figures
    assert set(m2[0]) == set(m1)
    for k, v in m1.items():
        if k not in ("actor/forward_tokens", "actor/ref_forward_tokens", "actor/ref_forward_passes"):
            assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    for n, t in one.named_weights():
        torch.testing.assert_close(w2[n], t, atol=1e-5, rtol=1e-4, msg=n)
