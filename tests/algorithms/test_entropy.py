"""Chunked entropy from logits."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.entropy import entropy_from_logits, entropy_metric


def test_uniform_and_one_hot():
    logits = torch.zeros(1, 2, 8)
    logits[0, 1, 3] = 1e4  # (almost) deterministic
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(8), 0.0]]))


def test_chunked_matches_reference_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 7)
    mask[1, 4:] = 0
    ref = torch.distributions.Categorical(logits=logits).entropy() * mask
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    for chunk in (1, 5, 1024):
        ent = entropy_from_logits(logits, mask, chunk_size=chunk)
        torch.testing.assert_close(ent, ref)
        (grad,) = torch.autograd.grad(ent.sum(), logits)
        torch.testing.assert_close(grad, ref_grad)


def test_no_grad_variant_and_metric():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    ent = entropy_from_logits(logits, grad=False, chunk_size=2)
    assert not ent.requires_grad
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    metric = entropy_metric(logits, mask)
    assert metric["actor/entropy"] == pytest.approx(ent[0, :2].mean().item(), rel=1e-5)
    bf = entropy_from_logits(logits.detach().bfloat16())
    assert bf.dtype == torch.float32


def test_errors():
    with pytest.raises(ValueError, match=r"logits has shape \(2, 3, 5\) but mask has shape \(2, 4\)"):
        entropy_from_logits(torch.zeros(2, 3, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="empty batch"):
        entropy_from_logits(torch.zeros(0, 3, 5))


def test_entropy_controller_follows_skywork_or1():
    from relayrl.algorithms.entropy import EntropyController

    fixed = EntropyController(0.01)
    assert fixed.update(9.0) == 0.01 and fixed.value == 0.01  # no target: fixed, whatever the entropy
    c = EntropyController(0.0, target=0.5, delta=0.1, high=0.25)
    assert c.value == 0.0
    assert c.update(0.3) == pytest.approx(0.1)  # below the target: up by delta, and applied
    assert c.update(0.2) == pytest.approx(0.2)
    assert c.update(0.1) == pytest.approx(0.25)  # the ceiling
    assert c.update(0.9) == 0.0 and c.coef == pytest.approx(0.15)  # above: not applied, and down by delta
    c2 = EntropyController(0.0, target=0.5, delta=0.1, high=0.25)
    c2.load_state_dict(c.state_dict())
    assert (c2.coef, c2.value) == (c.coef, c.value)
    with pytest.raises(ValueError, match=r"\[low, high\]"):
        EntropyController(2.0, target=0.5)
    with pytest.raises(ValueError, match="finite"):
        c2.load_state_dict({"coef": float("nan")})


def test_a_resumed_fixed_entropy_bonus_is_the_configs_not_the_checkpoints():
    """A run resumed with another algorithm.entropy_coef (a bonus added, removed or changed) applies it; only an
    adaptive coefficient is the checkpoint's, within the resumed run's bounds."""
    from relayrl.algorithms.entropy import EntropyController

    before = EntropyController(0.0)  # a run without a bonus, checkpointed after a step
    before.update(1.3)
    now = EntropyController(0.01)
    now.load_state_dict(before.state_dict())
    assert now.value == 0.01 and now.last_entropy == 1.3
    adaptive = EntropyController(0.0, target=0.5, delta=0.1, high=0.25)
    adaptive.load_state_dict({"coef": 0.2, "last_entropy": 0.3})
    assert adaptive.value == pytest.approx(0.2)
    narrower = EntropyController(0.0, target=0.5, delta=0.1, high=0.1)
    narrower.load_state_dict({"coef": 0.2, "last_entropy": 0.3})
    assert narrower.value == pytest.approx(0.1)  # algorithm.entropy_coef_max lowered on resume
