import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine, sample_next

PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "countdown 3 7 5 -> 9 :", "9+9="]


def _ids(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.slow  # (about 0.7 s; the fast set keeps the rest of this file, `make test` runs it)
def test_greedy_matches_hf_generate_across_refills(tiny_model, tiny_tokenizer):
    # max_batch=2 forces rows to leave and new prompts (of other lengths) to join a running cache
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=2)
    prompts = _ids(tiny_tokenizer, PROMPTS)
    outs = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    assert [o.prompt_index for o in outs] == list(range(len(PROMPTS)))
    for p, o in zip(prompts, outs):
        ref = tiny_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=10, do_sample=False, eos_token_id=tiny_tokenizer.eos_token_id,
                                  pad_token_id=tiny_tokenizer.pad_token_id)[0, len(p):].tolist()
        assert o.token_ids.tolist() == ref[: len(o.token_ids)]
        assert o.finish_reason == ("stop" if o.token_ids[-1] == tiny_tokenizer.eos_token_id else "length")


@pytest.mark.slow  # (over half a second; the full make test runs it)
def test_sampled_logprobs_match_a_full_forward(tiny_model, tiny_tokenizer):
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=5)
    prompts = _ids(tiny_tokenizer, PROMPTS)
    outs = eng.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=8),
                        generator=torch.Generator().manual_seed(1))
    assert len(outs) == 3 * len(PROMPTS)
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, s) for i in range(len(PROMPTS)) for s in range(3)]
    for o in outs:
        p = prompts[o.prompt_index]
        with torch.no_grad():
            logits = tiny_model(torch.tensor([p + o.token_ids.tolist()])).logits[0, len(p) - 1:-1] / 0.7
        ref = torch.log_softmax(logits.float(), -1).gather(-1, o.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(o.logprobs, ref, atol=1e-4, rtol=1e-4)


def test_same_generator_seed_same_samples(tiny_model, tiny_tokenizer):
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    a = eng.generate(_ids(tiny_tokenizer, PROMPTS[:2]), sp, generator=torch.Generator().manual_seed(3))
    b = eng.generate(_ids(tiny_tokenizer, PROMPTS[:2]), sp, generator=torch.Generator().manual_seed(3))
    assert [x.token_ids.tolist() for x in a] == [x.token_ids.tolist() for x in b]


def test_stop_strings_and_length(tiny_model, tiny_tokenizer):
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    free = eng.generate(_ids(tiny_tokenizer, PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.text[2:4]
    cut = eng.generate(_ids(tiny_tokenizer, PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                         stop_strings=(stop,)))[0]
    assert cut.finish_reason == "stop" and stop in cut.text and len(cut.token_ids) < 12


def test_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, -1.0, 0.5]])
    tok, logp = sample_next(logits, SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_top_p_keeps_only_the_head():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, SamplingParams(top_p=0.6), g)[0]) for _ in range(50)}
    assert seen == {0}


