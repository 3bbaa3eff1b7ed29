"""trainer.tri_model (Periodic Asynchrony §4.1): a GRPO step whose reference log-probs come from the actor's own
frozen copy, inside the update's micro-steps, equals the step with a separate reference group."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.workflows.pipeline import GRPOPipeline

pytestmark = pytest.mark.slow


def one_step(run_dir, *over: str):
    cfg = load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=2", "eval.size=8", "data.prompts_per_step=4", "rollout.n=4",
        "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
        "engine.optim.eps=1e-3", "algorithm.kl_coef=0.05", *over])
    wf = GRPOPipeline(cfg)
    try:
        wf.begin()
        wf.step(1)
        metrics = wf.step(2)  # the policy has moved: the KL term and its gradient are not zero
        weights = {k: v.detach().clone() for k, v in wf.actor.one("named_weights")}
        return wf.ref, metrics, weights
    finally:
        wf.shutdown()


def test_tri_model_step_equals_the_separate_reference_step(tmp_path):
    ref, m_sep, w_sep = one_step(tmp_path / "separate")
    none, m_tri, w_tri = one_step(tmp_path / "tri", "trainer.tri_model=true")
    assert ref is not None and none is None  # no reference group in the tri-model run
    assert m_tri["trimodel/separate_passes_saved"] >= 1 and m_sep["actor/ref_kl_k1"] > 1e-6
    torch.testing.assert_close(m_tri["actor/ref_kl_k1"], m_sep["actor/ref_kl_k1"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m_tri["actor/loss"], m_sep["actor/loss"], rtol=1e-5, atol=1e-7)
    for k in w_sep:
        torch.testing.assert_close(w_tri[k], w_sep[k], rtol=1e-5, atol=1e-6, msg=k)
