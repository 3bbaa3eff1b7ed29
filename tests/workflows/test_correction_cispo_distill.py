"""Issue 34 in the step: the rollout correction and CISPO inside the policy loss, on-policy distillation in
the advantages and as a role of the plan, their config refusals, and end-to-end runs in every step mode."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from relayrl.algorithms.correction import Correction
from relayrl.engines.training.base import MicroBatch
from relayrl.workflows.losses import PolicyLoss

from grpo_runs import recipe_cfg, refused, run_grpo


def _mb(logprobs, old, gen, adv):
    mask = torch.ones_like(logprobs)
    fields = {"gen_logprobs": gen, "advantages": adv, **({} if old is None else {"old_logprobs": old})}
    return MicroBatch(logprobs, mask, fields, int(mask.sum()), logprobs.shape[0], None)


LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
GEN = LP - torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.0, -0.1]])  # pi_old / mu = e^1 on token (0, 1)


def test_policy_loss_masks_with_the_correction_and_reports_it():
    lp = LP.clone().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask_mode = Correction(level="token", mode="mask", high=2.0)  # IcePop: token (0, 1) dropped
    loss, m = PolicyLoss(agg="token-mean", correction=mask_mode)(_mb(lp, None, GEN, adv))
    loss.backward()
    assert lp.grad[0, 1] == 0 and (lp.grad[0, [0, 2]] != 0).all()
    assert m["correction/token_masked_frac"] == pytest.approx(1 / 6)
    assert m["correction/ratio_max"] == pytest.approx(torch.e, rel=1e-6)
    # DeepSeek-V3.2 with k3: row 0 has mean KL (0 + e - 2 + 0) / 3 = 0.24 > 0.1, row 1 0.009: row 0's
    # negative-advantage tokens are dropped, its positive one and row 1 kept
    lp2 = LP.clone().requires_grad_()
    adv2 = torch.tensor([[-1.0, 1.0, -1.0], [-1.0, -1.0, -1.0]])
    kl = Correction(level=None, kl_threshold=0.1, kl_kind="k3", negative_only=True)
    loss, m = PolicyLoss(agg="token-mean", correction=kl)(_mb(lp2, None, GEN, adv2))
    loss.backward()
    assert lp2.grad[0, 0] == 0 and lp2.grad[0, 2] == 0 and lp2.grad[0, 1] != 0 and (lp2.grad[1] != 0).all()
    assert m["correction/kl_masked_frac"] == pytest.approx(2 / 6) and m["correction/seq_masked_frac"] == 0


def test_cispo_in_the_policy_loss_keeps_the_clipped_tokens_gradient():
    old = LP - torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])  # ratio e^0.5 on token (0, 1)
    adv = torch.ones(2, 3)
    grads = {}
    for kind in ("ppo", "cispo"):
        lp = LP.clone().requires_grad_()
        PolicyLoss(agg="token-mean", kind=kind, clip_high=0.28)(_mb(lp, old, GEN, adv))[0].backward()
        grads[kind] = lp.grad
    assert grads["ppo"][0, 1] == 0  # PPO: clipped away
    assert grads["cispo"][0, 1] == pytest.approx(-1.28 / 6)  # CISPO: -clip(r) * A / tokens
    torch.testing.assert_close(grads["cispo"][1], grads["ppo"][1])  # ratio 1: the same gradient


def test_advantage_rows_distill_from_the_teacher():
    from relayrl.config.schema import AlgorithmConfig
    from relayrl.workflows.estimate import advantage_rows

    gen = [torch.tensor([-1.0, -0.5]), torch.tensor([-0.2, -1.5, -0.1])]
    teacher = [torch.tensor([-0.5, -0.5]), torch.tensor([-0.1, -0.5, -0.1])]
    a = AlgorithmConfig()
    object.__setattr__(a, "distill", a.distill.model_construct(teacher="t", coef=1.0, reward_weight=0.0))
    out, m = advantage_rows(a, torch.tensor([1.0, 0.0]), [2, 3], torch.tensor([0, 0]), gen_logprobs=gen,
                            teacher_logprobs=teacher)
    torch.testing.assert_close(out["advantages"][0], torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(out["advantages"][1], torch.tensor([0.1, 1.0, 0.0]))
    assert m["distill/reverse_kl"] == pytest.approx((-0.5 + 0 - 0.1 - 1.0 + 0) / 5, abs=1e-6)
    # mixed with GRPO's advantages (+-0.7071 for rewards 1, 0 in one group of two)
    object.__setattr__(a, "distill", a.distill.model_construct(teacher="t", coef=1.0, reward_weight=1.0))
    out, _ = advantage_rows(a, torch.tensor([1.0, 0.0]), [2, 3], torch.tensor([0, 0]), gen_logprobs=gen,
                            teacher_logprobs=teacher)
    g = 1 / 2 ** 0.5
    torch.testing.assert_close(out["advantages"][0], torch.tensor([0.5 + g, g]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out["advantages"][1], torch.tensor([0.1 - g, 1.0 - g, -g]), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------ config and plan
def test_config_refusals_name_the_key():
    assert "drop algorithm.tis_cap" in refused("algorithm.tis_cap=2", "algorithm.correction.level=token")
    assert "algorithm.correction.low" in refused("algorithm.correction.level=token", "algorithm.correction.low=0.5")
    assert "algorithm.correction.level" in refused("algorithm.correction.high=3")
    assert "kl_threshold" in refused("algorithm.correction.negative_only=true")
    assert "set algorithm.correction.kl_threshold (e.g. 0.1) or drop kl_reduce" in refused(
        "algorithm.correction.kl_reduce=token")
    spec = recipe_cfg("algorithm.correction.kl_threshold=0.2", "algorithm.correction.kl_kind=k2",
                      "algorithm.correction.kl_reduce=max").algorithm.rollout_correction()
    assert (spec.kl_kind, spec.kl_reduce, spec.kl_threshold, spec.level) == ("k2", "max", 0.2, None)
    assert "old_logprobs=auto" in refused("algorithm.correction.kl_threshold=0.1", "algorithm.old_logprobs=rollout")
    assert "ratio_level=token" in refused("algorithm.policy_loss=cispo", "algorithm.ratio_level=sequence")
    assert "drop algorithm.dual_clip" in refused("algorithm.policy_loss=cispo", "algorithm.dual_clip=3")
    assert "not a model directory" in refused("algorithm.distill.teacher=/nonexistent/teacher")
    assert "placement.teacher" in refused("placement.teacher=gpu9")


def test_plan_places_the_teacher_and_says_what_tis_cap_runs(tiny_dir):
    from relayrl.config.plan import step_plan

    plan = step_plan(recipe_cfg(f"algorithm.distill.teacher={tiny_dir}", "rollout.n=1"))  # pure distillation: n=1 ok
    assert plan.roles == ("actor", "rollout", "teacher") and plan.pools["teacher"] == "main"
    plan = step_plan(recipe_cfg("algorithm.tis_cap=1.5"))
    assert any("correction.level=token, mode=truncate, high=1.5" in n for n in plan.notes)
    assert recipe_cfg("algorithm.tis_cap=1.5").algorithm.rollout_correction() == Correction(high=1.5)
    with pytest.raises((ValidationError, ValueError), match="workflow grpo"):
        recipe_cfg(f"algorithm.distill.teacher={tiny_dir}", "workflow=sft")


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    [],  # sync, colocated
    ["trainer.mode=periodic", "placement.pools={gen: 1}", "placement.rollout=gen"],
    # (3 steps: with k=1 batch 2 may be sampled wholly by the starting weights; batch 3 never is)
    ["trainer.off_policy_steps=1", "rollout.partial=true", "trainer.steps=3"],
], ids=["sync", "periodic", "offpolicy-partial"])
def test_distillation_with_corrections_runs_in_every_step_mode(tmp_path, tiny_dir, mode):
    """The teacher is the student's own starting model: the reverse KL of the first batch is 0 (the rollout's
    log-probs and the teacher's pass agree token by token), later ones not (the student moved), and the run
    carries the correction's and distillation's metrics in every mode."""
    recs = run_grpo(tmp_path, tiny_dir, f"algorithm.distill.teacher={tiny_dir}", "algorithm.distill.reward_weight=0.5",
                "algorithm.policy_loss=cispo", "algorithm.correction.level=sequence",
                "algorithm.correction.mode=mask", "algorithm.correction.kl_threshold=0.5", *mode)
    assert [r["step"] for r in recs] == [1, 2, 3][:len(recs)] and len(recs) >= 2
    first = recs[0]
    assert abs(first["distill/reverse_kl"]) < 1e-3  # the same weights: log pi_s == log pi_t per token
    for r in recs:
        assert {"correction/weight_mean", "correction/kl_k3", "correction/seq_masked_frac"} <= set(r)
        assert r["dock/driver_bytes"] == 0
    assert recs[-1]["distill/reverse_kl"] != first["distill/reverse_kl"]  # the student moved away


@pytest.mark.slow
def test_distillation_with_offload_keeps_the_teacher_off_the_device_when_idle(tmp_path, tiny_dir):
    recs = run_grpo(tmp_path, tiny_dir, f"algorithm.distill.teacher={tiny_dir}", "trainer.offload=true")
    assert all("timing/offload_s" in r and "distill/reverse_kl" in r for r in recs)


@pytest.mark.slow
def test_each_item_runs_from_the_cli(tmp_path, tiny_dir):
    """``relayrl train`` with CISPO, the correction family and a teacher (k=2 off-policy): the run ends, says
    how it corrects, and its metrics carry all three."""
    from e2e_cli import FAST, records, relayrl

    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path}",
                f"trainer.init_from={tiny_dir}", "data.prompts_per_step=2", "rollout.n=4", "trainer.off_policy_steps=2",
                "algorithm.policy_loss=cispo", "algorithm.tis_cap=2.0", f"algorithm.distill.teacher={tiny_dir}",
                "algorithm.distill.reward_weight=1.0", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "algorithm.tis_cap=2.0 runs as algorithm.correction.level=token" in r.stdout
    last = records(tmp_path)[-1]
    assert {"correction/token_capped_frac", "distill/reverse_kl", "actor/clip_frac_high"} <= set(last)


def test_advantage_metrics_of_a_step_are_row_weighted_over_its_calls():
    from relayrl.workflows.step_metrics import weighted

    calls = {"distill/reverse_kl": [(0.5, 4), (0.1, 12)], "distill/reverse_kl_seq_max": [(0.9, 4), (0.3, 12)]}
    assert weighted(calls) == {"distill/reverse_kl": pytest.approx((2.0 + 1.2) / 16), "distill/reverse_kl_seq_max": 0.9}
