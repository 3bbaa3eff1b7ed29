"""min-p and the repetition penalty: the sampler against transformers' logits processors, both decode paths
against Hugging Face ``generate``, and the log-probs kept (the unfiltered policy's)."""

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper)

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.generation.sampling import penalize, sample_with, seen_mask


def _logits(B: int, V: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalty_is_transformers_repetition_penalty():
    logits = _logits(4, 50)
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    got = penalize(logits, seen_mask(ids.tolist(), 50, "cpu"), 1.7)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)  # it changed something


def test_seen_mask_marks_each_context_token_once():
    m = seen_mask([[1, 3, 3], [], [0]], 5, "cpu")
    assert m.tolist() == [[False, True, False, True, False], [False] * 5, [True, False, False, False, False]]


@pytest.mark.parametrize("min_p,top_k,penalty", [(0.05, 0, 1.0), (0.2, 0, 1.5), (0.02, 40, 1.3)])
def test_draws_follow_the_distribution_transformers_samples_from(min_p, top_k, penalty):
    """An evenly spaced grid of uniforms lands on each token in proportion to its probability under
    transformers' chain (penalty, temperature, top-k, min-p); the kept log-probs are the plain policy's."""
    V, n, T = 300, 20000, 0.8
    logits = _logits(1, V, seed=3)
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(4))
    chain = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    chain += [TemperatureLogitsWarper(T)] + ([TopKLogitsWarper(top_k)] if top_k else []) + [MinPLogitsWarper(min_p)]
    want = torch.softmax(LogitsProcessorList(chain)(ids, logits.clone()).double(), -1)[0] * n
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    seen = seen_mask(ids.tolist(), V, "cpu").expand(n, -1)
    tok, logp = sample_with(logits.expand(n, -1), T, top_k, 1.0, u, min_p=min_p, penalty=penalty, seen=seen)
    counts = torch.bincount(tok, minlength=V).double()
    assert (counts - want).abs().max() <= 1.0
    assert (counts > 0).sum() < V // 2  # the filters did cut the support
    torch.testing.assert_close(logp, torch.log_softmax(logits / T, -1)[0, tok])  # before the filters


def test_min_p_comes_after_top_p_as_in_transformers_not_before_as_in_vllm():
    """p = [0.5, 0.3, 0.2], top_p=0.6, min_p=0.5. Hugging Face's order (top-p, then min-p), the native engine's:
    top-p keeps {0, 1} (token 1 crosses 0.6), min-p (>= 0.25) keeps both: token 1 drawn 3/8 of the time. vLLM's
    order (min-p, then top-p on the renormalised [0.625, 0.375]) would keep token 0 alone. (docs/engines.md,
    "Same keys, same meaning": it matters behind rollout.engine=openai on vllm serve; rollout.engine=vllm refuses
    min_p with top_p < 1.)"""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    n = 8000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tok, _ = sample_with(logits.expand(n, -1), 1.0, 0, 0.6, u, min_p=0.5)
    counts = torch.bincount(tok, minlength=3).tolist()
    assert counts == [5000, 3000, 0]


def test_penalty_without_seen_tokens_is_refused():
    with pytest.raises(ValueError, match="seen"):
        sample_with(_logits(2, 10), 1.0, 0, 1.0, torch.rand(2, dtype=torch.float64), penalty=1.2)


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-9])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p):
    """top_p=1e-300 is 0 once compared with float32 probabilities: every token, the most likely one too, was
    dropped, the softmax of all -inf was NaN and inverse_cdf raised an index error (in relayrl serve the
    generation loop stopped for every client)."""
    logits = _logits(3, 300)
    u = torch.rand(3, dtype=torch.float64)
    tok, lp = sample_with(logits, 1.0, 0, top_p, u)
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)


def test_sampling_params_bounds():
    with pytest.raises(ValueError):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0.0)
    # (logits / 1e-300 are inf in float32: the sampler's softmax gave NaN and inverse_cdf an index error)
    with pytest.raises(ValueError, match="temperature=1e-300 is below 1e-05"):
        SamplingParams(temperature=1e-300)
    with pytest.raises(ValueError, match="repetition_penalty=1e-40 is below 1e-05"):
        SamplingParams(repetition_penalty=1e-40)
    assert SamplingParams(temperature=1e-5, repetition_penalty=1e-5).temperature == 1e-5
    # (a seen logit of -4 times 1e38 is -inf in float32: a row whose tokens were all seen sampled from NaN)
    with pytest.raises(ValueError, match=r"repetition_penalty=1e\+38 is above 100000"):
        SamplingParams(repetition_penalty=1e38)
    with pytest.raises(ValueError, match="repetition_penalty=inf is above"):
        SamplingParams(repetition_penalty=float("inf"))
    assert SamplingParams(repetition_penalty=1e5).repetition_penalty == 1e5


