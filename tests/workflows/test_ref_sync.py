"""trainer.ref_sync_every: the reference moved toward the policy (TR-DPO, ProRL's reset) in GRPO (a reference
group or the tri-model copy) and DPO, checkpointed with the run."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from relayrl.engines.training import fsdp
from relayrl.models.load import load_model

from grpo_runs import run_grpo


def test_mix_weights_is_a_lerp_of_every_parameter_and_keeps_tied_weights_tied(tiny_dir):
    ref, policy = load_model(tiny_dir), load_model(tiny_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    fsdp.mix_weights(ref, policy.named_parameters(), 0.25)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p, 0.75 * before[n] + 0.25 * dict(policy.named_parameters())[n])
    if ref.config.tie_word_embeddings:
        assert ref.lm_head.weight is ref.model.embed_tokens.weight
    fsdp.mix_weights(ref, policy.named_parameters(), 1.0)  # ProRL's reset: the policy itself
    for (n, p), (_, q) in zip(ref.named_parameters(), policy.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="the source lacks 1 of the model's parameters"):
        fsdp.mix_weights(ref, [(n, p) for n, p in policy.named_parameters()][1:], 0.5)


def test_config_refusals():
    from relayrl.config.schema import Config

    for over, match in ((dict(trainer={"ref_sync_every": 5}), "algorithm.kl_coef=0 loads none"),
                        (dict(trainer={"ref_sync_alpha": 0.5}), "set trainer.ref_sync_every"),
                        (dict(workflow="sft", trainer={"ref_sync_every": 5}), "workflow sft has none"),
                        (dict(trainer={"ref_sync_every": 5}, algorithm={"kl_coef": 0.1},
                              model={"lora": {"enabled": True}}), "base model under the adapters")):
        with pytest.raises(ValidationError, match=match):
            Config.model_validate(over)
    assert Config.model_validate(dict(workflow="dpo", trainer={"ref_sync_every": 5})).trainer.ref_sync_alpha == 0.6


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]


def _grpo(run_dir, student, *over: str) -> list[dict]:
    return run_grpo(run_dir, student, "engine.optim.lr=1e-2", "algorithm.kl_coef=0.1", "reward.verifier=user",
                    "reward.user_fn=dataflow_rewards:by_length", *over)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["trainer.tri_model=true"], ["trainer.offload=true"],
                                    ["trainer.off_policy_steps=1"]],
                         ids=["reference-group", "tri-model", "offload", "off-policy"])
def test_a_reset_reference_equals_the_policy_at_the_next_step(tmp_path, tiny_dir, layout):
    """alpha=1 after step 1: step 2's first (on-policy) pass meets a reference equal to the policy, KL 0 to the
    last bit; without the sync the policy has moved away from its start (KL > 0)."""
    synced = _grpo(tmp_path / "synced", tiny_dir, "trainer.ref_sync_every=1", "trainer.ref_sync_alpha=1.0", *layout)
    plain = _grpo(tmp_path / "plain", tiny_dir, *layout)
    assert [r.get("reference/synced") for r in synced] == [1.0, 1.0] and "reference/synced" not in plain[0]
    assert synced[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(plain[1]["actor/kl"]) > 1e-4
    assert synced[0]["actor/kl"] == pytest.approx(plain[0]["actor/kl"], abs=1e-7)  # step 1: the same start


@pytest.mark.slow
def test_a_soft_sync_survives_a_resume(tmp_path, tiny_dir):
    """alpha=0.5 every 2 steps: a run cut after step 2 and resumed has step 3 and 4's KL of the whole run
    (the reference's mixed weights come back from the checkpoint)."""
    common = ["trainer.ref_sync_every=2", "trainer.ref_sync_alpha=0.5", "run.save_every=2"]
    whole = _grpo(tmp_path / "whole", tiny_dir, "trainer.steps=4", *common)
    _grpo(tmp_path / "cut", tiny_dir, "trainer.steps=2", *common)
    resumed = _grpo(tmp_path / "cut", tiny_dir, "trainer.steps=4", "run.resume=auto", *common)
    kl = {r["step"]: r["actor/kl"] for r in whole}
    assert {r["step"]: r["actor/kl"] for r in resumed if r["step"] > 2} == pytest.approx({3: kl[3], 4: kl[4]},
                                                                                       rel=1e-5, abs=1e-9)
    assert abs(kl[3]) > 1e-4  # (the mix is half way: the policy and the reference differ)


@pytest.mark.slow
def test_dpo_with_a_reset_reference_has_zero_margin_at_the_next_step(tmp_path, tiny_dir):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.dpo import train_dpo

    def run(run_dir, *over):
        cfg = load_config(Config, "recipes/arith_dpo.yaml", [
            f"run.dir={run_dir}", "trainer.steps=2", "trainer.batch_size=4", "eval.size=4", "eval.every=0",
            "telemetry.sinks=[jsonl]", "run.save_every=0", f"trainer.init_from={tiny_dir}", "engine.optim.lr=1e-2",
            "engine.optim.warmup_steps=0", *over])
        train_dpo(cfg)
        return _records(run_dir)

    synced = run(tmp_path / "synced", "trainer.ref_sync_every=1", "trainer.ref_sync_alpha=1.0")
    plain = run(tmp_path / "plain")
    # step 2 meets a reference equal to the policy: every implicit reward beta (log pi - log pi_ref) is 0
    for key in ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/reward_margin"):
        assert synced[1][key] == pytest.approx(0.0, abs=1e-6), key
    assert synced[1]["reference/synced"] == 1.0
    assert abs(plain[1]["dpo/reward_margin"]) > 1e-4  # without the sync the policy has left its reference
