"""``algorithm.advantage=otb`` end to end: the step runs the trainer's pi_old pass, the advantages read its
log-probs and sum of squared probabilities per token, and the policy trains (sync, periodic with the update
accumulated per chunk, off-policy)."""

from __future__ import annotations

import pytest
import torch

from grpo_runs import run_grpo


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    [],
    ["trainer.mode=periodic", "placement.pools={gen: 1}", "placement.rollout=gen"],
    ["trainer.off_policy_steps=1"],
], ids=["sync", "periodic", "offpolicy"])
def test_otb_trains_on_the_pre_update_passes_statistics(tmp_path, tiny_dir, mode, monkeypatch):
    from relayrl.algorithms import otb

    seen = []
    formula = otb.optimal_token_baseline

    def spy(token_rewards, logprobs, sum_sq, group_ids, mask, **kw):
        adv, returns = formula(token_rewards, logprobs, sum_sq, group_ids, mask, **kw)
        seen.append((logprobs, sum_sq, mask, adv))
        return adv, returns

    monkeypatch.setattr(otb, "optimal_token_baseline", spy)
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.advantage=otb", "reward.verifier=user",
                    "reward.user_fn=dataflow_rewards:by_length", *mode)
    assert [r["step"] for r in recs] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in recs)
    assert seen
    for lp, sq, mask, adv in seen:
        valid = mask.bool()
        assert bool((lp[valid] <= 0).all()) and bool((sq[valid] > 0).all()) and bool((sq[valid] <= 1 + 1e-5).all())
        assert bool((sq[valid] >= lp[valid].exp() ** 2 - 1e-5).all())  # the sampled token's own p^2 is in the sum
        assert bool((adv[~valid] == 0).all())
    # the baseline varies along the tokens: some row's advantages are not constant over its valid tokens
    assert any(float((a[m.bool()] - a[m.bool()][0]).abs().max()) > 1e-6 for *_, mk, ad in seen
               for a, m in zip(ad, mk) if int(m.sum()) > 1)


@pytest.mark.slow
def test_a_rollout_correction_weighs_the_energy_by_the_squared_factor(tmp_path, tiny_dir, monkeypatch):
    """Off-policy (the rollout's mu is the stale policy) with algorithm.correction on: the advantages get the
    correction's per-token factor (verl's rollout_is_weights in OTB), the truncated ratio pi_old / mu."""
    from relayrl.algorithms import otb

    seen = []
    formula = otb.optimal_token_baseline

    def spy(*args, **kw):
        seen.append((args[4], kw.get("is_weights")))
        return formula(*args, **kw)

    monkeypatch.setattr(otb, "optimal_token_baseline", spy)
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.advantage=otb", "reward.verifier=user",
                    "reward.user_fn=dataflow_rewards:by_length", "trainer.off_policy_steps=1",
                    "algorithm.correction.level=token", "algorithm.correction.high=1.01")
    assert [r["step"] for r in recs] == [1, 2]
    assert seen and all(w is not None for _, w in seen)
    weights = torch.cat([w[m.bool()] for m, w in seen])
    assert bool((weights > 0).all()) and bool((weights <= 1.01 + 1e-6).all())
    assert float(weights.min()) < 0.999  # the stale rollout policy differs from pi_old
