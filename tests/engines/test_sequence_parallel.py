"""Ulysses sequence parallelism (engine.sequence_parallel): two SP ranks compute what one rank computes.

Tolerances: float32 throughout. Sequence parallelism changes no formula, only where each token's
activations are computed and the order of a few sums (attention over heads split across ranks, the
gradient of a weight summed over two ranks' tokens by FSDP2's reduce-scatter instead of in one matrix
product), so the log-probs and the loss agree to float32 rounding (~1e-6 relative); the weights after an
Adam step agree to 2e-4 as in test_data_parallel.py (Adam divides by sqrt(v), which amplifies rounding in
near-zero gradients)."""

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.workers import CriticWorker, PolicyWorker, collective


def _batch(tok, rows=12, long_row=0):
    """Groups of 3 rows sharing a prompt, responses of 2..11 tokens; ``long_row`` makes row 0 that long."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.tensor(tok(f"{i}+{2 * i}=")["input_ids"]) for i in range(rows // 3) for _ in range(3)]
    responses = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 12, (rows,), generator=g)]
    if long_row:
        responses[0] = torch.randint(5, 200, (long_row,), generator=g)
    adv = [torch.randn(len(r), generator=g) for r in responses]
    return SequenceBatch(prompts, responses, {"advantages": adv}, groups=[i // 3 for i in range(rows)])


def _group(cls, kw, devices=2):
    return WorkerGroup(cls, ResourcePool("sp", devices=devices), "actor", backend="local", init_kwargs=kw)


@pytest.mark.multiproc
@pytest.mark.parametrize("packing", ["shared_prompt", "sequences"])
def test_two_sp_ranks_match_one_rank(tiny_dir, tiny_tokenizer, packing):
    """sp=2, dp=1: log-probs before and after two updates, the update's metrics (loss, grad norm) and the
    weights equal one rank's. Packed rows hold several units, so unit (and response) boundaries fall on both
    sides of the shard boundary; a small token budget gives several micro-batches; the packed lengths are odd
    (padded to a multiple of 2)."""
    batch = _batch(tiny_tokenizer, long_row=40)
    engine = dict(token_budget=96, packing=packing, optim=OptimConfig(lr=1e-2))
    kw = dict(model_path=str(tiny_dir), total_steps=4, threads=1, seed=0)
    loss = PolicyLoss(agg="token-mean", kl_coef=0.0)
    one = PolicyWorker(**kw, engine=TrainEngineConfig(**engine))
    sp = _group(PolicyWorker, {**kw, "engine": TrainEngineConfig(**engine, sequence_parallel=2)})
    try:
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        for step in range(2):
            m1 = one.update(batch, loss, seed=step)
            m2 = sp.split(PolicyWorker.update, batch, loss, seed=step)
            assert m2[0] == pytest.approx(m2[1])  # both SP ranks report the group's figures
            assert set(m2[0]) == set(m1)
            for k, v in m1.items():
                if k == "actor/forward_tokens":  # each packed row padded to a multiple of 2: at most 1 more each
                    assert v <= m2[0][k] < 1.1 * v
                else:
                    assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        w1 = dict(one.named_weights())
        w2 = dict(collective(sp, PolicyWorker.named_weights))
        for n, t in w1.items():
            torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    finally:
        sp.shutdown()
