"""reward.normalize=running in a run: the same seed and samples give the same whitened rewards, and so the same
update, whether a step's rows are scored in one call per landed batch (sync) or one call per row as each
response ends (periodic, ``reward.stream=sample``, groups streamed into the update), or by a scorer on a pool
of its own (``placement.reward=<pool>``, its calls as groups land)."""

from __future__ import annotations

import pytest
import torch

from relayrl.workflows.pipeline import GRPOPipeline

from test_dataflow import config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

KEYS = ("reward/mean", "reward/std", "reward/raw_mean", "reward/norm_mean", "reward/norm_std")


def two_steps(cfg) -> list[dict[str, float]]:
    wf = GRPOPipeline(cfg)
    try:
        wf.begin()
        return [wf.step(1), wf.step(2)]
    finally:
        wf.shutdown()


@pytest.mark.parametrize("split", [["reward.stream=sample"], ["placement.pools.rm=1", "placement.reward=rm",
                                              "cluster.oversubscribe=true"]],
                         ids=["per-row-calls", "scorer-on-a-pool"])
def test_whitened_rewards_do_not_depend_on_how_a_step_is_split_into_scoring_calls(tmp_path, split):
    over = ["reward.normalize=running", "trainer.stream_groups=1", "engine.token_budget=64"]
    sync = two_steps(config(tmp_path / "sync", "trainer.mode=sync", *over))
    per = two_steps(config(tmp_path / "periodic", "trainer.mode=periodic", *split, *over))
    for s, p in zip(sync, per):
        assert s["reward/raw_mean"] == p["reward/raw_mean"]  # the same samples
        for k in KEYS:
            assert p[k] == pytest.approx(s[k], rel=1e-9, abs=1e-12), k
    assert sync[1]["reward/norm_std"] > 0 and sync[1]["reward/std"] > 0  # step 2 is whitened by step 1's moments
    torch.testing.assert_close(per[1]["actor/grad_norm"], sync[1]["actor/grad_norm"], rtol=1e-4, atol=0)
