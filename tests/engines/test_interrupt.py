"""Forced length interruption on the native engine (relayrl.engines.generation.interrupt): the phrase's ids land
exactly at the thinking budget with loss_mask 0, the answer is the model's continuation and stays within its
budget, and responses that ended earlier or closed their thinking are what plain generation gives."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.interrupt import InterruptError, build_interrupt, generate_interrupted
from relayrl.engines.generation.native import NativeGenerationEngine

PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "countdown 3 7 5 -> 9 :", "9+9="]
AFTER, MAX_NEW = 4, 16


def _ids(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def _interrupt(tok, marker="</think>", answer=None, max_new=MAX_NEW):
    return build_interrupt(tok, after_tokens=AFTER, text="answer =", answer_tokens=answer, marker=marker,
                           max_new_tokens=max_new)


def _greedy(model, tok, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def test_the_phrase_lands_at_the_budget_and_the_answer_is_the_models(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    eng = NativeGenerationEngine(tiny_model, tok, max_batch=3)  # rows leave and re-enter a running batch
    prompts = _ids(tok, PROMPTS)
    it = _interrupt(tok, answer=5)
    P = len(it.forced_ids)
    first = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1))
    stops = (int(first[1].token_ids[0]),)  # a response that ends at its first token (the tiny model rarely ends)
    plain = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=AFTER, stop_token_ids=stops))
    got = generate_interrupted(eng, prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                                            stop_token_ids=stops), it)
    assert [(c.prompt_index, c.sample_index) for c in got] == [(i, 0) for i in range(len(PROMPTS))]
    assert sorted({c.finish_reason for c in plain}) == ["length", "stop"]
    for p, c, g in zip(prompts, plain, got):
        ids = g.token_ids.tolist()
        if c.finish_reason == "stop":  # ended before the budget: untouched
            assert ids == c.token_ids.tolist() and not g.interrupted
            assert g.loss_mask.tolist() == [1.0] * len(ids)
            continue
        assert g.interrupted
        assert ids[:AFTER] == c.token_ids.tolist()
        assert tuple(ids[AFTER:AFTER + P]) == it.forced_ids
        answer = ids[AFTER + P:]
        assert 1 <= len(answer) <= 5
        assert answer == _greedy(tiny_model, tok, p + ids[:AFTER + P], 5)[:len(answer)]
        assert g.loss_mask.tolist() == [1.0] * AFTER + [0.0] * P + [1.0] * len(answer)
        assert g.logprobs[AFTER:AFTER + P].abs().sum() == 0
        assert g.finish_reason == ("stop" if answer[-1] in (tok.eos_token_id, *stops) else "length")
        assert g.text == tok.decode(ids, skip_special_tokens=True)


def test_sampled_logprobs_match_a_forward_over_the_whole_response(tiny_model, tiny_tokenizer):
    """What rollout/logprob_error compares: the sampler's log-probs of the model's tokens, the phrase in context."""
    tok = tiny_tokenizer
    eng = NativeGenerationEngine(tiny_model, tok, max_batch=4)
    prompts = _ids(tok, PROMPTS[:3])
    got = generate_interrupted(eng, prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=MAX_NEW),
                               _interrupt(tok), generator=torch.Generator().manual_seed(0))
    assert [(c.prompt_index, c.sample_index) for c in got] == [(i, s) for i in range(3) for s in range(2)]
    assert any(c.interrupted for c in got)
    for c in got:
        p = prompts[c.prompt_index]
        assert len(c.token_ids) <= MAX_NEW
        with torch.no_grad():
            logits = tiny_model(torch.tensor([p + c.token_ids.tolist()])).logits[0, len(p) - 1:-1] / 0.8
        ref = torch.log_softmax(logits.float(), -1).gather(-1, c.token_ids[:, None]).squeeze(-1)
        keep = c.loss_mask.bool()
        torch.testing.assert_close(c.logprobs[keep], ref[keep], atol=1e-4, rtol=1e-4)


def test_a_response_that_closed_its_thinking_goes_on_to_the_usual_limit(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    eng = NativeGenerationEngine(tiny_model, tok)
    prompts = _ids(tok, PROMPTS)
    full = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    row = next(i for i, c in enumerate(full) if c.finish_reason == "length")
    marker = tok.decode(full[row].token_ids[1:3].tolist(), skip_special_tokens=False)  # "closed" within the budget
    got = generate_interrupted(eng, prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                               _interrupt(tok, marker=marker))
    assert not got[row].interrupted
    assert got[row].token_ids.tolist() == full[row].token_ids.tolist()  # greedy: the same as never stopping
    assert got[row].loss_mask.tolist() == [1.0] * MAX_NEW and got[row].finish_reason == "length"


def test_budgets_that_do_not_fit_are_refused_naming_the_keys(tiny_tokenizer):
    with pytest.raises(InterruptError, match=r"rollout.max_new_tokens=8.*raise rollout.max_new_tokens to at least"):
        _interrupt(tiny_tokenizer, answer=4, max_new=8)
    with pytest.raises(InterruptError, match="eval.max_new_tokens=6"):
        build_interrupt(tiny_tokenizer, after_tokens=4, text="answer =", answer_tokens=None, marker="</think>",
                        max_new_tokens=6, budget_key="eval.max_new_tokens")
    it = _interrupt(tiny_tokenizer)  # null answer_tokens: what the response budget leaves
    assert it.after_tokens + len(it.forced_ids) + it.answer_tokens == MAX_NEW


@pytest.mark.slow  # (the static decoder's set-up: about 9 s on CPU)
def test_an_engine_with_the_static_decoder_runs_interrupted_rows_on_its_dynamic_cache(tiny_model, tiny_tokenizer):
    """rollout.decode=static (graphed on CUDA, plain here): fed rows, and so interrupted ones, decode on the dynamic
    cache; the rows are the dynamic engine's."""
    tok = tiny_tokenizer
    prompts = _ids(tok, PROMPTS)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    rows = []
    for decode in ("static", "dynamic"):
        eng = NativeGenerationEngine(tiny_model, tok, max_batch=4, decode=decode)
        assert (eng.static is not None) == (decode == "static")
        got = generate_interrupted(eng, prompts, sp, _interrupt(tok), generator=torch.Generator().manual_seed(2))
        rows.append([(c.token_ids.tolist(), c.loss_mask.tolist()) for c in got])
    assert rows[0] == rows[1]


def test_an_engine_that_cannot_take_rows_back_is_refused_naming_the_key(tiny_tokenizer):
    class Server:  # generate only, as the openai engine (which the config refuses first)
        tokenizer = tiny_tokenizer

        def generate(self, prompts, params, generator=None):
            raise AssertionError("not reached")

    with pytest.raises(InterruptError, match="Server cannot do: use rollout.engine=native or vllm"):
        generate_interrupted(Server(), [[1, 2]], SamplingParams(max_new_tokens=MAX_NEW), _interrupt(tiny_tokenizer))
