"""The step's advantage phase (``workflows/estimate.advantage_rows``) on hand-made rows."""

from __future__ import annotations

import torch

from relayrl.algorithms import advantages as adv_lib
from relayrl.config.schema import AlgorithmConfig
from relayrl.workflows.estimate import advantage_rows


def test_reinforce_pp_discounts_with_algorithm_gamma():
    """Issue 11 item 7: the workflow called the estimator without algorithm.gamma, so REINFORCE++ always
    used gamma=1 (fails before)."""
    lengths = [3, 5, 2]
    rewards = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    for gamma in (1.0, 0.5):
        a = AlgorithmConfig(advantage="reinforce++", gamma=gamma)
        got = advantage_rows(a, rewards, lengths, torch.tensor([0, 1, 2]))[0]["advantages"]
        want = adv_lib.reinforce_pp(adv_lib.outcome_to_token_rewards(rewards, mask), mask, gamma=gamma)
        for row, w, L in zip(got, want, lengths):
            torch.testing.assert_close(row, w[:L])
    assert not torch.isclose(got[0][0], got[0][2])  # gamma=0.5: the first token's return is a quarter of the last's


def test_gae_gives_the_critic_its_returns_and_whitens_over_the_batch():
    """An estimator that reads values gets them, and its returns come back beside the advantages."""
    a = AlgorithmConfig(advantage="gae", lam=0.9)
    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.0])]
    out, _ = advantage_rows(a, torch.tensor([1.0, 0.0]), [3, 2], torch.tensor([0, 1]), values=values)
    assert set(out) == {"advantages", "returns"}
    flat = torch.cat(out["advantages"])
    torch.testing.assert_close(flat.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)  # whitened
    torch.testing.assert_close(out["returns"][1][-1], torch.tensor(0.0))  # last token: reward 0, no next value
