"""GPG: the advantage's scale for the batch's informative responses, the loss's plain policy gradient, and the
config's refusals."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.estimators import compute
from relayrl.algorithms.gpg import gpg_advantages, gpg_loss
from relayrl.algorithms.losses import policy_loss

R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])


def test_alpha_restores_the_scale_the_uninformative_group_takes_away():
    adv, alpha = gpg_advantages(R, G, normalize_std=False)
    # group 0: mean 0.75 -> 0.25, -0.75, 0.25, 0.25; group 1: all equal -> 0; group 2: mean 1 -> 1, -1
    centred = torch.tensor([0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0, 1.0, -1.0])
    assert float(alpha) == pytest.approx(10 / 6)  # 6 of 10 responses carry a signal
    torch.testing.assert_close(adv, centred * 10 / 6)


def test_with_the_std_the_centred_rewards_are_grpos():
    adv, alpha = gpg_advantages(R, G, normalize_std=True)
    std0 = torch.tensor([1.0, 0.0, 1.0, 1.0]).std()
    assert float(adv[1]) == pytest.approx(-0.75 / (float(std0) + 1e-6) * 10 / 6, rel=1e-5)
    mask = torch.ones(10, 3)
    torch.testing.assert_close(compute("gpg", rewards=R, group_ids=G, mask=mask), adv[:, None].expand(10, 3))


def test_a_batch_without_signal_has_no_advantage_and_alpha_one():
    adv, alpha = gpg_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert float(alpha) == 1.0 and not adv.any()


def test_the_loss_gradient_is_the_policy_gradient_without_a_ratio():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0]])
    lp = (old + torch.tensor([[0.5, -0.3, 0.0], [0.2, 0.0, 0.0]])).requires_grad_()  # the policy moved
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = gpg_loss(lp, old, adv, mask, agg="token-mean", clip_low=0.2, clip_high=0.2)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * mask / 5)  # -A / N, whatever the ratio (PPO would clip)
    assert float(loss.detach()) == pytest.approx(float(-(adv * lp.detach() * mask).sum() / 5))
    assert m["actor/ratio_max"] == pytest.approx(float(torch.exp(torch.tensor(0.5))), rel=1e-5)
    lp2 = old.clone().requires_grad_()  # on-policy: PPO's gradient
    policy_loss(lp2, old, adv, mask, agg="token-mean")[0].backward()
    lp3 = old.clone().requires_grad_()
    gpg_loss(lp3, old, adv, mask, agg="token-mean")[0].backward()
    torch.testing.assert_close(lp2.grad, lp3.grad)


def test_the_config_refuses_what_gpg_does_not_have():
    from tests.workflows.grpo_runs import recipe_cfg, refused

    cfg = recipe_cfg("algorithm.advantage=gpg", "algorithm.policy_loss=gpg")
    assert cfg.algorithm.advantage == "gpg"
    assert "no ratio to clip" in refused("algorithm.policy_loss=gpg", "algorithm.clip_high=0.28")
    assert "has no ratio" in refused("algorithm.policy_loss=gpg", "algorithm.dual_clip=3")
    assert "algorithm.gamma" in refused("algorithm.advantage=gpg", "algorithm.gamma=0.9")


def test_mini_batches_run_no_pi_old_pass_for_a_loss_without_a_ratio():
    """GPG's -A log pi takes no pi / pi_old: a batch split into mini-batches needs no pi_old pass, unless a
    rollout correction weighs pi_old / mu (or old_logprobs=recompute asks for it); PPO's ratio needs it."""
    from relayrl.config.plan import step_plan
    from tests.workflows.grpo_runs import recipe_cfg

    gpg = ("algorithm.advantage=gpg", "algorithm.policy_loss=gpg", "trainer.mini_batches=2")
    assert not step_plan(recipe_cfg(*gpg)).recompute_old
    assert step_plan(recipe_cfg(*gpg, "algorithm.correction.level=token")).recompute_old
    assert step_plan(recipe_cfg(*gpg, "algorithm.old_logprobs=recompute")).recompute_old
    assert step_plan(recipe_cfg("algorithm.advantage=gpg", "trainer.mini_batches=2")).recompute_old  # (ppo's loss)
