"""reward.normalize=running: the running moments of the rewards are part of a checkpoint, so a resumed run
whitens its rewards as the uninterrupted run does."""

from __future__ import annotations

import pytest

from grpo_runs import run_grpo


@pytest.mark.slow
def test_a_resumed_run_whitens_by_the_moments_of_every_reward_so_far(tmp_path, tiny_dir):
    common = ["reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length", "reward.normalize=running",
              "run.save_every=2"]
    whole = run_grpo(tmp_path / "whole", tiny_dir, "trainer.steps=4", *common)
    run_grpo(tmp_path / "cut", tiny_dir, "trainer.steps=2", *common)
    resumed = run_grpo(tmp_path / "cut", tiny_dir, "trainer.steps=4", "run.resume=auto", *common)
    keys = ("reward/norm_mean", "reward/norm_std", "reward/mean", "actor/grad_norm")
    want = {(r["step"], k): r[k] for r in whole if r["step"] > 2 for k in keys}
    assert {(r["step"], k): r[k] for r in resumed if r["step"] > 2 for k in keys} == pytest.approx(want, rel=1e-6)
