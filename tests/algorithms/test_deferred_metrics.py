"""Metrics kept on the device through an optimizer step (deferred_metrics) read the same as metrics read to the
host at once; the sync-free masked reductions agree with the indexed ones they replaced."""

import math

import pytest
import torch

from relayrl.algorithms._checks import deferred_metrics, host_floats, metric_value, to_floats
from relayrl.algorithms._ops import masked_max
from relayrl.algorithms.correction import Correction
from relayrl.algorithms.value import explained_variance
from relayrl.engines.training.accumulate import MetricSums
from relayrl.engines.training.base import MicroBatch
from relayrl.workflows.losses import PolicyLoss


def test_deferred_values_stay_tensors_and_read_the_same():
    x = torch.tensor(0.1, dtype=torch.float32)
    assert isinstance(metric_value(x), float)
    with deferred_metrics():
        kept = metric_value(x)
        nested = to_floats({"a": x, "b": 2})
        with deferred_metrics():
            pass
        assert isinstance(metric_value(x), torch.Tensor)  # a nested context leaves the outer one on
    assert isinstance(kept, torch.Tensor) and kept.dtype == torch.float64 and not kept.requires_grad
    assert isinstance(metric_value(x), float)
    assert host_floats(nested) == {"a": float(x), "b": 2.0}
    assert host_floats(nested) == to_floats({"a": x, "b": 2})


def _micro_batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows in (3, 5):
        mask = (torch.rand(rows, 7, generator=g) > 0.3).float()
        mask[:, 0] = 1.0
        lp = (-torch.rand(rows, 7, generator=g)).requires_grad_()
        fields = {"old_logprobs": lp.detach() + 0.05 * torch.randn(rows, 7, generator=g),
                  "gen_logprobs": lp.detach() + 0.1 * torch.randn(rows, 7, generator=g),
                  "advantages": torch.randn(rows, 7, generator=g)}
        out.append(MicroBatch(lp, mask, fields, 40, 8, torch.rand(rows, 7, generator=g)))
    return out


@pytest.mark.parametrize("summed", [(), ("actor/entropy",)])
def test_a_step_of_deferred_metrics_reduces_to_the_host_read_figures(summed):
    """The same two micro-batches through PolicyLoss (rollout correction and logprob error included, so means,
    maxima and sums all occur), summed as floats and as device tensors: the reduced metrics are equal."""
    loss = PolicyLoss(agg="token-mean", correction=Correction(level="token", mode="truncate", kl_threshold=0.5))
    reduced = []
    for deferred in (False, True):
        sums = MetricSums(summed, False)
        for mb in _micro_batches(0):
            if deferred:
                with deferred_metrics():
                    _, metrics = loss(mb)
                    weight = metric_value(mb.mask.sum())
                assert all(isinstance(v, torch.Tensor) for k, v in metrics.items() if k != "actor/kl_coef")
            else:
                _, metrics = loss(mb)
                weight = float(mb.mask.sum())
            sums.add(metrics, weight, int((mb.mask.sum(-1) > 0).sum()), int(mb.mask.numel()), False)
        reduced.append(sums.reduce(torch.device("cpu"), 40, 8, "actor"))
    assert reduced[0].keys() == reduced[1].keys()
    assert any(k.endswith("_max") for k in reduced[0])
    for k in reduced[0]:
        assert reduced[1][k] == pytest.approx(reduced[0][k], rel=1e-12, abs=1e-12), k


def test_masked_max_matches_indexing_and_handles_empty():
    x = torch.tensor([[0.5, -3.0, 9.0], [1.0, 2.0, -1.0]])
    keep = torch.tensor([[True, True, False], [False, False, True]])
    assert float(masked_max(x, keep)) == float(x[keep].max()) == 0.5
    assert float(masked_max(x, torch.zeros_like(keep))) == 0.0
    assert float(masked_max(x, torch.zeros_like(keep), empty=1.0)) == 1.0
    assert float(masked_max(-torch.ones(3), torch.tensor([False, True, False]))) == -1.0


def test_explained_variance_without_indexing_matches_the_indexed_formula():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        v, r = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g) * 3
        mask = (torch.rand(4, 9, generator=g) > 0.4).float()
        rv, vv = r[mask.bool()].double(), v[mask.bool()].double()
        want = float(1.0 - (rv - vv).var() / rv.var())
        assert explained_variance(v, r, mask) == pytest.approx(want, rel=1e-12)
    one = torch.zeros(2, 3)
    one[0, 0] = 1.0
    assert math.isnan(explained_variance(torch.randn(2, 3), torch.randn(2, 3), one))  # one valid token
    with deferred_metrics():
        kept = explained_variance(v, r, mask)
    assert isinstance(kept, torch.Tensor) and float(kept) == pytest.approx(want, rel=1e-12)
