"""Helpers of the GRPO runs with ``rollout.engine=vllm`` (``test_vllm_grpo*.py``): the tiny shape with heads of
32 dimensions (vLLM's CPU attention has no 16, the other tests' tiny shape), the overrides the files share, and
one run from the session's ``sft32`` model. Each run starts its own vLLM engine (about 15 s on CPU)."""

from __future__ import annotations

from pathlib import Path

from e2e_cli import FAST, records, relayrl
from tests.vllm_cache import KV_CACHE

H32 = [*FAST, "model.tiny.num_heads=2"]
VLLM = ["rollout.engine=vllm", "rollout.vllm.memory_utilization=0.1", KV_CACHE]
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
RAY = ["cluster.backend=ray", "cluster.num_cpus=4"]
TP2 = ["rollout.vllm.tensor_parallel_size=2"]
# The tiny SFT model earns no reward yet: an entropy bonus moves the weights every step anyway, so each
# step's sync is needed for the log-probs to match.
MOVE = ["algorithm.entropy_coef=0.01", "engine.optim.lr=1e-3"]


def grpo(run: Path, model: Path, *extra: str, steps: int = 3, env: dict[str, str] | None = None):
    """A GRPO run of ``steps`` steps on vLLM from ``model``; it must succeed. Returns the process and its records."""
    r = relayrl("train", "recipes/arith_grpo.yaml", f"trainer.steps={steps}", f"run.dir={run}",
                f"trainer.init_from={model}", "data.prompts_per_step=4", "rollout.n=4", *VLLM, *H32, *extra, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, records(run)
