"""Sequence parallelism inside data parallelism: 4 ranks, 2 Ulysses groups of 2 (``engine.sequence_parallel=2``
on ``cluster.devices=4``), compute what one rank computes. FSDP2 shards over all 4 ranks, the all-to-alls run
within each SP group, the gradients of the 4 ranks add up to the batch's, and the loss's normaliser and the
metrics count each SP group's pooled rows once (its first rank's figures).

The driver's split gives the 4 ranks unequal rows and tokens (so the two SP groups pool unequal batches: a
normaliser counted per rank, or once per SP rank, shows as another loss, gradient norm and weights), the packed
rows have odd lengths (padded to a multiple of 2) and the token budget makes several micro-batches (the groups
run unequal numbers of passes). Tolerances as in test_sequence_parallel.py and test_data_parallel_losses.py."""

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss, ValueLoss
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker
from tests.engines.dp_workers import dock_items, grouped_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GROUPS = [(9, 7, 8, 6), (2, 3), (4, 1, 2), (1, 2, 2)]
"""The response lengths of each prompt group's rows: the 4-way split gives the ranks 4, 2, 3 and 3 rows (30, 5, 7 and 5
tokens), the SP groups 35 and 12 tokens."""


def _rows(tok) -> SequenceBatch:
    return grouped_rows(tok, GROUPS, 3, lambda k: f"{k}+{2 * k + 1}=")


def _kw(tiny_dir, sp: int = 1) -> dict:
    # eps: Adam's first steps are sign-like for |g| >> eps, so float noise in a tiny gradient would flip a step
    engine = TrainEngineConfig(token_budget=24, sequence_parallel=sp, optim=OptimConfig(lr=1e-2, eps=1e-3))
    return dict(model_path=str(tiny_dir), engine=engine, total_steps=2, threads=1, seed=0)


def _grid(cls, tiny_dir, **extra) -> WorkerGroup:
    return WorkerGroup(cls, ResourcePool("spdp", devices=4), "g", backend="local",
                       init_kwargs={**_kw(tiny_dir, sp=2), **extra})


def _close(got, want, what: str, atol=2e-5, rtol=1e-4) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=f"{what}: row {i}")


def _same_metrics(m1: dict, m4: list[dict], what: str, padding: float | None = 1.25) -> None:
    """``padding``: the most ``forward_tokens`` may exceed one rank's (None: not compared; the SP groups pack
    their own rows, into other packed rows than one rank's)."""
    for m in m4[1:]:  # every rank reports the global figures
        assert m == pytest.approx(m4[0], nan_ok=True), what
    assert set(m4[0]) == set(m1), what
    for k, v in m1.items():
        if k.endswith("forward_tokens"):  # each packed row padded to a multiple of 2: at most 1 token more each
            assert padding is None or v <= m4[0][k] < padding * v, f"{what}: {k}"
        elif k.endswith("forward_passes"):  # (the reference's passes: each SP group runs its own micro-batches)
            assert m4[0][k] >= 1, f"{what}: {k}"
        else:
            assert m4[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), f"{what}: {k}"


def test_two_sp_groups_of_two_match_one_rank(tiny_dir, tiny_tokenizer):
    """A tri-model actor (the reference in the actor, KL on): its policy and reference log-probs, then two
    updates of 2 mini-batches each (token-mean, then seq-mean-token-mean; PPO-clip with a k3 KL term and an
    entropy bonus), each update's metrics, the weights after them and the log-probs they give."""
    batch = _rows(tiny_tokenizer)
    parts = batch.split(4)
    pooled = [parts[0].num_tokens + parts[1].num_tokens, parts[2].num_tokens + parts[3].num_tokens]
    assert len({len(p) for p in parts}) > 1 and pooled[0] != pooled[1]  # unequal ranks and SP groups
    one = PolicyWorker(**_kw(tiny_dir), tri_model=True)
    lp, ref = one.logprobs(batch, with_reference=True)
    g = torch.Generator().manual_seed(4)
    noise = [0.3 * torch.randn(len(x), generator=g) for x in lp]
    batch.fields.update(advantages=[torch.randn(len(x), generator=g) for x in lp],
                        old_logprobs=[x + e for x, e in zip(lp, noise)])
    grid = _grid(PolicyWorker, tiny_dir, tri_model=True)
    try:
        got = grid.split(PolicyWorker.logprobs, batch, with_reference=True)
        _close([t for pair in got for t in pair[0]], lp, "policy log-probs", 1e-5, 1e-5)
        _close([t for pair in got for t in pair[1]], ref, "reference log-probs", 1e-5, 1e-5)
        for step, agg in enumerate(("token-mean", "seq-mean-token-mean")):
            loss = PolicyLoss(agg=agg, kl_coef=0.1, entropy_coef=0.01, clip_high=0.28)
            opt = dict(mini_batches=2, seed=step, with_entropy="grad")
            m1 = one.update(batch, loss, **opt)
            m4 = grid.split(PolicyWorker.update, batch, loss, **opt)
            assert m1["actor/clip_frac_high"] + m1["actor/clip_frac_low"] > 0, agg
            assert step == 0 or m1["actor/kl_loss"] > 0  # (the reference is the initial policy)
            _same_metrics(m1, m4, agg)
        w1 = dict(one.named_weights())
        w4 = dict(grid.all_rank0(PolicyWorker.named_weights))
        assert set(w1) == set(w4)
        for n, t in w1.items():
            torch.testing.assert_close(w4[n], t, atol=2e-4, rtol=1e-3, msg=n)  # (Adam amplifies rounding)
        got = grid.split(PolicyWorker.logprobs, batch, with_reference=True)
        lp, ref = one.logprobs(batch, with_reference=True)
        _close([t for pair in got for t in pair[0]], lp, "policy log-probs after the updates")
        _close([t for pair in got for t in pair[1]], ref, "reference log-probs after the updates", 1e-5, 1e-5)
    finally:
        grid.shutdown()


