"""GRPOWorkflow's phases on hand-made inputs, without worker groups (the workflow's state is stubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from relayrl.algorithms import advantages as adv_lib
from relayrl.config.schema import AlgorithmConfig
from relayrl.workflows.grpo import GRPOWorkflow


def test_reinforce_pp_discounts_with_algorithm_gamma():
    """Issue 11 item 7: the workflow called the estimator without algorithm.gamma, so REINFORCE++ always
    used gamma=1 (fails before)."""
    comps = [SimpleNamespace(token_ids=torch.zeros(n), prompt_index=i) for i, n in enumerate([3, 5, 2])]
    rewards = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    for gamma in (1.0, 0.5):
        stub = SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig(advantage="reinforce++", gamma=gamma)),
                               ref=None, dock=None)
        got = GRPOWorkflow.advantages(stub, "p", [0, 1, 2], rewards, comps)["advantages"]
        want = adv_lib.reinforce_pp(adv_lib.outcome_to_token_rewards(rewards, mask), mask, gamma=gamma)
        for row, w, L in zip(got, want, (3, 5, 2)):
            torch.testing.assert_close(row, w[:L])
    assert not torch.isclose(got[0][0], got[0][2])  # gamma=0.5: the first token's return is a quarter of the last's
