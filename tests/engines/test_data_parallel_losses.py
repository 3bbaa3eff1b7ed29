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
from tests.engines.dp_workers import grouped_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GROUPS = [(14, 12, 10, 13), (2, 3), (3, 1, 2), (2, 2, 1)]
"""The response lengths of each prompt group's rows: the split puts 4 long rows on rank 0 and 8 short ones on
rank 1."""


def _rows(tok) -> SequenceBatch:
    return grouped_rows(tok, GROUPS, 5, lambda k: f"{k}+{3 * k}=")


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
    # eps: Adam's first steps are sign-like for |g| >> eps, so float noise in a tiny gradient would flip a step
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    return dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=40, optim=optim),
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
                assert type(m2[0]["actor/forward_tokens"]) is int  # (a count on any world size: was a float)
                step += 1
        _same_weights(one.named_weights(), dp.all_rank0(PolicyWorker.named_weights), "policy")
    finally:
        dp.shutdown()


def test_every_policy_loss_with_a_rollout_correction_matches_one_rank(tiny_dir, tiny_tokenizer):
    """Each ``algorithm.policy_loss`` with the rollout correction weighing ``pi_old / mu`` (``gen_logprobs``),
    and PPO at the sequence level (GSPO), each update from the same weights and optimizer state: 2 ranks vs 1.

    Not compared, by design: Clip-Cov and KL-Cov choose their tokens (a fraction of the tokens, at least one,
    by their covariance about the means) within each micro-batch, as the paper's code and verl do, and so does
    ``algorithm.top_entropy_quantile`` by entropy: which tokens are chosen depends on how the rows are cut into
    micro-batches and ranks, on one rank with another ``engine.token_budget`` as on two ranks (KL-Cov here:
    ``actor/cov_frac`` 0.031 on one rank, 0.046 on two)."""
    from relayrl.algorithms.correction import Correction
    from relayrl.algorithms.names import POLICY_LOSS_NAMES

    kw = _kw(tiny_dir, 2)
    one = PolicyWorker(**kw)
    batch = _policy_batch(tiny_tokenizer, one.logprobs(_rows(tiny_tokenizer)))
    g = torch.Generator().manual_seed(10)
    batch.fields["gen_logprobs"] = [x + 0.4 * torch.randn(len(x), generator=g) for x in batch.fields["old_logprobs"]]
    losses = [PolicyLoss(kind=k, agg="seq-mean-token-mean", kl_coef=0.05, correction=Correction(high=1.5))
              for k in POLICY_LOSS_NAMES if k not in ("clip_cov", "kl_cov")]
    losses.append(PolicyLoss(level="sequence", agg="seq-mean-token-mean"))
    start = one.state()
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=kw)
    try:
        for step, loss in enumerate(losses):
            one.load_state(start)  # (chained updates at this learning rate would let float noise grow)
            dp.all(PolicyWorker.load_state, start)
            m1 = one.update(batch, loss, seed=step, with_entropy=True)
            m2 = dp.split(PolicyWorker.update, batch, loss, seed=step, with_entropy=True)
            assert loss.correction is None or m1["correction/token_capped_frac"] > 0, loss.kind
            _same_metrics(m1, m2, f"{loss.kind}, level={loss.level}")
            _same_weights(one.named_weights(), dp.all_rank0(PolicyWorker.named_weights), loss.kind)
    finally:
        dp.shutdown()


