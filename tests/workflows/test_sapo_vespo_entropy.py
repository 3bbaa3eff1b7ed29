"""SAPO, VESPO, the high-entropy token selection and the ratio-weighted KL inside the step's policy loss: the
loss object's gradients, the config's refusals, and end-to-end runs (sync and off-policy)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.training.base import MicroBatch
from relayrl.workflows.losses import PolicyLoss

from grpo_runs import recipe_cfg, refused, run_grpo

LP = torch.tensor([[-1.0, -2.0, -0.5, -0.7], [-0.3, -1.2, -2.2, -0.9]])
ENT = torch.tensor([[0.2, 1.5, 0.1, 3.0], [2.5, 0.3, 1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def _mb(lp, old=None, ref=None, adv=None, global_tokens=None):
    adv = torch.ones_like(lp) if adv is None else adv
    fields = {"advantages": adv, **({} if old is None else {"old_logprobs": old}),
              **({} if ref is None else {"ref_logprobs": ref})}
    return MicroBatch(lp, MASK, fields, int(MASK.sum()) if global_tokens is None else global_tokens, 2, ENT)


def test_top_entropy_trains_only_the_forking_tokens_and_keeps_the_normaliser():
    """top 40% of 7 valid tokens by entropy: the 3.0, 2.5 and 1.5 tokens (quantile 0.6 = 1.3); the others get no
    policy gradient and no entropy bonus, and the token-mean still divides by all 7 (TRL's normaliser)."""
    lp = LP.clone().requires_grad_()
    loss, m = PolicyLoss(agg="token-mean", top_entropy=0.4)(_mb(lp))
    loss.backward()
    kept = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, -kept / 7)  # on-policy: -A / N on the kept tokens
    assert m["actor/entropy_kept_frac"] == pytest.approx(3 / 7)
    assert m["actor/entropy"] == pytest.approx(float((ENT * MASK).sum() / 7))  # the metric: every token
    # the entropy bonus is taken over the same tokens
    lp2 = LP.clone().requires_grad_()
    with_bonus, _ = PolicyLoss(agg="token-mean", top_entropy=0.4, entropy_coef=0.1)(_mb(lp2))
    assert float(with_bonus.detach()) == pytest.approx(float(loss.detach()) - 0.1 * float((ENT * kept).sum() / 7))


def test_the_losses_options_reach_the_loss_and_the_kl_can_be_ratio_weighted():
    old = LP - torch.tensor([[0.0, 0.4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    grads = {}
    for name, options in (("sapo", (("tau_pos", 1.0), ("tau_neg", 1.05))), ("sapo", (("tau_pos", 5.0),))):
        lp = LP.clone().requires_grad_()
        PolicyLoss(agg="token-mean", kind=name, options=options)(_mb(lp, old))[0].backward()
        grads[options[0][1]] = lp.grad[0, 1]
    assert abs(grads[5.0]) < abs(grads[1.0])  # the sharper gate fades the off-policy token more
    ref = LP - 0.2
    lp_plain, lp_weighted = LP.clone().requires_grad_(), LP.clone().requires_grad_()
    PolicyLoss(agg="token-mean", kl_coef=0.5)(_mb(lp_plain, old, ref))[0].backward()
    PolicyLoss(agg="token-mean", kl_coef=0.5, kl_ratio_weighted=True)(_mb(lp_weighted, old, ref))[0].backward()
    # on row 1 the ratio is 1: the same value, and the weight's own gradient adds k3 (d ratio / d log pi = ratio)
    k3 = torch.exp(torch.tensor(-0.2)) - 1 + 0.2
    torch.testing.assert_close(lp_weighted.grad[1] - lp_plain.grad[1], 0.5 * k3 * MASK[1] / 7)


# ------------------------------------------------------------------------------------ config
def test_config_refusals_name_the_key_and_the_fix():
    assert "set algorithm.policy_loss=sapo" in refused("algorithm.sapo.tau_neg=2")
    assert "set algorithm.policy_loss=vespo" in refused("algorithm.policy_loss=sapo", "algorithm.vespo.k_pos=1")
    assert "algorithm.clip_high=0.2" in refused("algorithm.policy_loss=sapo", "algorithm.clip_high=0.28")
    assert "algorithm.dual_clip=null" in refused("algorithm.policy_loss=vespo", "algorithm.dual_clip=3")
    assert "ratio_level=token" in refused("algorithm.policy_loss=vespo", "algorithm.ratio_level=sequence")
    assert "kl_coef=0" in refused("algorithm.kl_bias_correction=true")
    assert "use algorithm.kl_kind=k3" in refused("algorithm.advantage=reinforce++", "algorithm.kl_in_reward=true",
                                                 "algorithm.kl_coef=0.1", "algorithm.kl_kind=k3+")
    assert "top_entropy_quantile" in refused("algorithm.top_entropy_quantile=1.5")
    assert "set algorithm.policy_loss=clip_cov" in refused("algorithm.cov.ratio=0.01")
    assert "algorithm.clip_high=0.2" in refused("algorithm.policy_loss=kl_cov", "algorithm.clip_high=0.28")
    assert "ratio_level=token" in refused("algorithm.policy_loss=clip_cov", "algorithm.ratio_level=sequence")
    assert "below algorithm.cov.high" in refused("algorithm.policy_loss=clip_cov", "algorithm.cov.low=6")
    assert "loss_agg=seq-mean-token-mean" in refused("algorithm.policy_loss=gmpo", "algorithm.loss_agg=token-mean")
    assert dict(recipe_cfg("algorithm.policy_loss=kl_cov", "algorithm.cov.kl_coef=1").algorithm.loss_options()) == {
        "cov_ratio": 0.0002, "cov_low": 1.0, "cov_high": 5.0, "kl_coef": 1.0}
    a = recipe_cfg("algorithm.policy_loss=vespo", "algorithm.vespo.lambda_pos=4").algorithm
    assert a.loss_options() == (("k_pos", 2.0), ("lambda_pos", 4.0), ("k_neg", 3.0), ("lambda_neg", 2.0))
    assert recipe_cfg().algorithm.loss_options() == ()


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_sapo_with_forking_tokens_and_the_unbiased_kl_trains(tmp_path, tiny_dir):
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.policy_loss=sapo", "algorithm.top_entropy_quantile=0.2",
                "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length",
                "algorithm.kl_coef=0.01", "algorithm.kl_bias_correction=true", "algorithm.kl_kind=k3+")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 0 < r["actor/entropy_kept_frac"] < 0.5 and 0 < r["actor/soft_gate_mean"] <= 1.0 + 1e-6
        assert "actor/kl_loss" in r and "actor/clip_frac" not in r


@pytest.mark.slow
def test_vespo_off_policy_weighs_the_stale_batches(tmp_path, tiny_dir):
    """k=1 off-policy with pi_old the rollout's log-probs: W = pi / mu, the kernel below 1 once a batch is
    stale (steps 2 and 3 train on rollouts of older weights)."""
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.policy_loss=vespo", "algorithm.old_logprobs=rollout",
                "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length",
                "algorithm.loss_agg=token-mean", "trainer.off_policy_steps=1", "trainer.steps=3")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(0 < r["actor/vespo_weight_mean"] <= 1.0 + 1e-4 for r in recs)
    assert any(r["actor/vespo_weight_mean"] < 0.9999 for r in recs[1:])


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov", "gmpo"])
def test_the_covariance_losses_and_gmpo_train(tmp_path, tiny_dir, loss):
    """Two mini-batches a step (the ratio leaves 1 in the second); Clip-Cov and KL-Cov treat 10% of the
    tokens; GMPO's geometric-mean ratios stay near 1."""
    cov = ["algorithm.cov.ratio=0.1", "algorithm.cov.low=-1e9", "algorithm.cov.high=1e9"] if "cov" in loss else []
    recs = run_grpo(tmp_path, tiny_dir, f"algorithm.policy_loss={loss}", *cov, "trainer.mini_batches=2",
                    "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["actor/grad_norm"] == r["actor/grad_norm"]
        if "cov" in loss:
            assert 0.05 < r["actor/cov_frac"] <= 0.15
        else:
            assert 0.5 < r["actor/seq_ratio_mean"] < 2.0


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["opo", "grpo-passk"])
def test_opo_and_passk_estimators_train(tmp_path, tiny_dir, estimator):
    recs = run_grpo(tmp_path, tiny_dir, f"algorithm.advantage={estimator}", "reward.verifier=user",
                    "reward.user_fn=dataflow_rewards:by_length")
    assert [r["step"] for r in recs] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in recs)


