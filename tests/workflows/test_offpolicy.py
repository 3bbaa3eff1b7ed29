"""k-step off-policy pieces: the rollout-ahead thread's staleness bound, and the loss's importance weights."""

import threading
import time

import pytest
import torch

from relayrl.engines.training.base import MicroBatch
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.offpolicy import RolloutAhead


def _run(k: int, steps: int = 8, train_s: float = 0.01, gen_s: float = 0.0):
    """A fake trainer on top of RolloutAhead; returns (batches as (step, version), pushes, max run-ahead)."""
    started: list[tuple[int, int]] = []
    pushes: list[int] = []
    lock = threading.Lock()
    trained = [0]
    ahead_max = [0]
    holder: dict = {}

    def produce(j):
        with lock:
            started.append((j, holder["ra"].rollout_version))
            ahead_max[0] = max(ahead_max[0], j - trained[0])
        time.sleep(gen_s)
        return f"batch{j}"

    def push(version, weights):
        assert weights == f"w{version}"
        pushes.append(version)

    holder["ra"] = ra = RolloutAhead.__new__(RolloutAhead)  # produce() may run before __init__ returns
    RolloutAhead.__init__(ra, produce, push, range(1, steps + 1), k, version=0)
    got = []
    for t in range(1, steps + 1):
        out, version = ra.take(t)
        got.append((t, out, version))
        time.sleep(train_s)  # the update
        with lock:
            trained[0] = t
        ra.stage(t, f"w{t}")
    ra.close()
    return got, started, pushes, ahead_max[0]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_never_exceeds_k_and_rollouts_run_ahead(k):
    got, started, pushes, ahead = _run(k)
    assert [out for _, out, _ in got] == [f"batch{t}" for t in range(1, 9)]
    staleness = [t - 1 - v for t, _, v in got]
    assert all(0 <= s <= k for s in staleness), staleness
    assert max(staleness) == k  # the trainer is slower than generation: the bound is reached
    assert ahead == k + 1  # generation of batch j starts while the trainer is at most k+1 steps behind
    assert pushes == sorted(pushes) and all(v >= 1 for v in pushes)  # weights only move forward


def test_a_failed_rollout_surfaces_in_the_trainer():
    def produce(j):
        if j == 2:
            raise ValueError("generation broke")
        return j

    ra = RolloutAhead(produce, lambda v, w: None, range(1, 5), 1, version=0)
    assert ra.take(1) == (1, 0)
    ra.stage(1, None)
    with pytest.raises(RuntimeError, match="before batch 2") as err:
        ra.take(2)
    assert isinstance(err.value.__cause__, ValueError)
    ra.close()


def _mb(logprobs, old, gen, adv):
    mask = torch.ones_like(logprobs)
    fields = {"old_logprobs": old, "gen_logprobs": gen, "advantages": adv}
    return MicroBatch(logprobs, mask, fields, int(mask.sum()), logprobs.shape[0], None)


def test_truncated_importance_weights_scale_the_token_losses():
    torch.manual_seed(0)
    lp = torch.randn(2, 3).requires_grad_()
    old = lp.detach().clone()
    gen = old - torch.tensor([[0.0, 0.5, 2.0], [-0.3, 0.0, 0.1]])  # pi_old / mu = exp(old - gen)
    adv = torch.ones(2, 3)
    plain, _ = PolicyLoss(agg="token-mean")(_mb(lp, old, gen, adv))
    weighted, m = PolicyLoss(agg="token-mean", tis_cap=2.0)(_mb(lp, old, gen, adv))
    w = torch.exp(old - gen).clamp(max=2.0)
    assert torch.allclose(weighted, plain * w.mean(), atol=1e-6)  # ratio 1: each token's loss is -A * w
    assert m["offpolicy/capped_frac"] == pytest.approx(1 / 6)
    rollout_old, _ = PolicyLoss(agg="token-mean", old_key="gen_logprobs")(_mb(lp, old, gen, adv))
    assert not torch.allclose(rollout_old, plain)  # the ratio is taken against the rollout's log-probs


def test_an_evaluation_never_swaps_weights_inside_a_batch():
    """Issue 11 item 6: the trainer's evaluation pushed its weights into the rollout engine from the main
    thread while the rollout thread was between two generation rounds of one batch (fails before: a push
    between round 1 and round 2 of batch 2). Now it waits for the batch, then evaluates the staged weights."""
    import contextlib
    from types import SimpleNamespace

    from relayrl.workflows.offpolicy import OffPolicyGRPO

    events: list[tuple[str, int]] = []

    def produce(j):  # a DAPO batch: two generation rounds
        events.append(("round1", j))
        time.sleep(0.3)
        events.append(("round2", j))
        return f"batch{j}"

    def push(version, weights):
        events.append(("push", version))

    class Workflow(OffPolicyGRPO):
        def __init__(self):  # no worker groups: the evaluation's collaborators are stubbed
            pass

    wf = Workflow()
    wf._push = push
    wf.actor = SimpleNamespace(all=lambda method, *a, **k: [[("w", torch.zeros(1))]])
    wf.rollout = SimpleNamespace()
    wf.s = SimpleNamespace(span=lambda *a: contextlib.nullcontext(),
                           evaluate=lambda fn, step: events.append(("eval", step)) or SimpleNamespace(metrics={}))
    wf._ahead = ra = RolloutAhead(produce, push, range(1, 4), k=1, version=0)
    try:
        assert ra.take(1) == ("batch1", 0)
        time.sleep(0.1)  # batch 2 (k=1: it may start at once) is between its two rounds
        ra.stage(1, "w1")
        wf.evaluate(1)
        versions = [ra.take(2)[1], ra.take(3)[1]]
    finally:
        ra.close()
    for i, e in enumerate(events):
        if e[0] == "round1":
            assert events[i + 1] == ("round2", e[1]), events  # nothing happens to the engine inside a batch
    assert events.index(("push", 1)) < events.index(("eval", 1))  # the evaluation sees the trainer's weights
    assert versions == [0, 1]  # batch 2 was generated by weights 0 only; batch 3 by 1 (staleness counts right)


def test_off_policy_rollout_takes_a_gpu_the_trainer_does_not_use():
    """Issue 11 item 7: the rollout was pinned to the last GPU even when the trainer's pool used it."""
    from relayrl.workflows.offpolicy import rollout_gpu

    assert rollout_gpu(4, [2, 3]) == 0  # the old rule took GPU 3, the trainer's
    assert rollout_gpu(4, [0, 1]) == 2
    assert rollout_gpu(2, [0]) == 1
    assert rollout_gpu(1, [0]) == 0  # one GPU: shared
    assert rollout_gpu(2, [0, 1]) == 1
