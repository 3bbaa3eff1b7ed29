"""A thinking budget (``rollout.interrupt``) on the GRPO step: the rows carry the ``loss_mask`` with the phrase
masked, a short run trains with the same generator/trainer log-prob agreement as without, the periodic
dataflow trains what the synchronous step does, and evaluation applies the budget."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.engines.generation.base import Completion
from relayrl.workflows.pipeline import GRPOPipeline
from relayrl.workflows.rollout_stream import group_rows

# the budget: 3 tokens of thinking, the phrase " = =" (two tokens of the tiny tokenizer), what 10 leaves to answer
INTERRUPT = ["rollout.interrupt.after_tokens=3", "rollout.interrupt.text=' = ='", "rollout.max_new_tokens=10"]
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]


def config(run_dir, *over: str) -> Config:
    return load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=2", "eval.size=8", "eval.every=0", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=10", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
        "engine.optim.eps=1e-3", "run.save_every=0", *over])


def test_group_rows_write_the_loss_mask_and_count_only_sampled_tokens():
    """What the rollout writes into the dock for an interrupted response and one that ended early."""
    cut = Completion(0, 0, torch.tensor([5, 6, 7, 90, 91, 8]), torch.tensor([-1.0, -1.0, -1.0, 0.0, 0.0, -2.0]),
                     "length", 3, loss_mask=torch.tensor([1.0, 1, 1, 0, 0, 1]),
                     token_versions=torch.tensor([2, 2, 3, 3, 3, 3]), interrupted=True)
    early = Completion(0, 1, torch.tensor([5, 1]), torch.tensor([-1.0, -0.5]), "stop", 3,
                       loss_mask=torch.ones(2), token_versions=torch.tensor([3, 3]))
    cols, record = group_rows([1, 2], 7, [cut, early])
    assert [m.tolist() for m in cols["loss_mask"]] == [[1, 1, 1, 0, 0, 1], [1, 1]]
    assert record.interrupted == [True, False]
    assert record.versions == [{2: 2, 3: 2}, {3: 2}]  # the phrase's two tokens are not the model's
    assert record.lengths == [6, 2] and record.truncated == [True, False]
    plain, rec = group_rows([1, 2], 7, [Completion(0, 0, torch.tensor([5]), torch.tensor([-1.0]), "stop", 3,
                                                   token_versions=torch.tensor([3]))])
    assert "loss_mask" not in plain and rec.interrupted == []


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_grpo_run_with_a_thinking_budget_trains_with_the_same_logprob_error(tmp_path):
    GRPOPipeline(config(tmp_path / "off")).run()
    GRPOPipeline(config(tmp_path / "on", *INTERRUPT)).run()
    off, on = _records(tmp_path / "off"), _records(tmp_path / "on")
    assert [r["step"] for r in on] == [0, 1, 2]
    for r_off, r_on in zip(off[1:], on[1:]):
        assert "rollout/interrupted_frac" not in r_off
        assert 0 < r_on["rollout/interrupted_frac"] <= 1
        assert r_on["response/length_max"] <= 10
        assert r_on["actor/grad_norm"] > 0
        # mean exp|gen - train| (1: equal); the phrase's tokens (log-prob 0 in the rollout, far from the model's)
        # are masked out of the comparison, or the worst token would be far above 1
        assert r_on["rollout/logprob_error_max"] < 1.01
        assert r_on["rollout/logprob_error"] - 1 <= 10 * (r_off["rollout/logprob_error"] - 1) + 1e-5
    # evaluation applies the budget (rollout.interrupt.eval, default true) and says how often it cut
    assert "eval/interrupted_frac" in on[0] and "eval/interrupted_frac" not in off[0]
    samples = [json.loads(x) for x in (tmp_path / "on" / "eval" / "eval-step000000_samples.jsonl").read_text().splitlines()]
    assert any(s["interrupted"] for s in samples)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_periodic_dataflow_trains_what_the_sync_step_does(tmp_path):
    """The rollout's rows with their loss_mask, through the dock, to a trainer that accumulates groups as they
    arrive: the same update as the synchronous step (same seed, same samples)."""
    from test_dataflow import one_step

    sync, w_sync = one_step(config(tmp_path / "sync", *INTERRUPT, *SPLIT))
    periodic, w_per = one_step(config(tmp_path / "periodic", *INTERRUPT, *SPLIT, "trainer.mode=periodic"))
    assert sync["rollout/interrupted_frac"] == periodic["rollout/interrupted_frac"] > 0
    assert periodic["rollout/logprob_error_max"] < 1.01  # the phrase (log-prob 0 in the rollout) is masked there too
    for k in w_sync:
        torch.testing.assert_close(w_per[k], w_sync[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiproc
def test_off_policy_with_partial_rollout_keeps_the_phrase_masked(tmp_path):
    """Rollouts a step ahead, taking new weights between decode steps: interrupted rows re-enter the feed
    across weight updates, and the phrase stays out of the trained tokens and of the staleness record."""
    GRPOPipeline(config(tmp_path / "k1", *INTERRUPT, "trainer.off_policy_steps=1", "rollout.partial=true",
                        "trainer.steps=3")).run()
    rec = _records(tmp_path / "k1")
    assert [r["step"] for r in rec] == [0, 1, 2, 3]
    for r in rec[1:]:
        assert 0 < r["rollout/interrupted_frac"] <= 1
        assert r["response/length_max"] <= 10
        # later steps train on tokens one update stale (lr 1e-3: the worst token's ratio reaches ~2-3 with or
        # without the budget); a phrase token in the comparison (log-prob 0 in the rollout) would be ~100s
        assert r["rollout/logprob_error_max"] < 5
    assert rec[1]["async/staleness_max"] == 0 and rec[1]["rollout/logprob_error_max"] < 1.01
    assert max(r["async/staleness_max"] for r in rec[1:]) == 1
