"""Tri-model actor (Periodic Asynchrony §4.1): the reference runs inside the actor's micro-steps and gives what a
separate reference worker gives."""

import pytest
import torch

from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.weights import offload as swap
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import PolicyWorker, ReferenceWorker


def _batch(tok, prompts=4, group=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = prompts * group
    ids = [torch.tensor(tok(f"{i}-{i + 5}=")["input_ids"]) for i in range(prompts) for _ in range(group)]
    resp = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 14, (rows,), generator=g)]
    return SequenceBatch(ids, resp, {"advantages": [torch.randn(len(r), generator=g) for r in resp]},
                         groups=[i // group for i in range(rows)])


def _with(batch, **fields):
    return SequenceBatch(batch.prompt_ids, batch.response_ids, {**batch.fields, **fields}, batch.groups)


def _kw(tiny_dir, **over):
    # eps: Adam's first steps are sign-like for |g| >> eps, so float noise in a tiny gradient would flip a step
    return dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=48, optim=OptimConfig(
        lr=1e-2, eps=1e-3)), total_steps=4, threads=1, seed=0, **over)


def _close(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **tol)


LOSS = PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3")


@pytest.mark.slow  # (about 1.1 s; the fast set keeps the rest of this file, `make test` runs it)
def test_tri_model_update_and_stream_equal_a_separate_reference(tiny_dir, tiny_tokenizer):
    """An update whose reference log-probs come from the actor's own micro-steps equals one whose batch
    carries them from a ReferenceWorker; so does a streamed update; and the reference follows offload."""
    tri = PolicyWorker(**_kw(tiny_dir), tri_model=True)
    two = PolicyWorker(**_kw(tiny_dir))
    ref = ReferenceWorker(str(tiny_dir), _kw(tiny_dir)["engine"], threads=1)
    first, second = _batch(tiny_tokenizer), _batch(tiny_tokenizer, seed=1)

    m_tri = tri.update(first, LOSS)
    m_two = two.update(_with(first, ref_logprobs=ref.logprobs(first)), LOSS)
    assert m_tri["actor/ref_forward_passes"] == len(tri.engine._plan(first)) > 1
    assert m_tri["actor/ref_forward_tokens"] == m_tri["actor/forward_tokens"]
    assert "actor/ref_forward_passes" not in m_two
    for k, v in m_two.items():
        assert m_tri[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    _close([t for _, t in tri.named_weights()], [t for _, t in two.named_weights()], atol=1e-6, rtol=1e-5)

    assert tri.offload() > 0 and swap.is_offloaded(tri.engine.reference_model)
    tri.reload()
    assert not swap.is_offloaded(tri.engine.reference_model)

    for i, rows in enumerate((range(6, 12), range(0, 6))):  # the second step streamed, in two chunks
        tri.accumulate(second.select(rows), LOSS, fresh=i == 0)
    m_tri = tri.optim_step()
    m_two = two.update(_with(second, ref_logprobs=ref.logprobs(second)), LOSS)
    assert m_tri["actor/ref_forward_passes"] >= 2
    for k, v in m_two.items():
        if k != "actor/forward_tokens":
            assert m_tri[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    _close([t for _, t in tri.named_weights()], [t for _, t in two.named_weights()], atol=1e-6, rtol=1e-5)

    # After two steps the policy has left the reference; one micro-step per micro-batch gives both.
    policy, reference = tri.logprobs(second, with_reference=True)
    _close(policy, tri.logprobs(second), atol=1e-6, rtol=1e-5)
    _close(reference, ref.logprobs(second), atol=1e-6, rtol=1e-5)
    assert max(float((p - r).abs().max()) for p, r in zip(policy, reference)) > 1e-3


@pytest.mark.slow  # (about 0.7 s; the fast set keeps the rest of this file, `make test` runs it)
def test_tri_model_bf16_reference_matches_a_bf16_reference_worker(tiny_dir, tiny_tokenizer):
    """Mixed precision: the actor's float32 master weights compute in bf16; its reference copy holds bf16
    weights, as a ReferenceWorker of the frozen role does, and gives the same log-probs."""
    batch = _batch(tiny_tokenizer)
    tri = PolicyWorker(**_kw(tiny_dir, compute_dtype="bfloat16"), tri_model=True)
    assert next(tri.engine.model.parameters()).dtype == torch.float32
    assert next(tri.engine.reference_model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in tri.engine.reference_model.parameters())
    ref = ReferenceWorker(str(tiny_dir), _kw(tiny_dir)["engine"], dtype="bfloat16", threads=1)
    policy, reference = tri.logprobs(batch, with_reference=True)
    _close(reference, ref.logprobs(batch), atol=0, rtol=0)
    _close(policy, tri.logprobs(batch), atol=0, rtol=0)
    m = tri.update(batch, LOSS)
    assert m["actor/nonfinite_grad"] == 0.0 and m["actor/ref_forward_passes"] > 0


@pytest.mark.slow  # (over half a second; the full make test runs it)
def test_a_batch_that_carries_reference_logprobs_is_not_recomputed(tiny_dir, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    tri = PolicyWorker(**_kw(tiny_dir), tri_model=True)
    old, reference = tri.logprobs(batch, with_reference=True)  # e.g. before several updates per batch
    m = tri.update(_with(batch, old_logprobs=old, ref_logprobs=reference), LOSS, mini_batches=2, epochs=2)
    assert "actor/ref_forward_passes" not in m
    with pytest.raises(ValueError, match="drop one"):
        tri.engine.train_step(_with(batch, ref_logprobs=reference), LOSS, with_reference=True)
    with pytest.raises(RuntimeError, match="without a reference"):
        PolicyWorker(**_kw(tiny_dir)).logprobs(batch, with_reference=True)


@pytest.mark.slow  # (about a second)
def test_pass_counters_are_ints_summed_over_the_steps_in_both_updates(tiny_dir, tiny_tokenizer):
    """``actor/ref_forward_passes`` was a token-weighted mean over an update's optimizer steps (a float, and in
    two mini-batches not the passes run) while the streamed update gave the int count. Both now sum the
    counters over the steps, as ints."""
    from relayrl.engines.training.steps import minibatch_rows, minibatch_slices

    batch = _batch(tiny_tokenizer)
    tri = PolicyWorker(**_kw(tiny_dir), tri_model=True)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(3)).tolist()
    passes = sum(len(tri.engine._plan(batch.select(minibatch_rows(perm, rows, 0, len(batch)))))
                 for rows in minibatch_slices(len(batch), 2))
    sync = tri.update(batch, LOSS, mini_batches=2, seed=3)
    tri.accumulate(batch, LOSS, fresh=True)
    streamed = tri.optim_step()
    assert sync["actor/ref_forward_passes"] == passes
    assert streamed["actor/ref_forward_passes"] == len(tri.engine._plan(batch))
    for m in (sync, streamed):
        for k in ("actor/ref_forward_passes", "actor/ref_forward_tokens", "actor/forward_tokens"):
            assert type(m[k]) is int, k
