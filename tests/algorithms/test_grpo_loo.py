"""grpo-loo, NeMo-RL's default GRPO advantage: hand-computed values, a loop reference written from NeMo-RL's
definition, RLOO without the std, and the config refusing algorithm.normalize_std where it is ignored."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import advantages as A
from relayrl.algorithms import estimators as E
from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config


def nemo_loop(rewards: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    """NeMo-RL's ``calculate_baseline_and_std_per_prompt(leave_one_out_baseline=True)`` then
    ``normalize_advantages_with_epsilon``, one response at a time: the others' mean, their unbiased std
    (0 when fewer than 2 or all equal), the difference divided by ``std + eps`` only where the std is above 0."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [x for j, (x, h) in enumerate(zip(rewards, groups)) if h == g and j != i]
        if not others:
            out.append(0.0)
            continue
        mean = sum(others) / len(others)
        var = sum((x - mean) ** 2 for x in others) / (len(others) - 1) if len(others) > 1 else 0.0
        std = math.sqrt(var)
        out.append((r - mean) / (std + eps) if std > 0 else r - mean)
    return out


def test_hand_computed_one_correct_of_four():
    adv = A.grpo_loo(torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 0, 0, 0]))
    # the correct one: its others are all 0 (std 0), so 1 - 0 = 1, undivided; a wrong one: others (1, 0, 0),
    # mean 1/3, unbiased std sqrt(1/3): (0 - 1/3) / sqrt(1/3) = -sqrt(1/3)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
                               atol=1e-5, rtol=0)
    grpo = A.grpo(torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 0, 0, 0]))
    assert grpo[0] == pytest.approx(1.5, abs=1e-4)  # GRPO's (1 - 1/4) / 0.5: not the same advantage


@pytest.mark.parametrize("binary", [True, False])
def test_matches_nemo_rl_s_definition(binary):
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([0] * 8 + [1] * 5 + [2] * 2 + [3] + [4] * 4 + [5] * 3)
    rewards = torch.rand(len(groups), generator=g, dtype=torch.float64)
    if binary:  # groups whose others are all equal: the std must be exactly 0, not a rounding residue
        rewards = (rewards > 0.6).double()
        rewards[16:20] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    want = torch.tensor(nemo_loop(rewards.tolist(), groups.tolist()), dtype=torch.float64)
    torch.testing.assert_close(A.grpo_loo(rewards, groups), want, atol=1e-9, rtol=1e-7)


def test_without_the_std_it_is_rloo():
    g = torch.Generator().manual_seed(1)
    groups = torch.tensor([3, 3, 3, 7, 7, 9, 9, 9, 9])
    rewards = torch.randn(len(groups), generator=g)
    torch.testing.assert_close(A.grpo_loo(rewards, groups, normalize_std=False), A.rloo(rewards, groups))


def test_by_name_reads_normalize_std():
    rewards, groups, mask = torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 3)
    adv = E.compute("grpo-loo", rewards=rewards, group_ids=groups, mask=mask)
    torch.testing.assert_close(adv[:, 0], A.grpo_loo(rewards, groups))
    flat = E.compute("grpo-loo", rewards=rewards, group_ids=groups, mask=mask, normalize_std=False)
    torch.testing.assert_close(flat[:, 0], A.rloo(rewards, groups))


def test_the_config_takes_grpo_loo_and_refuses_normalize_std_where_it_is_ignored():
    assert load_config(Config, "arith_grpo", ["algorithm.advantage=grpo-loo"]).algorithm.normalize_std
    load_config(Config, "arith_grpo", ["algorithm.advantage=grpo-loo", "algorithm.normalize_std=false"])
    with pytest.raises(ConfigError) as e:  # NeMo-RL's normalize_rewards with RLOO: it was silently ignored
        load_config(Config, "arith_grpo", ["algorithm.advantage=rloo", "algorithm.normalize_std=true"])
    assert "algorithm.normalize_std=true chooses whether to divide by the group's reward std, which only advantage=grpo, grpo-loo, " \
           "grpo-passk, gpg reads; 'rloo' ignores it: drop algorithm.normalize_std; the leave-one-out baseline " \
           "over the others' std is advantage=grpo-loo" in str(e.value)
    with pytest.raises(ConfigError) as e:  # (it said "normalize_std=false divides by the group's reward std")
        load_config(Config, "arith_grpo", ["algorithm.advantage=reinforce++-baseline", "algorithm.normalize_std=false"])
    assert "algorithm.normalize_std=false chooses whether to divide by the group's reward std" in str(e.value)
    assert "'reinforce++-baseline' ignores it" in str(e.value)
    with pytest.raises(ConfigError) as e:  # (two estimators read gamma: "which only ... reinforce++ and gae use")
        load_config(Config, "arith_grpo", ["algorithm.gamma=0.9"])
    assert "which only advantage=reinforce++ and gae use; 'grpo' ignores it" in str(e.value)