@pytest.mark.parametrize("penalty", [1e5, 1e38, 3.4e38])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_a_finite_penalty_never_makes_nan_even_past_the_checked_bound(penalty, temperature):
    """``sample_with`` takes plain floats (the static decoder records it): a penalty past MAX_PENALTY reaches
    it around SamplingParams' check. Every token seen, every logit below -4: times 1e38 each was -inf, the
    row's softmax NaN, and inverse_cdf raised an index error (greedy: token 0 whatever the logits)."""
    logits = -torch.rand(4, 300, generator=torch.Generator().manual_seed(3)) * 10 - 4
    seen = torch.ones(4, 300, dtype=torch.bool)
    got = penalize(logits, seen, penalty)
    assert torch.isfinite(got).all() and torch.isfinite(got / 1e-5).all()
    for top_k, top_p in [(0, 1.0), (5, 0.9)]:
        tok, lp = sample_with(logits, temperature, top_k, top_p, torch.rand(4, dtype=torch.float64), penalty=penalty,
                              seen=seen)
        assert ((tok >= 0) & (tok < 300)).all() and torch.isfinite(lp).all()
    if penalty == 1e5:  # (inside the bound the penalty keeps the logits' order: greedy is the least negative)
        tok, _ = sample_with(logits, 0.0, 0, 1.0, None, penalty=penalty, seen=seen)
        assert tok.tolist() == logits.argmax(-1).tolist()


PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "9+9=", "3+3+3=", "countdown 3 7 5 -> 9 :"]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_greedy_with_a_repetition_penalty_is_hf_generate(tiny_model, tiny_tokenizer, decode):
    """Greedy decoding with a penalty gives Hugging Face's tokens, prompt by prompt, on both decode paths, with
    rows leaving and joining the batch (max_batch 2); the log-probs kept are the unpenalised model's."""
    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=2, decode=decode)
    assert (eng.static is not None) == (decode == "static")
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, repetition_penalty=1.8, ignore_eos=True)
    outs = eng.generate(prompts, params)
    plain = eng.generate(prompts, params.model_copy(update={"repetition_penalty": 1.0}))
    assert any(a.token_ids.tolist() != b.token_ids.tolist() for a, b in zip(outs, plain))  # the penalty acted
    for p, o in zip(prompts, outs):
        ref = tiny_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                                  eos_token_id=None, pad_token_id=tiny_tokenizer.pad_token_id)[0, len(p):]
        assert o.token_ids.tolist() == ref.tolist()
        with torch.no_grad():
            logits = tiny_model(torch.tensor([p + o.token_ids.tolist()])).logits[0, len(p) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, o.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(o.logprobs, want, atol=1e-4, rtol=1e-4)


def test_both_decode_paths_sample_the_same_tokens_with_min_p_and_a_penalty(tiny_model, tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    dyn = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=4, decode="dynamic")
    sta = NativeGenerationEngine(other, tiny_tokenizer, max_batch=4, decode="static", decode_chunk=3)
    assert sta.static is not None
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, min_p=0.1, repetition_penalty=1.5)
    a = dyn.generate(prompts, params, torch.Generator().manual_seed(5))
    b = sta.generate(prompts, params, torch.Generator().manual_seed(5))
    assert [c.token_ids.tolist() for c in a] == [c.token_ids.tolist() for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-4, rtol=1e-4)
    base = dyn.generate(prompts, params.model_copy(update={"min_p": 0.0, "repetition_penalty": 1.0}),
                        torch.Generator().manual_seed(5))
    assert [c.token_ids.tolist() for c in a] != [c.token_ids.tolist() for c in base]


def test_the_rollout_config_carries_min_p_and_the_penalty_to_the_sampler():
    from tests.workflows.grpo_runs import recipe_cfg, refused

    sp = recipe_cfg("rollout.min_p=0.05", "rollout.repetition_penalty=1.1", "rollout.top_k=20").rollout.sampling()
    assert (sp.min_p, sp.repetition_penalty, sp.top_k) == (0.05, 1.1, 20)
    assert "rollout.repetition_penalty" in refused("rollout.repetition_penalty=0")
    assert "rollout.min_p" in refused("rollout.min_p=2")
