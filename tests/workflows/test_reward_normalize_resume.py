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


def _moments(run_dir, step: int) -> dict:
    import json

    state = json.loads((run_dir / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").read_text())
    return state["reward_moments"]


def _resumed_from(whole, cut, step: int, tiny_dir, *over: str) -> list[dict]:
    """A run resumed in ``cut`` from ``whole``'s checkpoint of ``step`` (one written while ``whole`` went on
    drawing batches ahead, as a run stopped there leaves it)."""
    import shutil

    import json

    shutil.copytree(whole / "checkpoints" / f"step-{step:06d}", cut / "checkpoints" / f"step-{step:06d}")
    run_grpo(cut, tiny_dir, "run.resume=auto", *over)  # (its metrics start at step + 1: no step 0 to drop)
    return [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines() if x.strip()]


OFF_POLICY = ["reward.verifier=user", "reward.normalize=running", "run.save_every=2", "trainer.off_policy_steps=1",
              "trainer.steps=4"]


@pytest.mark.slow
def test_an_off_policy_checkpoint_holds_the_moments_of_the_batches_it_trained(tmp_path, tiny_dir):
    """trainer.off_policy_steps=1: the checkpoint of step 2 is written once batch 3 was drawn ahead and scored;
    its moments count the 2 x 8 rewards of batches 1-2 (they counted batch 3's too, which a run resumed from it
    redraws and adds again), and the resumed run's step 4 counts each of the 4 batches once."""
    common = [*OFF_POLICY, "reward.user_fn=dataflow_rewards:by_length"]
    run_grpo(tmp_path / "whole", tiny_dir, *common)
    assert _moments(tmp_path / "whole", 2)["count"] == 16 and _moments(tmp_path / "whole", 4)["count"] == 32
    _resumed_from(tmp_path / "whole", tmp_path / "cut", 2, tiny_dir, *common)
    assert _moments(tmp_path / "cut", 4)["count"] == 32


@pytest.mark.slow
def test_an_off_policy_resume_whitens_as_the_uninterrupted_run(tmp_path, tiny_dir):
    """Rewards of the prompt alone (the redrawn batches' responses differ, their prompts do not): the resumed
    off-policy run whitens steps 3-4 by the moments the uninterrupted run used, bit for bit. Two prompts a step,
    their groups scored as they land in calls the threads' timing splits: a step is whitened by the earlier
    steps' moments, which its calls do not change."""
    common = [*OFF_POLICY, "reward.user_fn=dataflow_rewards:by_prompt"]
    whole = run_grpo(tmp_path / "whole", tiny_dir, *common)
    resumed = _resumed_from(tmp_path / "whole", tmp_path / "cut", 2, tiny_dir, *common)
    keys = ("reward/norm_mean", "reward/norm_std", "reward/mean")
    want = {(r["step"], k): r[k] for r in whole if r["step"] > 2 for k in keys}
    assert {(r["step"], k): r[k] for r in resumed if r["step"] > 2 for k in keys} == want