def test_critic_value_loss_matches_one_rank(tiny_dir, tiny_tokenizer):
    """PPO's critic (the clipped value loss against GAE returns, its explained variance from summed terms): one
    mini-batch, then two, on 2 ranks vs 1."""
    kw = _kw(tiny_dir, 2)
    one = CriticWorker(**kw)
    batch = _rows(tiny_tokenizer)
    _unequal(batch)
    g = torch.Generator().manual_seed(7)
    values = one.values(batch)
    batch.fields.update(values=[v + 0.3 * torch.randn(len(v), generator=g) for v in values],
                        returns=[torch.randn(len(v), generator=g) for v in values])
    dp = WorkerGroup(CriticWorker, ResourcePool("critic", devices=2), "critic", backend="local", init_kwargs=kw)
    try:
        for a, b in zip(values, dp.split(CriticWorker.values, batch)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
        for mini_batches in (1, 2):
            loss = ValueLoss(clip=0.2)
            m1 = one.update(batch, loss, mini_batches=mini_batches, seed=mini_batches)
            m2 = dp.split(CriticWorker.update, batch, loss, mini_batches=mini_batches, seed=mini_batches)
            assert 0 < m1["critic/vf_clip_frac"] < 1 and "critic/explained_variance" in m1
            _same_metrics(m1, m2, f"critic, mini_batches={mini_batches}")
        _same_weights(one.engine.model.named_parameters(),
                      ((n, t) for n, t in dp.all_rank0(CriticWorker.state)["model"].items()), "critic")
    finally:
        dp.shutdown()


PAIRS = [(9, 6), (2, 3), (11, 12), (1, 2), (4, 3)]
"""(chosen, rejected) answer lengths of each pair: the split puts 2 pairs on one rank and 3 on the other."""


def _pairs(tok) -> SequenceBatch:
    g = torch.Generator().manual_seed(8)
    prompts, responses = [], []
    for k, lengths in enumerate(PAIRS):
        p = torch.tensor(tok(f"{k}+{k + 4}=")["input_ids"])
        for n in lengths:
            prompts.append(p)
            responses.append(torch.randint(5, 200, (n,), generator=g))
    n = len(PAIRS)
    return SequenceBatch(prompts, responses, {"pair": [float(i // 2) for i in range(2 * n)], "chosen": [1.0, 0.0] * n},
                         groups=[i // 2 for i in range(2 * n)])


def test_dpo_and_sft_match_one_rank(tiny_dir, tiny_tokenizer):
    """DPO (the reference and the reference-free kinds, with an NLL term) keeps each (chosen, rejected) pair on
    one rank and normalises by the pairs of the whole batch; SFT's token and sequence means, with a loss mask,
    likewise."""
    from relayrl.engines.training.base import LOSS_MASK_FIELD

    kw = _kw(tiny_dir, 8)
    one = PolicyWorker(**kw)
    batch = _pairs(tiny_tokenizer)
    parts = batch.split(2)
    assert sorted(len(p) for p in parts) == [4, 6]
    for p in parts:  # every pair whole on its rank
        assert p.fields["pair"][0::2] == p.fields["pair"][1::2] and p.fields["chosen"][0::2] == [1.0] * (len(p) // 2)
    g = torch.Generator().manual_seed(9)
    batch.fields["ref_logp"] = [(x.sum() + torch.randn((), generator=g)).detach() for x in one.logprobs(batch)]
    sft = _rows(tiny_tokenizer)
    sft = SequenceBatch(sft.prompt_ids, sft.response_ids,
                        {LOSS_MASK_FIELD: [(torch.rand(len(r), generator=g) > 0.3).float() for r in sft.response_ids]})
    _unequal(sft)
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=kw)
    try:
        losses = [DPOLoss(beta=0.2, kind="sigmoid", label_smoothing=0.1, nll_weight=0.5), DPOLoss(kind="ipo"),
                  DPOLoss(kind="simpo", nll_weight=0.3), DPOLoss(kind="orpo"), DPOLoss(kind="cpo", nll_weight=1.0)]
        for step, loss in enumerate(losses):
            m1 = one.update(batch, loss, seed=step)
            m2 = dp.split(PolicyWorker.update, batch, loss, seed=step)
            assert m1["dpo/loss"] > 0 and m1["dpo/nll_chosen"] > 0
            _same_metrics(m1, m2, f"dpo {loss.kind}")
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            m1 = one.update(sft, SFTLoss(agg=agg))
            m2 = dp.split(PolicyWorker.update, sft, SFTLoss(agg=agg))
            assert m1["sft/loss"] > 0 and "sft/ppl" in m1
            _same_metrics(m1, m2, f"sft {agg}")
        _same_weights(one.named_weights(), dp.all_rank0(PolicyWorker.named_weights), "dpo and sft")
    finally:
        dp.shutdown()


def test_a_rank_without_rows_joins_the_forward_passes(tiny_dir, tiny_tokenizer):
    """A streamed stage hands a chunk of fewer prompt groups than ranks (one group, ``trainer.stream_groups=1``,
    with the rollout on a pool of its own): a rank gets no rows. It joins the busiest rank's passes (FSDP2's
    gathers are collective) and writes nothing; before, the reference's, the actor's and the critic's
    ``forward_into`` called ``write`` on the missing slots (every ``cluster.devices=2`` run with
    ``placement.rollout`` on another pool failed at its first reference pass)."""
    from tests.engines.dp_workers import EchoSlots, RowsReader
    from relayrl.workflows.trainer_workers import ReferenceWorker

    rows = _rows(tiny_tokenizer).select(range(4))  # one prompt group
    cols = {"prompt_ids": rows.prompt_ids, "response_ids": rows.response_ids, "group": rows.groups}
    items = [(RowsReader(cols), EchoSlots()), (None, None)]
    kw = dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=24), threads=1)
    train = {**kw, "total_steps": 1}
    for cls, kwargs, args in [(ReferenceWorker, kw, ("ref_logprobs",)),
                              (PolicyWorker, train, ("old_logprobs", 1.0, "sum_sq")),
                              (CriticWorker, train, ("values",))]:
        want = cls(**kwargs).forward_into([items[0]], *args)
        group = WorkerGroup(cls, ResourcePool("g", devices=2), "g", backend="local", init_kwargs=kwargs)
        try:
            got = group.split(cls.forward_into, items, *args)
        finally:
            group.shutdown()
        assert len(got) == 1 and set(got[0]) == set(want[0]), cls.__name__  # rank 1 wrote nothing
        for k, v in want[0].items():
            for a, b in zip(v, got[0][k]):
                torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{cls.__name__}: {k}")


def test_mini_batches_need_rows_in_the_batch_not_on_every_rank(tiny_dir, tiny_tokenizer):
    """The mini-batches are cut from every rank's rows together, so each needs a row of the whole batch: rank 1
    holding 2 rows takes 4 mini-batches with rank 0's 4 (a mini-batch may hold none of its rows: it joins the
    passes on a one-token row), and a rank given no rows takes the one-mini-batch update with the other; both
    equal one rank's. Before, every rank refused ``mini_batches`` past the fewest rows a rank held, and an
    empty rank refused the call alone, the other left waiting in a collective."""
    from tests.engines.dp_workers import dock_items

    fields = ["advantages", "old_logprobs", "ref_logprobs"]
    one = PolicyWorker(**_kw(tiny_dir, 2))
    rows = _policy_batch(tiny_tokenizer, one.logprobs(_rows(tiny_tokenizer))).select(range(6))  # groups 0 and 1
    dp = WorkerGroup(PolicyWorker, ResourcePool("dp", devices=2), "actor", backend="local", init_kwargs=_kw(tiny_dir, 2))
    try:
        for step, (shares, mini_batches) in enumerate([([range(0, 4), range(4, 6)], 4), ([range(0, 6), None], 1)]):
            loss = PolicyLoss(agg="token-mean", kl_coef=0.1, entropy_coef=0.01)
            opt = dict(mini_batches=mini_batches, seed=step, with_entropy=True)
            m1 = one.update(rows, loss, **opt)
            m2 = dp.split(PolicyWorker.train_batch, dock_items(rows, shares, fields), loss, fields, **opt)
            _same_metrics(m1, m2, f"mini_batches={mini_batches}")
        _same_weights(one.named_weights(), dp.all_rank0(PolicyWorker.named_weights), "policy")
    finally:
        dp.shutdown()