def test_update_weights_in_place_and_errors(tiny_model, tiny_tokenizer, tiny_dir):
    from relayrl.models.load import load_model

    eng = NativeGenerationEngine(load_model(tiny_dir), tiny_tokenizer)
    eng.update_weights([(n, p.detach()) for n, p in tiny_model.named_parameters()], version=3)
    assert eng.weight_version == 3
    for (n, p), (_, q) in zip(tiny_model.named_parameters(), eng.model.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        eng.update_weights([("nope", torch.zeros(1))], version=4)
    name, p = next(iter(tiny_model.named_parameters()))
    with pytest.raises(ValueError, match="engine shape"):
        eng.update_weights([(name, torch.zeros(3))], version=4)
    assert eng.weight_version == 3


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def _perturbed(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return other


def _teacher_forced(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_partial_rollout_swaps_weights_mid_generation_and_tags_each_token(tiny_model, tiny_tokenizer):
    """Weights change after the 3rd decode step: the tokens before keep the old version and log-probs (the same
    as a run without the swap), the tokens after are sampled by the new weights with the in-flight rows
    prefilled again, and their recorded log-probs are the new model's (teacher-forced)."""
    import copy

    new = _perturbed(tiny_model)
    prompts = _ids(tiny_tokenizer, PROMPTS[:3])
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True)
    plain = NativeGenerationEngine(copy.deepcopy(tiny_model), tiny_tokenizer, max_batch=4).generate(
        prompts, sp, generator=torch.Generator().manual_seed(11))
    eng = NativeGenerationEngine(copy.deepcopy(tiny_model), tiny_tokenizer, max_batch=4)  # 2 prompts at a time
    calls = {"n": 0}

    def between() -> bool:
        calls["n"] += 1
        if calls["n"] == 4:  # three tokens sampled by version 0
            eng.update_weights(list(new.named_parameters()), version=1)
            return True
        return False

    outs = eng.generate(prompts, sp, generator=torch.Generator().manual_seed(11), between=between)
    first = [o for o in outs if o.prompt_index < 2]  # in flight at the swap
    for o, p in zip(outs, plain):
        if o.prompt_index < 2:
            assert o.token_versions.tolist() == [0] * 3 + [1] * 7
            assert o.token_ids[:3].tolist() == p.token_ids[:3].tolist()
            torch.testing.assert_close(o.logprobs[:3], p.logprobs[:3])
        else:  # admitted after the swap: all new weights
            assert o.token_versions.tolist() == [1] * 10
        prompt, toks = prompts[o.prompt_index], o.token_ids.tolist()
        cut = int((o.token_versions == 0).sum())
        torch.testing.assert_close(o.logprobs[:cut], _teacher_forced(tiny_model, prompt, toks, 1.0)[:cut],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(o.logprobs[cut:], _teacher_forced(new, prompt, toks, 1.0)[cut:],
                                   atol=1e-4, rtol=1e-4)
    assert len(first) == 4


def test_without_a_swap_every_token_has_the_engine_version(tiny_model, tiny_tokenizer):
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    eng.update_weights(list(tiny_model.named_parameters()), version=3)
    outs = eng.generate(_ids(tiny_tokenizer, PROMPTS[:2]), SamplingParams(n=2, max_new_tokens=5),
                        generator=torch.Generator().manual_seed(0), between=lambda: False)
    assert all(o.token_versions.tolist() == [3] * len(o.token_ids) and o.weight_version == 3 for o in outs)


def _cache_named_model(model):
    """``model`` as a model class whose forward names the key/value cache ``cache`` (transformers >= 5.24)
    and warns, as 5.24 does, when it is given as ``past_key_values``."""
    import inspect
    import warnings
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    base = type(model)
    inner = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    @dataclass
    class Output(ModelOutput):
        logits: torch.Tensor | None = None
        cache: object | None = None

    class CacheNamed(base):
        def forward(self, *args, cache=None, **kwargs):
            if "past_key_values" in kwargs:
                warnings.warn("`past_key_values` is deprecated. Use `cache` instead.", FutureWarning)
                cache = kwargs.pop("past_key_values")
            out = super().forward(*args, **{inner: cache}, **kwargs)
            return Output(logits=out.logits, cache=out[inner] if inner in out else None)

    model.__class__ = CacheNamed
    return model


@pytest.mark.slow  # (about 1.3 s; the fast set keeps the rest of this file, `make test` runs it)
@pytest.mark.filterwarnings("error")
def test_a_model_that_names_its_cache_cache_gets_it_so(tiny_model, tiny_tokenizer):
    """transformers 5.24 takes the cache as ``cache`` and warns at every call that says ``past_key_values``
    (fails before the engines read the name from the model's forward)."""
    prompts = _ids(tiny_tokenizer, PROMPTS)
    sp = SamplingParams(n=2, temperature=0.7, max_new_tokens=8)
    want = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=3).generate(
        prompts, sp, generator=torch.Generator().manual_seed(1))
    eng = NativeGenerationEngine(_cache_named_model(tiny_model), tiny_tokenizer, max_batch=3)
    got = eng.generate(prompts, sp, generator=torch.Generator().manual_seed(1))
    assert [o.token_ids.tolist() for o in got] == [o.token_ids.tolist() for o in want]
    for a, b in zip(got, want):
        assert torch.equal(a.logprobs, b.logprobs)


def test_a_stop_string_of_many_tokens_stops_the_row(tiny_model, tiny_tokenizer):
    """The tiny tokenizer splits digits (and ``</tool_call>``, 11 tokens): a stop string longer than a fixed
    tail of tokens must still end the row when it completes, not run on to max_new_tokens."""
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    for stop in ("1234567890", "</tool_call>"):
        ids = tiny_tokenizer(f"ab {stop}")["input_ids"]
        assert len(tiny_tokenizer(stop)["input_ids"]) > 8
        params = SamplingParams(max_new_tokens=100, stop_strings=(stop,))
        assert eng.finish_reason(ids, params, set()) == "stop"
        assert eng.finish_reason(ids[:-1], params, set()) is None


def test_the_static_paths_stop_string_scan_ends_a_row_at_the_token_completing_it(tiny_model, tiny_tokenizer):
    """The static decoder reads a chunk of tokens per row (token ``lo + j`` at ``[j]``): a row ends at the new
    token that completes a stop string, keeping the tokens up to it; a row whose tokens complete none goes on,
    and so does a row whose tokens past the device's count would (they were not sampled for it)."""
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    ids = tiny_tokenizer("ab 12 cd", add_special_tokens=False)["input_ids"]
    stop = tiny_tokenizer.decode(ids[3:5])  # (two tokens of the middle)
    params = SamplingParams(max_new_tokens=100, stop_strings=(stop,))
    other = ids[:3] + ids[5:]  # the same row without the stop string's tokens
    held = {0: ids[:2], 1: other[:2], 2: ids[:2]}
    seen = {0: len(ids), 1: len(other), 2: 4}  # (slot 2: the device sampled up to token 4, before the stop ends)
    tokens = [ids[2:], other[2:], ids[2:]]  # each row's chunk, read from token lo=2 on
    assert eng._stop_string_ends([0, 1, 2], held, seen, tokens, 2, params, set()) == {0: (5, "stop")}


def test_a_stop_string_that_is_a_special_token_stops_at_its_id(tiny_model, tiny_tokenizer):
    """Responses are decoded without special tokens, so a stop string such as ``<|im_end|>`` (the end of a
    ChatML turn, not the tiny tokenizer's EOS) never shows in the text: it stops at the token's id instead."""
    from relayrl.engines.generation.base import special_stop_ids

    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end != tiny_tokenizer.eos_token_id
    assert special_stop_ids(tiny_tokenizer, ("<|im_end|>", "=", "<|im_end|> ")) == {end}
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    assert eng.stop_ids(SamplingParams(stop_strings=("<|im_end|>",))) == {tiny_tokenizer.eos_token_id, end}
    assert eng.stop_ids(SamplingParams()) == {tiny_tokenizer.eos_token_id}


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_an_eos_id_of_the_generation_config_stops_the_row(tiny_model, tiny_tokenizer, eos_listed, decode):
    """Instruct checkpoints list more end-of-sequence ids in generation_config.json than the tokenizer's EOS
    (Qwen2.5-Instruct's ``[<|im_end|>, <|endoftext|>]``); Hugging Face ``generate`` stops at each of them, and so
    do both decode paths: the row ends there, the id kept, with finish_reason ``stop``."""
    from relayrl.models.load import load_model

    prompt = _ids(tiny_tokenizer, PROMPTS[:1])
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = NativeGenerationEngine(tiny_model, tiny_tokenizer, decode=decode).generate(prompt, sp)[0].token_ids.tolist()
    assert tiny_tokenizer.eos_token_id not in free
    end = free[3]
    eng = NativeGenerationEngine(load_model(eos_listed(tiny_model, tiny_tokenizer, end)), tiny_tokenizer, decode=decode)
    assert eng.stop_ids(sp) == {tiny_tokenizer.eos_token_id, end}
    assert eng.stop_ids(sp.model_copy(update={"ignore_eos": True})) == set()
    cut = eng.generate(prompt, sp)[0]
    assert cut.token_ids.tolist() == free[:free.index(end) + 1] and cut.finish_reason == "stop"
    ref = eng.model.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False)[0, len(prompt[0]):]
    assert ref.tolist() == cut.token_ids.tolist()  # (HF generate stops there too)
