"""End-to-end checks of the numbers a user trains on and reads (issue 11), on the tiny model (slow)."""

from __future__ import annotations

import pytest

from e2e_cli import FAST, records, relayrl


@pytest.mark.slow
def test_trainer_logprobs_use_the_sampling_temperature(sft_model, tmp_path):
    """Issue 11 item 1: at rollout.temperature=0.7 the trainer's passes ran at temperature 1 (fails before:
    rollout/logprob_error about 1.1 instead of 1.0). One step from the SFT model, reference = actor: the old
    pass (recompute) must reproduce the generator's log-probs, the update pass the old pass's (ratio 1 in
    the first and only mini-batch), and the reference pass the actor's (KL 0)."""
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=1", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "rollout.temperature=0.7", "algorithm.old_logprobs=recompute",
                "algorithm.kl_coef=0.01", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert last["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)  # fp32 CPU: the same kernels
    assert last["actor/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert last["actor/ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert last["actor/kl"] == pytest.approx(0.0, abs=1e-4)


@pytest.mark.slow
def test_an_overlong_filter_that_drops_every_response_skips_the_update(sft_model, tmp_path):
    """Issue 11 item 5: with every response cut at max_new_tokens the filter kept them all (``or rows``) and
    trained on exactly what it should drop (fails before: an update ran)."""
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=1", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "rollout.max_new_tokens=1", "algorithm.overlong_filter=true",
                "run.seed=1",  # (P(end) is 0.4% a sample here: a seed whose 64 first tokens hold none)
                *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert last["response/clip_ratio"] == 1.0  # the premise: every response was truncated
    assert last["actor/skipped_update"] == 1.0 and last["actor/overlong_filtered"] == 64
    assert "actor/grad_norm" not in last
    assert "algorithm.overlong_filter dropped all 64 responses" in r.stdout + r.stderr


@pytest.mark.slow
def test_dapo_says_when_its_batch_is_short_of_prompts_per_step(sft_model, tmp_path):
    """Issue 11 item 7: after max_resample_rounds the batch may hold fewer prompt groups than
    data.prompts_per_step, and no metric said so (fails before: no dapo/missing_prompts)."""
    r = relayrl("train", "recipes/arith_dapo.yaml", "trainer.steps=2", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "algorithm.max_resample_rounds=0", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    for rec in records(tmp_path)[1:]:
        assert rec["dapo/rounds"] == 1.0  # one round: every dropped group is missing from the batch
        assert rec["dapo/missing_prompts"] == rec["dapo/dropped_groups"]