def test_critic_on_two_sp_groups_of_two_matches_one_rank(tiny_dir, tiny_tokenizer):
    """PPO's critic: its values, then one update of 2 mini-batches (the clipped value loss, its explained
    variance), and its values after it."""
    batch = _rows(tiny_tokenizer)
    one = CriticWorker(**_kw(tiny_dir))
    values = one.values(batch)
    g = torch.Generator().manual_seed(7)
    batch.fields.update(values=[v + 0.3 * torch.randn(len(v), generator=g) for v in values],
                        returns=[torch.randn(len(v), generator=g) for v in values])
    grid = _grid(CriticWorker, tiny_dir)
    try:
        _close(grid.split(CriticWorker.values, batch), values, "values", 1e-5, 1e-5)
        m1 = one.update(batch, ValueLoss(clip=0.2), mini_batches=2, seed=1)
        m4 = grid.split(CriticWorker.update, batch, ValueLoss(clip=0.2), mini_batches=2, seed=1)
        assert 0 < m1["critic/vf_clip_frac"] < 1 and "critic/explained_variance" in m1
        _same_metrics(m1, m4, "critic")
        _close(grid.split(CriticWorker.values, batch), one.values(batch), "values after the update")
    finally:
        grid.shutdown()


def policy_rows(tok, rows: SequenceBatch, one: PolicyWorker) -> SequenceBatch:
    """``rows`` with advantages, pi_old and reference log-probs off ``one``'s (ratios clip, the KL is not 0)."""
    lp = one.logprobs(rows)
    g = torch.Generator().manual_seed(6)
    noise = [0.3 * torch.randn(len(x), generator=g) for x in lp]
    rows.fields.update(advantages=[torch.randn(len(x), generator=g) for x in lp],
                       old_logprobs=[x + e for x, e in zip(lp, noise)],
                       ref_logprobs=[x - 0.5 * e.abs() for x, e in zip(lp, noise)])
    return rows


def test_an_sp_group_without_rows_and_more_mini_batches_than_a_rank_holds(tiny_dir, tiny_tokenizer):
    """The mini-batches are cut from the whole batch (every replica's rows, numbered in replica order), so what
    they need is a row each in the whole batch, not ``mini_batches`` rows on every replica: here the driver gives
    SP group 1 (ranks 2 and 3) no rows, as a step of fewer prompt groups than replicas does, and group 0 six; 1
    then 3 mini-batches equal one rank's updates on the six rows (the empty group joins every pass and the
    reductions on a one-token row). Before, the empty ranks refused the call alone (``train_step got an empty
    batch``, raised before the collective in which the others were deciding), and any ``mini_batches`` past the
    fewest rows a replica held was refused."""
    fields = ["advantages", "old_logprobs", "ref_logprobs"]
    one = PolicyWorker(**_kw(tiny_dir))
    rows = policy_rows(tiny_tokenizer, _rows(tiny_tokenizer).select(range(6)), one)  # groups 0 and 1
    items = dock_items(rows, [range(0, 4), range(4, 6), None, None], fields)
    grid = _grid(PolicyWorker, tiny_dir)
    try:
        for step, mini_batches in enumerate((1, 3)):
            loss = PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
            opt = dict(mini_batches=mini_batches, seed=step, with_entropy=True)
            m1 = one.update(rows, loss, **opt)
            m4 = grid.split(PolicyWorker.train_batch, items, loss, fields, **opt)
            _same_metrics(m1, m4, f"mini_batches={mini_batches}")
        w4 = dict(grid.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w4[n], t, atol=2e-4, rtol=1e-3, msg=n)
        with pytest.raises(Exception, match=r"mini_batches=7 must be in \[1, 6\] \(rows in the batch over every "
                                             r"data-parallel replica\)"):  # every rank refuses, none waits
            grid.split(PolicyWorker.train_batch, items, loss, fields, mini_batches=7)
    finally:
        grid.shutdown()


