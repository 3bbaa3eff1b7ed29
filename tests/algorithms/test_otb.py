"""The Optimal Token Baseline (OTB): the formula on hand-computed groups, its reduction to the group mean, the
estimator record, and what the config and the step plan make of ``algorithm.advantage=otb``."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.advantages import grpo
from relayrl.algorithms.estimators import ESTIMATORS, compute
from relayrl.algorithms.otb import optimal_token_baseline, realized_energy, sum_sq_from_logits

# three responses to one prompt (lengths 3, 2, 1) and one alone in its group (length 2)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
PI = torch.tensor([[0.5, 1.0, 0.25], [0.2, 0.6, 0.0], [0.9, 0.0, 0.0], [0.3, 0.3, 0.0]])
S = torch.tensor([[0.5, 1.0, 0.25], [0.3, 0.5, 0.0], [0.82, 0.0, 0.0], [0.4, 0.4, 0.0]])
GROUPS = torch.tensor([7, 7, 7, 3])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 2.0])


def _outcome(rewards, mask):
    from relayrl.algorithms.advantages import outcome_to_token_rewards

    return outcome_to_token_rewards(rewards, mask)


def test_otb_matches_a_hand_computed_group():
    """w = 1 - 2 pi + S: response 0 [0.5, 0, 0.75] -> W [0.5, 0.5, 1.25]; response 1 [0.9, 0.3] -> W [0.9, 1.2];
    response 2 [0.02] -> W [0.02]. G is the outcome reward at every token (1, 0, 1), so
    B_0 = (0.5 + 0.02) / (0.5 + 0.9 + 0.02) = 26/71, B_1 = 0.5 / (0.5 + 1.2) = 5/17, and B_2 = 1.25/1.25 (only
    response 0 is left at position 2: its advantage there is 0)."""
    W = realized_energy(PI.log(), S, MASK)
    torch.testing.assert_close(W[:3], torch.tensor([[0.5, 0.5, 1.25], [0.9, 1.2, 0.0], [0.02, 0.0, 0.0]]))
    adv, returns = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK)
    b0, b1 = 26 / 71, 5 / 17
    want = torch.tensor([[1 - b0, 1 - b1, 0.0], [-b0, -b1, 0.0], [1 - b0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(returns, REWARDS[:, None] * MASK)


def test_token_rewards_give_rewards_to_go():
    """Per-token rewards: G_t is the reverse cumulative sum of the row's rewards from t on."""
    mask = torch.ones(2, 3)
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    pi, s = torch.full((2, 3), 0.5), torch.full((2, 3), 0.5)  # w = 0.5 everywhere: W_t = 0.5 (t + 1), equal
    adv, returns = optimal_token_baseline(r, pi.log(), s, torch.tensor([0, 0]), mask)
    G = torch.tensor([[3.0, 2.0, 2.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(returns, G)
    torch.testing.assert_close(adv, G - G.mean(0, keepdim=True))


def test_equal_energy_reduces_to_the_group_mean_without_std():
    """Equal W across a group's responses (same per-token statistics, same lengths): B*_t is the group mean of G,
    GRPO's centring without the std division (Dr.GRPO) on every token."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, generator=g)
    groups = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])
    mask = torch.ones(8, 6)
    pi = torch.rand(1, 6, generator=g).clamp(0.05, 0.95).expand(8, 6)
    s = (pi ** 2 + 0.1 * (1 - pi) ** 2).expand(8, 6)
    adv, _ = optimal_token_baseline(_outcome(rewards, mask), pi.log(), s, groups, mask)
    want = grpo(rewards, groups, normalize_std=False)[:, None].expand(8, 6)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    # unequal energy moves the baseline towards the higher-energy responses' rewards
    s2 = s.clone()
    s2[0] += 0.5  # response 0 (and only it) gets more energy at every token
    adv2, _ = optimal_token_baseline(_outcome(rewards, mask), pi.log(), s2, groups, mask)
    base, base2 = (rewards[:4, None] - adv[:4]), (rewards[:4, None] - adv2[:4])
    assert bool(((base2[1:] - base[1:]).sign() == (rewards[0] - base[0]).sign()).all())


def test_sum_sq_from_logits_is_the_sum_of_squared_probabilities():
    z = torch.randn(5, 11, dtype=torch.float64)
    for t in (1.0, 0.7):
        p = torch.softmax(z / t, -1)
        torch.testing.assert_close(sum_sq_from_logits(z, t).double(), (p ** 2).sum(-1), atol=1e-6, rtol=1e-6)


def test_negative_rounding_of_w_is_clamped_and_inputs_are_checked():
    """pi = 1 and S slightly below 1 (rounding): w = 1 - 2 + S < 0 is taken as 0, the squared norm it stands for."""
    W = realized_energy(torch.zeros(1, 2), torch.tensor([[0.999, 1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(W, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="same shape|shape"):
        optimal_token_baseline(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2, 3), torch.tensor([0, 0]),
                               torch.ones(2, 3))
    with pytest.raises(ValueError, match="integer"):
        optimal_token_baseline(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0.0, 0.0]),
                               torch.ones(2, 3))


def test_the_estimator_record_and_compute():
    est = ESTIMATORS["otb"]
    assert est.token_stats and est.min_group == 2 and est.group_relative and est.reads_token_rewards
    assert not est.values and not est.params
    adv = compute("otb", rewards=REWARDS, group_ids=GROUPS, mask=MASK, logprobs=PI.log(), sum_sq=S)
    assert adv[0, 0].item() == pytest.approx(1 - 26 / 71, abs=1e-6)
    with pytest.raises(ValueError, match="needs the policy's per-token statistics"):
        compute("otb", rewards=REWARDS, group_ids=GROUPS, mask=MASK)
    assert not any(e.token_stats for n, e in ESTIMATORS.items() if not n.startswith("otb"))


def test_zero_tail_gives_the_sole_longest_response_its_return_past_the_others():
    """otb-tir (verl's tir_optimal_token_baseline, handle_zero_tail=True): in group 7 (lengths 3, 2, 1) response
    0 alone reaches position 2, past the second-longest (2): there its baseline is 0 and its advantage its return
    (1) instead of about 0; every other position as plain OTB. A tie for the longest leaves the tail alone."""
    plain, _ = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK)
    tail, _ = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK, zero_tail=True)
    assert plain[0, 2].item() == pytest.approx(0.0, abs=1e-6) and tail[0, 2].item() == pytest.approx(1.0)
    changed = (plain - tail).abs() > 1e-9
    assert changed.sum().item() == 1 and bool(changed[0, 2])
    assert torch.equal(compute("otb-tir", rewards=REWARDS, group_ids=GROUPS, mask=MASK, logprobs=PI.log(),
                               sum_sq=S), tail)
    # the positions themselves: from the second-longest length on, only where the row is valid
    from relayrl.algorithms.otb import sole_tail

    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    index = torch.tensor([0, 0, 1, 1, 2])
    want = torch.zeros(5, 5, dtype=torch.bool)
    want[0, 2:] = True  # group 0: lengths 5 and 2; group 1: a tie at 4; group 2: one response
    assert torch.equal(sole_tail(mask, index, 3), want)
    tied = MASK.clone()
    tied[1, 2] = 1  # responses 0 and 1 both of length 3
    a, _ = optimal_token_baseline(_outcome(REWARDS, tied), PI.log(), S, GROUPS, tied)
    b, _ = optimal_token_baseline(_outcome(REWARDS, tied), PI.log(), S, GROUPS, tied, zero_tail=True)
    torch.testing.assert_close(a, b)


def _cfg(*over):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    return load_config(Config, "recipes/arith_grpo.yaml", ["algorithm.advantage=otb", *over])


def test_the_plan_runs_the_old_pass_and_the_advantages_wait_for_it():
    from relayrl.config.plan import step_plan

    plan = step_plan(_cfg())
    assert plan.recompute_old and "old" in plan.stage("advantages").reads
    assert any("pi_old pass runs" in n for n in plan.notes)
    assert "pi_old pass" in plan.describe()
    grpo_plan = step_plan(_cfg("algorithm.advantage=grpo"))
    assert not grpo_plan.recompute_old and "old" not in grpo_plan.stage("advantages").reads
    # off-policy and periodic plans keep the dependency (the old pass runs per chunk beside the rollout)
    for over in (["trainer.off_policy_steps=1"],
                 ["trainer.mode=periodic", "placement.pools={gen: 1}", "placement.rollout=gen"]):
        p = step_plan(_cfg(*over))
        assert p.recompute_old and "old" in p.stage("advantages").reads and "old" in p.stage("update").reads


def test_the_config_refuses_what_otb_cannot_take():
    from relayrl.config.loader import ConfigError
    from pydantic import ValidationError

    for over, msg in ((["algorithm.old_logprobs=rollout"], "old_logprobs=rollout skips"),
                      (["algorithm.gamma=0.9"], "ignores it"),
                      (["rollout.n=1"], "rollout.n >= 2")):
        with pytest.raises((ConfigError, ValidationError, ValueError), match=msg):
            _cfg(*over)
    assert math.isclose(_cfg("algorithm.kl_in_reward=true", "algorithm.kl_coef=0.01").algorithm.kl_coef, 0.01)


def test_advantage_rows_feed_the_pass_columns_and_squeeze_episode_rows():
    """The driver's advantages (workflows.estimate.advantage_rows) from unpadded dock rows: ``old_logprobs`` and
    ``sum_sq`` become the formula's inputs; with loss masks (multi-turn episodes) the environment's tokens are
    dropped before the energies are summed and get 0."""
    from relayrl.workflows.estimate import advantage_rows

    a = _cfg().algorithm
    lengths = [3, 2, 1]
    lp = [PI[i, :L].log() for i, L in enumerate(lengths)]
    sq = [S[i, :L] for i, L in enumerate(lengths)]
    out, _ = advantage_rows(a, REWARDS[:3], lengths, GROUPS[:3], old_logprobs=lp, sum_sq=sq)
    b0, b1 = 26 / 71, 5 / 17
    torch.testing.assert_close(out["advantages"][0], torch.tensor([1 - b0, 1 - b1, 0.0]), atol=1e-6, rtol=1e-6)
    assert "returns" not in out
    # response 0 with an environment token inserted at position 1 (any pi, S there): the same advantages around it
    keep = [torch.tensor([1, 0, 1, 1]), torch.ones(2), torch.ones(1)]
    lp_env = [torch.cat([lp[0][:1], torch.tensor([-3.0]), lp[0][1:]]), lp[1], lp[2]]
    sq_env = [torch.cat([sq[0][:1], torch.tensor([0.01]), sq[0][1:]]), sq[1], sq[2]]
    out2, _ = advantage_rows(a, REWARDS[:3], [4, 2, 1], GROUPS[:3], old_logprobs=lp_env, sum_sq=sq_env,
                             loss_masks=keep)
    torch.testing.assert_close(out2["advantages"][0], torch.tensor([1 - b0, 0.0, 1 - b1, 0.0]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out2["advantages"][1], out["advantages"][1])


def test_importance_weights_scale_each_tokens_energy_by_their_square():
    """verl's rollout_is_weights: w_j -> rho_j^2 w_j before the running sum; rho = 1 is the plain formula, a
    token masked by the correction (rho = 0) adds no energy."""
    rho = torch.tensor([[1.0, 0.5, 2.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    W = realized_energy(PI.log(), S, MASK, rho)
    torch.testing.assert_close(W[:3], torch.tensor([[0.5, 0.5, 3.5], [0.0, 0.3, 0.0], [0.02, 0.0, 0.0]]))
    plain, _ = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK)
    ones, _ = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK,
                                     is_weights=torch.ones_like(MASK))
    torch.testing.assert_close(plain, ones)
    weighted, _ = optimal_token_baseline(_outcome(REWARDS, MASK), PI.log(), S, GROUPS, MASK, is_weights=rho)
    b0 = (0.5 + 0.02) / (0.5 + 0.0 + 0.02)  # position 0: response 1's energy is gone
    assert weighted[1, 0].item() == pytest.approx(-b0, abs=1e-6)


def test_advantage_rows_pass_the_corrections_factor_to_otb():
    """algorithm.correction on: the rows' gen_logprobs give the truncated ratio pi_old / mu per token, which
    reweighs the baseline; off (or without gen_logprobs): the plain advantages."""
    from relayrl.workflows.estimate import advantage_rows, is_weights

    lengths = [3, 2, 1]
    lp = [PI[i, :L].log() for i, L in enumerate(lengths)]
    sq = [S[i, :L] for i, L in enumerate(lengths)]
    gen = [lp[0] + torch.tensor([0.0, 0.0, 0.0]), lp[1] + torch.tensor([-1.0, 0.0]), lp[2]]  # mu < pi_old: ratio e
    plain, _ = advantage_rows(_cfg().algorithm, REWARDS[:3], lengths, GROUPS[:3], old_logprobs=lp, sum_sq=sq,
                              gen_logprobs=gen)
    a = _cfg("algorithm.correction.level=token", "algorithm.correction.high=2.0").algorithm
    out, _ = advantage_rows(a, REWARDS[:3], lengths, GROUPS[:3], old_logprobs=lp, sum_sq=sq, gen_logprobs=gen)
    rho = is_weights(a.correction, *(torch.nn.utils.rnn.pad_sequence(x, batch_first=True) for x in (lp, gen)),
                     MASK[:3])
    torch.testing.assert_close(rho, torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    want, _ = optimal_token_baseline(_outcome(REWARDS[:3], MASK[:3]), PI[:3].log(), S[:3], GROUPS[:3], MASK[:3],
                                     is_weights=rho)
    for i, L in enumerate(lengths):
        torch.testing.assert_close(out["advantages"][i], want[i, :L], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out["advantages"][0], plain["advantages"][0])