@pytest.mark.slow
def test_the_overlong_penalty_is_scaled_by_its_factor(tmp_path, tiny_dir):
    """A constant reward 1 and a ramp over the whole length (max_new_tokens=8, cache 7: from 1 token on), so the
    mean shaped reward is 1 + factor * (1 - mean length) / 7 (DAPO eq. 13 times verl's penalty_factor)."""
    (tmp_path / "one.py").write_text("def one(prompts, responses, answers):\n    return [1.0] * len(responses)\n")
    recs = run_grpo(tmp_path / "run", tiny_dir, "trainer.steps=1", "reward.verifier=user",
                    f"reward.user_fn={tmp_path}/one.py:one", "algorithm.overlong_shaping=true",
                    "algorithm.overlong_cache=7", "algorithm.overlong_penalty=0.5")
    r = recs[0]
    assert r["reward/mean"] == pytest.approx(1 + 0.5 * (1 - r["response/length_mean"]) / 7, abs=1e-5)
    assert r["reward/mean"] < 1.0


@pytest.mark.slow
def test_the_starting_models_evaluation_can_be_skipped(tmp_path, tiny_dir):
    import json

    run_grpo(tmp_path, tiny_dir, "trainer.steps=1", "eval.before_training=false")
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in recs] == [1] and "eval/accuracy" in recs[0]  # evaluated at the end only


@pytest.mark.slow
def test_a_run_writes_the_samples_it_scored(tmp_path, tiny_dir):
    import json

    recs = run_grpo(tmp_path, tiny_dir, "telemetry.samples_per_step=3", "reward.verifier=user",
                    "reward.user_fn=dataflow_rewards:by_length")
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for r in rows:  # by_length: (len(response) % 3) / 2, no shaping
        assert r["score"] == r["reward"] == (len(r["response"]) % 3) / 2 and "+" in r["prompt"]
        assert 1 <= r["length"] <= 8
    assert len(recs) == 2


@pytest.mark.slow
def test_gpg_trains_with_its_loss(tmp_path, tiny_dir):
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.advantage=gpg", "algorithm.policy_loss=gpg",
                    "algorithm.normalize_std=false", "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length")
    assert [r["step"] for r in recs] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in recs)
    assert "actor/clip_frac" not in recs[0] and recs[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow
def test_gpg_trains_in_mini_batches_without_a_pi_old_pass(tmp_path, tiny_dir):
    recs = run_grpo(tmp_path, tiny_dir, "algorithm.advantage=gpg", "algorithm.policy_loss=gpg",
                    "trainer.mini_batches=2", "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length")
    assert [r["step"] for r in recs] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in recs)
    assert not any("timing/old_logprob_s" in r for r in recs)