@pytest.mark.parametrize("dp_sync", ["pass", "step"])
def test_streamed_update_over_two_sp_groups_matches_one_rank(tiny_dir, tiny_tokenizer, dp_sync):
    """Periodic asynchrony's chunks (``forward_backward`` per finished chunk, then ``optim_step``) on 4 ranks as
    2 SP groups: each chunk leaves one SP group without rows (a chunk of fewer prompt groups than replicas), with
    the gradients reduced every pass or once at the step; the update equals one rank's on the whole batch."""
    fields = ["advantages", "old_logprobs", "ref_logprobs"]
    kw = _kw(tiny_dir)
    kw["engine"] = kw["engine"].model_copy(update={"dp_sync": dp_sync})
    one = PolicyWorker(**kw)
    rows = policy_rows(tiny_tokenizer, _rows(tiny_tokenizer), one)
    loss = PolicyLoss(agg="token-mean", kl_coef=0.1, entropy_coef=0.01)
    m1 = one.update(rows, loss, seed=0, with_entropy=True)
    grid = _grid(PolicyWorker, tiny_dir, engine=kw["engine"].model_copy(update={"sequence_parallel": 2}))
    try:
        chunks = [[range(0, 4), range(4, 6), None, None], [None, None, range(6, 9), range(9, 12)]]
        for k, shares in enumerate(chunks):
            grid.split(PolicyWorker.forward_backward, dock_items(rows, shares, fields), loss, fields, fresh=k == 0,
                       with_entropy=True)
        _same_metrics(m1, grid.all(PolicyWorker.optim_step), f"streamed, dp_sync={dp_sync}")
        w4 = dict(grid.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w4[n], t, atol=2e-4, rtol=1e-3, msg=n)
    finally:
        grid.shutdown()


def test_dpo_and_sft_on_two_sp_groups_of_two_match_one_rank(tiny_dir, tiny_tokenizer):
    """DPO (sigmoid, with an NLL term over ``global_seqs // 2`` chosen answers) with every (chosen, rejected) pair
    whole in its SP group, then SFT's token mean under a loss mask: each update's metrics and the weights."""
    from relayrl.engines.training.base import LOSS_MASK_FIELD
    from relayrl.workflows.losses import DPOLoss, SFTLoss
    from tests.engines.test_data_parallel_losses import _pairs

    kw = _kw(tiny_dir)
    kw["engine"] = kw["engine"].model_copy(update={"token_budget": 64})  # (a pair stays in one micro-batch)
    one = PolicyWorker(**kw)
    pairs = _pairs(tiny_tokenizer)
    g = torch.Generator().manual_seed(9)
    pairs.fields["ref_logp"] = [(x.sum() + torch.randn((), generator=g)).detach() for x in one.logprobs(pairs)]
    sft = _rows(tiny_tokenizer)
    sft = SequenceBatch(sft.prompt_ids, sft.response_ids,
                        {LOSS_MASK_FIELD: [(torch.rand(len(r), generator=g) > 0.3).float() for r in sft.response_ids]})
    grid = _grid(PolicyWorker, tiny_dir, engine=kw["engine"].model_copy(update={"sequence_parallel": 2}))
    try:
        for loss, batch in [(DPOLoss(beta=0.2, kind="sigmoid", nll_weight=0.5), pairs), (SFTLoss(agg="token-mean"), sft)]:
            m1 = one.update(batch, loss, seed=0)
            m4 = grid.split(PolicyWorker.update, batch, loss, seed=0)
            _same_metrics(m1, m4, type(loss).__name__, padding=None)
        w4 = dict(grid.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w4[n], t, atol=2e-4, rtol=1e-3, msg=n)
    finally:
        grid.shutdown()
