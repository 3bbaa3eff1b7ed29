"""Advantage estimators: hand-computed values, loop references, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import advantages as A
from relayrl.algorithms import estimators as E


def gae_loop(r, v, m, gamma, lam):
    """Reference GAE: explicit backward loop per row, skipping masked tokens."""
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last, next_v = 0.0, 0.0
        for t in reversed(range(T)):
            if m[b, t] == 0:
                continue
            delta = float(r[b, t]) + gamma * next_v - float(v[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
            next_v = float(v[b, t])
    return adv, (adv + v.double()) * m.double()


def group_loop(rewards, gids):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def test_gae_hand_computed_with_holes_in_mask():
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.float32)
    r = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 2.0]])
    v = torch.tensor([[0.5, 0.2, 0.1, 9.0], [0.3, 9.0, 0.2, 0.1]])
    adv, ret = A.gae(r, v, m, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - .1 = .9, d1 = .9*.1 - .2 = -.11, d0 = .9*.2 - .5 = -.32
    # A2 = .9, A1 = -.11 + .72*.9 = .538, A0 = -.32 + .72*.538 = .06736
    # row 1 skips position 1: A3 = 1.9, A2 = -.11 + .72*1.9 = 1.258, A0 = -.12 + .72*1.258 = .78576
    expected = torch.tensor([[0.06736, 0.538, 0.9, 0.0], [0.78576, 0.0, 1.258, 1.9]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, (expected + v) * m, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
def test_gae_matches_backward_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 150  # T > block size, so the blocked scan carries across blocks
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = (torch.rand(B, T, generator=g) > 0.3).double()
    m[0] = 0  # a fully masked row
    m[1, :] = 1
    adv, ret = A.gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = gae_loop(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, ref_ret, atol=1e-9, rtol=1e-9)
    assert adv[0].abs().sum() == 0


def test_grpo_hand_computed_unequal_groups_and_ids():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 4.0, 3.0])
    gids = torch.tensor([42, 42, 42, 9, -1, -1, -1])
    adv = A.grpo(rewards, gids)
    # group 42: mean 1/3, unbiased std sqrt(1/3) = .57735
    s = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, -1.0, 1.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    dr = A.grpo(rewards, gids, normalize_std=False)
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, -1.0, 1.0, 0.0]))


def test_grpo_all_equal_and_singleton_groups_are_zero_not_nan():
    adv = A.grpo(torch.tensor([1.0, 1.0, 1.0, 7.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(adv).all()
    assert adv.abs().max() == 0
    assert A.rloo(torch.tensor([3.0]), torch.tensor([5])).item() == 0


def test_grpo_and_rloo_match_loops():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(40, generator=g, dtype=torch.float64)
    gids = torch.randint(0, 9, (40,), generator=g) * 7 - 20
    groups = group_loop(rewards, gids)
    grpo_ref = torch.zeros(40, dtype=torch.float64)
    rloo_ref = torch.zeros(40, dtype=torch.float64)
    for idx in groups.values():
        vals = [float(rewards[i]) for i in idx]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1)) if n > 1 else 0.0
        for i in idx:
            grpo_ref[i] = (float(rewards[i]) - mean) / (std + 1e-6)
            rloo_ref[i] = float(rewards[i]) - (sum(vals) - float(rewards[i])) / (n - 1) if n > 1 else 0.0
    torch.testing.assert_close(A.grpo(rewards, gids), grpo_ref)
    torch.testing.assert_close(A.rloo(rewards, gids), rloo_ref)


def test_rloo_hand_computed():
    adv = A.rloo(torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0]), torch.tensor([0, 0, 0, 1, 1]))
    # 1 - 0 = 1; 0 - (1+0)/2 = -.5; 2 - 4 = -2; 4 - 2 = 2
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0]))


def test_reinforce_pp_discounts_then_whitens():
    m = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    tr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    adv = A.reinforce_pp(tr, m, gamma=0.5)
    returns = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)  # valid tokens in order
    whitened = (returns - returns.mean()) / (returns.std() + 1e-8)
    torch.testing.assert_close(adv[m.bool()], whitened)
    assert adv[1, 2] == 0


def test_reinforce_pp_baseline_and_remax():
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    gids = torch.tensor([0, 0, 1])
    adv = A.reinforce_pp_baseline(rewards, gids, m)
    tokens = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5, 0.0], dtype=torch.float64)
    expected = (tokens - tokens.mean()) / (tokens.std() + 1e-8)
    torch.testing.assert_close(adv[m.bool()], expected)
    rm = E.compute("remax", rewards=rewards, group_ids=gids, mask=m, baseline_rewards=torch.tensor([0.5, 0.5, 3.0], dtype=torch.float64))
    torch.testing.assert_close(rm, torch.tensor([[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0]], dtype=torch.float64))


def test_compute_dispatch_broadcasts_and_validates():
    m = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    rewards, gids = torch.tensor([1.0, 0.0]), torch.tensor([3, 3])
    out = E.compute("drgrpo", rewards=rewards, group_ids=gids, mask=m)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]))
    out = E.compute("grpo", rewards=rewards, group_ids=gids, mask=m)
    assert out.shape == m.shape and out[0, 2] == 0
    for name in E.ESTIMATORS:
        kw = {"values": torch.zeros(2, 3), "baseline_rewards": torch.zeros(2), "logprobs": torch.full((2, 3), -0.5),
              "sum_sq": torch.full((2, 3), 0.4), "ref_logprobs": torch.full((2, 3), -0.7)}
        res = E.compute(name, rewards=rewards, group_ids=gids, mask=m, **kw)
        assert res.shape == (2, 3) and torch.isfinite(res).all(), name
    gae_adv = E.compute("gae", rewards=rewards, group_ids=gids, mask=m, values=torch.zeros(2, 3))
    torch.testing.assert_close(gae_adv, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
        E.compute("ppo2", rewards=rewards, group_ids=gids, mask=m)
    with pytest.raises(ValueError, match="baseline_rewards"):
        E.compute("remax", rewards=rewards, group_ids=gids, mask=m)
    with pytest.raises(ValueError, match="values"):
        E.compute("gae", rewards=rewards, group_ids=gids, mask=m)


def test_errors_name_shapes_and_empty_batch():
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\) but group_ids has shape \(2,\)"):
        A.grpo(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="empty batch"):
        A.rloo(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_rewards has shape \(2, 3\) but values has shape \(2, 4\)"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="empty batch"):
        A.gae(torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="mask"):
        E.compute("grpo", rewards=torch.zeros(3), group_ids=torch.zeros(3, dtype=torch.long), mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="gamma"):
        A.gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 1.5, 1.0)


def test_reinforce_pp_matches_loop_with_holes():
    g = torch.Generator().manual_seed(2)
    B, T, gamma = 4, 80, 0.97
    tr = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = (torch.rand(B, T, generator=g) > 0.2).double()
    returns = []
    for b in range(B):
        running, row = 0.0, {}
        for t in reversed(range(T)):
            if m[b, t]:
                running = float(tr[b, t]) + gamma * running
                row[t] = running
        returns += [row[t] for t in sorted(row)]
    ret = torch.tensor(returns, dtype=torch.float64)
    expected = (ret - ret.mean()) / (ret.std() + 1e-8)
    adv = A.reinforce_pp(tr, m, gamma=gamma)
    torch.testing.assert_close(adv[m.bool()], expected)
    assert adv[~m.bool()].abs().sum() == 0


def test_an_estimator_added_to_the_registry_is_accepted_and_computed(monkeypatch):
    """Adding an estimator that needs only rewards is one record in the registry: the config accepts its name,
    the step plan reads what it needs, and the advantage phase computes it."""
    from relayrl.algorithms.estimators.base import Advantages, Estimator, broadcast
    from relayrl.config.plan import step_plan
    from relayrl.config.schema import AlgorithmConfig, Config
    from relayrl.workflows.estimate import advantage_rows

    scaled = Estimator("scaled", lambda x: Advantages(broadcast(A.grpo(x.rewards, x.group_ids, normalize_std=False) * 0.5,
                                                                x.mask)), paper="test", min_group=2)
    monkeypatch.setitem(E.ESTIMATORS, "scaled", scaled)
    cfg = Config.model_validate({"algorithm": {"advantage": "scaled"}})
    plan = step_plan(cfg)
    assert plan.estimator is scaled and plan.roles == ("actor", "rollout") and plan.update == "batch"
    out, _ = advantage_rows(AlgorithmConfig(advantage="scaled"), torch.tensor([1.0, 0.0]), [2, 3], torch.tensor([0, 0]))
    torch.testing.assert_close(out["advantages"][0], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(out["advantages"][1], torch.tensor([-0.25, -0.25, -0.25]))
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        Config.model_validate({"algorithm": {"advantage": "scaled"}, "rollout": {"n": 1, "temperature": 1.0}})
    with pytest.raises(ValueError, match="scaled"):  # gamma is not one of its params
        AlgorithmConfig(advantage="scaled", gamma=0.9)


def test_an_estimator_that_breaks_its_contract_is_named_with_the_breach():
    """A registered estimator's return is checked where it is called: a per-response [N] tensor, a bare tensor,
    no returns for a critic, or metrics that are tensors failed later, deep in the update (an IndexError, an
    AttributeError) or in the metric sinks, naming nothing of the estimator."""
    from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast

    r, g, mask = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 3)
    x = EstimatorInputs(r, g, mask, values=torch.zeros(2, 3))
    good = broadcast(A.grpo(r, g), mask)
    cases = [
        (lambda x: Advantages(A.grpo(x.rewards, x.group_ids)), False, r"returned advantages of shape \(2,\); "
         r"expected the mask's \(2, 3\) \(one value per response token: broadcast"),
        (lambda x: good, False, r"'mine' returned Tensor; return Advantages\(advantages \[B, T\]"),
        (lambda x: Advantages(good), True, r"reads values, so it returns the critic's returns .*got none"),
        (lambda x: Advantages(good, metrics={"mine/x": torch.tensor(1.0)}), False,
         r"returned metrics \{'mine/x': tensor\(1.\)\}; metrics are a dict of Python floats"),
    ]
    for fn, values, match in cases:
        with pytest.raises(ValueError, match=match):
            Estimator("mine", fn, paper="test", values=values)(x)
    out = Estimator("mine", lambda x: Advantages(good, metrics={"mine/x": 1.0}), paper="test")(x)
    assert out.metrics == {"mine/x": 1.0} and out.advantages is good


def test_grpo_batch_std_by_hand():
    """Group means, the whole batch's unbiased std (Lite PPO; TRL's scale_rewards="batch")."""
    rewards, gids = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    # group means 0.5, 0.5, 1, 1; the batch's mean 0.75, squared deviations 0.0625 + 0.5625 + 0.0625 + 0.0625
    # = 0.75, / 3 = 0.25: std 0.5
    torch.testing.assert_close(A.grpo_batch_std(rewards, gids, eps=0.0), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # a group with a small spread keeps its size against the batch (GRPO's own std would make it +-0.7)
    small = A.grpo_batch_std(torch.tensor([0.0, 1.0, 0.5, 0.6]), gids, eps=0.0)
    torch.testing.assert_close(small[2:], torch.tensor([-0.05, 0.05]) / torch.tensor([0.0, 1.0, 0.5, 0.6]).std())
    assert A.grpo_batch_std(torch.ones(3), torch.tensor([0, 0, 1])).abs().max() == 0  # all equal: 0, not NaN
    assert E.estimator("grpo-batch-std").group_relative is False  # it waits for the whole batch


def test_opo_baseline_is_the_length_weighted_group_mean():
    from relayrl.algorithms.advantages import opo
    from relayrl.algorithms.estimators import compute

    r = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    lengths = torch.tensor([2, 4, 6, 8, 3, 3, 3])
    # group 0: (2*1 + 4*0 + 6*1 + 8*0.5) / 20 = 0.6; group 1, equal lengths: the plain mean 1/3
    torch.testing.assert_close(opo(r, g, lengths), torch.tensor([0.4, -0.6, 0.4, -0.1, -1 / 3, -1 / 3, 2 / 3]))
    mask = (torch.arange(8)[None] < lengths[:, None]).float()
    adv = compute("opo", rewards=r, group_ids=g, mask=mask)
    torch.testing.assert_close(adv[:, 0], opo(r, g, lengths))
    assert bool((adv[mask == 0] == 0).all())


def test_passk_advantage_goes_to_each_groups_best_response_only():
    from relayrl.algorithms.advantages import grpo_passk

    r = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.2, 0.9])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    plain = grpo_passk(r, g, normalize_std=False)
    # group 0: the best is tied (1.0 twice): margin 0; group 1: 1 - 0; group 2: 0.9 - 0.2 on the last
    torch.testing.assert_close(plain, torch.tensor([0.0, 0, 0, 0, 0, 0, 1.0, 0, 0.7]))
    scaled = grpo_passk(r, g)
    assert scaled[6] == pytest.approx(1.0 / (torch.tensor([0.0, 0.0, 1.0]).std().item() + 1e-6))
    with pytest.raises(ValueError, match="at least 2 responses per group"):
        grpo_passk(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


@pytest.mark.parametrize("fn", [A.grpo, A.grpo_batch_std, A.grpo_loo, A.grpo_passk, A.rloo,
                                lambda r, g: A.opo(r, g, torch.arange(len(r)) + 1)])
def test_a_group_of_equal_rewards_gets_exactly_zero(fn):
    """Eight float32 rewards of 0.7 (partial credit, a format or length term): their float mean is not 0.7, and
    GRPO gave every member (r - mean) / (std + 1e-6) = 0.056, all of one sign, where no response is better;
    RLOO and OPO left 6e-8. Every group estimator gives exactly 0 now (as for rewards of 0 and 1)."""
    rewards = torch.tensor([0.7] * 8 + [0.1] * 5 + [1 / 3] * 3 + [0.0, 1.0, 0.5, 0.3], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1] * 5 + [2] * 3 + [3] * 4)
    adv = fn(rewards, groups)
    assert adv[:16].tolist() == [0.0] * 16
    assert bool((adv[16:] != 0).any())  # (the group with a spread still gets advantages)
