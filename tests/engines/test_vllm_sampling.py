"""Every sampling and rollout key means the same to the vLLM engine as to the native one, or is refused with
``rollout.engine=vllm`` naming the key (``relayrl/engines/generation/vllm_sampling.py``). No vLLM starts: the
config's checks and the mapping to vLLM's ``SamplingParams`` arguments are pure functions.

Both tables enumerate their model's fields: a key added to ``RolloutConfig`` or ``SamplingParams`` without a case
here (and a line in ``vllm_sampling``'s tables) fails ``test_every_key_has_a_decision``."""

from __future__ import annotations

import pytest

from relayrl.config.schema import Config, RolloutConfig
from relayrl.engines.generation.base import SamplingParams, stop_token_ids
from relayrl.engines.generation.config import vllm_available
from relayrl.engines.generation.config import PLAIN_SAMPLING
from relayrl.engines.generation.vllm_sampling import (OPENAI_ONLY, PROCESSED, RAW, ROLLOUT_KEYS, SAMPLING_KEYS,
                                                      logprobs_mode, sampling_kwargs, sampling_refusal)

pytestmark = pytest.mark.skipif(not vllm_available(), reason="rollout.engine=vllm is validated against an install")

EOS = {2, 7}


class Tok:
    """Just what stop_token_ids reads of a tokenizer: one special token, <|im_end|> (id 9)."""

    all_special_tokens = ["<|im_end|>"]
    added_tokens_decoder: dict = {}

    def convert_tokens_to_ids(self, s: str) -> int:
        return {"<|im_end|>": 9}[s]


def kwargs(params: SamplingParams, budget: int | None = None, seed: int | None = 11, mode: str | None = None) -> dict:
    """What the vLLM engine asks of vLLM for one sample of ``params`` (a fresh row: its whole budget), on an
    engine started for them (``mode``: its logprobs_mode; None: the one a rollout of ``params`` starts with)."""
    return sampling_kwargs(params, max_tokens=params.max_new_tokens if budget is None else budget, seed=seed,
                           stop_ids=stop_token_ids(params, EOS, Tok()), mode=mode or logprobs_mode(params))


# ---------------------------------------------------------------- SamplingParams -> vLLM SamplingParams
# field -> (value, the vLLM arguments it gives, or the words of its refusal)
SAMPLING_CASES: dict[str, list[tuple[object, dict | str]]] = {
    "n": [(4, {"n": 1})],  # one request per sample, each its own seed
    "temperature": [(0.7, {"temperature": 0.7}), (0.0, {"temperature": 0.0}), (0.01, {"temperature": 0.01}),
                    (0.005, "temperature=0.005: vLLM raises a temperature below 0.01"),
                    (2.5, "temperatures up to 2")],
    # (at the default temperature, 1: vLLM's raw log-probs are relayrl's; at another, refused: see below)
    "top_p": [(1.0, {"top_p": 1.0}), (0.9, {"top_p": 0.9})],
    "top_k": [(0, {"top_k": 0}), (5, {"top_k": 5})],
    "min_p": [(0.0, {"min_p": 0.0}), (0.1, {"min_p": 0.1})],
    "repetition_penalty": [(1.0, {"repetition_penalty": 1.0}), (1.2, {"repetition_penalty": 1.2})],
    "max_new_tokens": [(32, {"max_tokens": 32})],
    # relayrl checks stop strings itself (vLLM has no tokenizer); a special token's is a stop id
    "stop_strings": [(("ab",), {"stop_token_ids": [2, 7]}), (("<|im_end|>",), {"stop_token_ids": [2, 7, 9]})],
    "stop_token_ids": [((5, 7), {"stop_token_ids": [2, 5, 7]})],
    "ignore_eos": [(True, {"stop_token_ids": [], "ignore_eos": True}),
                   (False, {"stop_token_ids": [2, 7], "ignore_eos": True})],
    # (the sampled token's log-prob is asked either way; False lifts only the log-prob refusals: see below)
    "logprobs": [(True, {"logprobs": 0}), (False, {"logprobs": 0})],
}


@pytest.mark.parametrize("field,value,want", [(f, v, w) for f, cases in SAMPLING_CASES.items() for v, w in cases])
def test_each_sampling_field_maps_or_is_refused(field, value, want):
    params = SamplingParams(**{field: value}, **({"n": 1} if field == "temperature" and value == 0.0 else {}))
    if isinstance(want, str):
        with pytest.raises(ValueError, match="the vLLM engine: ") as info:
            kwargs(params)
        assert want in str(info.value)
        return
    got = kwargs(params)
    assert {k: got[k] for k in want} == want
    # what every request asks whatever the field: the sampled token's log-prob, token ids out, stop strings not
    # vLLM's (no 'stop' key: relayrl checks them), every other filter off
    assert got["logprobs"] == 0 and got["detokenize"] is False and "stop" not in got and got["seed"] == 11
    assert got["ignore_eos"] is True and {k: got[k] for k in PLAIN_SAMPLING if k != field} == {
        k: v for k, v in PLAIN_SAMPLING.items() if k != field}


def test_a_resubmitted_row_asks_for_what_its_budget_has_left():
    """(partial rollout, a thinking budget: a row re-enters with its tokens so far)"""
    assert kwargs(SamplingParams(max_new_tokens=32), budget=5)["max_tokens"] == 5
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        kwargs(SamplingParams(max_new_tokens=32), budget=0)


# ---------------------------------------------------------------- the rollout section with rollout.engine=vllm
BASE = {"model": {"device": "cpu"}, "rollout": {"engine": "vllm"}}


def cfg(rollout: dict, **sections) -> Config:
    return Config.model_validate({**BASE, **sections, "rollout": {"engine": "vllm", **rollout}})


def engine_arg(key: str):
    """vLLM's start-up argument ``key`` for a config (the rollout worker's arguments, through engine_args)."""
    import torch

    from relayrl.engines.generation.vllm_engine import engine_args

    def get(c: Config):
        r = c.rollout
        return engine_args(r.vllm_spec(), torch.device("cpu"), dtype=r.dtype or c.model.dtype, seed=c.run.seed,
                           max_batch=r.max_batch, head_fp32=False)[key]
    return get


def sampled(field: str, value):
    """A check that ``rollout.sampling()`` carries ``field`` into what vLLM is asked."""
    return lambda c: kwargs(c.rollout.sampling())[field] == value


# field -> (its value, a check on the accepted config or the words naming the key in its refusal)
ROLLOUT_CASES: dict[str, tuple[dict, object]] = {
    "n": ({"n": 4}, lambda c: c.rollout.sampling().n == 4 and kwargs(c.rollout.sampling())["n"] == 1),
    "temperature": ({"temperature": 0.005}, "rollout.temperature=0.005"),
    "top_p": ({"top_p": 0.9}, lambda c: sampled("top_p", 0.9)(c) and c.rollout.vllm_logprobs() == RAW),
    "top_k": ({"top_k": -1}, "relayrl's off is rollout.top_k=0"),
    "min_p": ({"min_p": 0.05}, sampled("min_p", 0.05)),
    "repetition_penalty": ({"repetition_penalty": 1.1}, sampled("repetition_penalty", 1.1)),
    "max_new_tokens": ({"max_new_tokens": 24}, sampled("max_tokens", 24)),
    "stop_strings": ({"stop_strings": ["<|im_end|>"]}, sampled("stop_token_ids", [2, 7, 9])),
    "max_batch": ({"max_batch": 12}, lambda c: engine_arg("max_num_seqs")(c) == 12),
    "dtype": ({"dtype": "bfloat16"}, lambda c: engine_arg("dtype")(c) == "bfloat16"),
    "engine": ({}, lambda c: c.rollout.vllm_spec() is not None),
    "vllm": ({"vllm": {"memory_utilization": 0.2}}, lambda c: engine_arg("gpu_memory_utilization")(c) == 0.2),
    "partial": ({"partial": True}, lambda c: c.rollout.partial),
    "lora_sync": ({"lora_sync": "adapter"}, lambda c: c.rollout.lora_sync == "adapter" and c.model.lora.enabled),
    "interrupt": ({"interrupt": {"after_tokens": 4}}, lambda c: c.rollout.interrupt.enabled),
    "decode": ({"decode": "static"}, "rollout.decode is read by the native engine only"),
    "decode_compile": ({"decode_compile": True}, "rollout.decode_compile is read by the native engine only"),
    "base_url": ({"base_url": "http://h:1/v1"}, "rollout.base_url is read by rollout.engine=openai only"),
    "served_model": ({"served_model": "m"}, "rollout.served_model is read by rollout.engine=openai only"),
    "api_key_env": ({"api_key_env": "K"}, "rollout.api_key_env is read by rollout.engine=openai only"),
    "weight_sync": ({"weight_sync": "none"}, "rollout.weight_sync is read by rollout.engine=openai only"),
    "weight_dir": ({"weight_dir": "/tmp/w"}, "rollout.weight_dir is read by rollout.engine=openai only"),
    "concurrency": ({"concurrency": 4}, "rollout.concurrency is read by rollout.engine=openai only"),
    "timeout_s": ({"timeout_s": 5.0}, "rollout.timeout_s is read by rollout.engine=openai only"),
    "retries": ({"retries": 1}, "rollout.retries is read by rollout.engine=openai only"),
    "on_error": ({"on_error": "drop_group"}, "rollout.on_error=drop_group drops the group"),
}


def reader(field: str) -> dict | None:
    """The rollout section of an engine that does read a key vLLM refuses (None: no engine reads that value)."""
    if field in ("top_k",):  # (-1: verl's and vLLM's spelling of off, refused for every engine)
        return None
    if field in OPENAI_ONLY:
        return {"engine": "openai", "base_url": "http://h:1/v1"}
    return {"engine": "native"}


@pytest.mark.parametrize("field", list(ROLLOUT_CASES))
def test_each_rollout_key_maps_or_is_refused_naming_it(field):
    rollout, want = ROLLOUT_CASES[field]
    if isinstance(want, str):
        with pytest.raises(ValueError) as info:
            cfg(rollout)
        assert want in str(info.value)
        if (other := reader(field)) is not None:  # refused with vLLM, read by the engine it belongs to
            Config.model_validate({"model": {"device": "cpu"}, "rollout": {**rollout, **other}})
        return
    assert want(cfg(rollout, **NEEDS.get(field, {})))


NEEDS = {"partial": {"trainer": {"off_policy_steps": 1}},
         "lora_sync": {"model": {"device": "cpu", "lora": {"enabled": True, "r": 8}}}}
"""The other sections a key is read with (partial rollout: off-policy steps; an adapter sync: LoRA)."""


def test_every_key_has_a_decision():
    """A new rollout or sampling key needs a vLLM decision: a case above and a line in vllm_sampling's tables."""
    assert set(ROLLOUT_CASES) == set(RolloutConfig.model_fields) == set(ROLLOUT_KEYS)
    assert set(SAMPLING_CASES) == set(SamplingParams.model_fields) == set(SAMPLING_KEYS)


def test_the_native_engine_reads_the_same_keys_the_same_way():
    """Where the two engines share a meaning by construction: the native engine's stop ids are the same function's."""
    from relayrl.engines.generation.native import NativeGenerationEngine

    eng = NativeGenerationEngine.__new__(NativeGenerationEngine)
    eng.eos_ids, eng.tokenizer = EOS, Tok()
    for p in (SamplingParams(), SamplingParams(ignore_eos=True, stop_token_ids=(5,)),
              SamplingParams(stop_strings=("<|im_end|>",))):
        assert sorted(eng.stop_ids(p)) == kwargs(p)["stop_token_ids"]


def test_greedy_and_the_low_temperature_edge():
    """Greedy (0) is the same on both engines; vLLM would raise 0 < T < 0.01 to 0.01, so that is refused, for the
    rollout and for the eval.k answers (which may not be 0: the message does not offer it)."""
    assert kwargs(SamplingParams(temperature=0.0))["temperature"] == 0.0
    with pytest.raises(ValueError, match=r"eval.temperature=0.005: vLLM raises .* set eval.temperature >= 0.01 \[type"):
        cfg({}, eval={"k": 4, "temperature": 0.005})
    Config.model_validate({"model": {"device": "cpu"}, "rollout": {"temperature": 0.005}})  # native: any


def test_max_model_len_must_hold_every_budget():
    """vLLM ends a request at rollout.vllm.max_model_len as 'length', before the budget native would fill."""
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=64 new tokens leave no room .* "
                                         r"rollout.vllm.max_model_len=64"):
        cfg({"max_new_tokens": 64, "vllm": {"max_model_len": 64}})
    with pytest.raises(ValueError, match=r"eval.max_new_tokens=100 .* rollout.vllm.max_model_len=64"):
        cfg({"max_new_tokens": 16, "vllm": {"max_model_len": 64}}, eval={"max_new_tokens": 100})
    assert cfg({"max_new_tokens": 16, "vllm": {"max_model_len": 64}}).rollout.vllm.max_model_len == 64


def test_the_prompt_fit_check_names_max_model_len_when_it_is_the_limit():
    from relayrl.data.errors import DatasetError
    from relayrl.data.lengths import PromptRoom, fit_prompts
    from relayrl.data.tasks import Problem

    room = PromptRoom(budget=16, key="rollout.max_new_tokens", limit=64, limit_key="rollout.vllm.max_model_len")
    rows = [Problem(prompt="x" * n, answer="", meta={"row": i, "source": "d.jsonl"}) for i, n in enumerate((10, 50))]
    with pytest.raises(DatasetError, match=r"d.jsonl row 1: .* 50 tokens .* beyond rollout.vllm.max_model_len=64"):
        fit_prompts(rows, lambda p: [0] * len(p.prompt), room, drop=False, what="training", log=print)


def test_a_step_of_several_tokens_is_cut_at_the_stop_string_and_tokens_need_their_log_probs(tiny_tokenizer):
    """The vLLM engine checked a stop string once per step, after all its tokens: a step that brought several
    (speculative decoding, a multi-token delta) kept the tokens after the hit, which the native engine drops. A
    step's tokens without log-probs were dropped with no error."""
    from types import SimpleNamespace

    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, _Row

    eng = VLLMGenerationEngine.__new__(VLLMGenerationEngine)
    eng.tokenizer, eng._version = tiny_tokenizer, 3
    ids = tiny_tokenizer("12+34=46 and more")["input_ids"]
    stop = "="
    hit = next(i for i in range(len(ids)) if stop in tiny_tokenizer.decode(ids[:i + 1]))
    assert hit + 2 < len(ids)
    lp = lambda t, v: {t: SimpleNamespace(logprob=v)}  # noqa: E731 (vLLM's Logprob record)
    out = SimpleNamespace(token_ids=ids, logprobs=[lp(t, -0.5 * k) for k, t in enumerate(ids)], finish_reason=None)
    row = _Row((0, 0), [1], 32, None)
    params = SamplingParams(stop_strings=(stop,), max_new_tokens=32)
    assert eng._advance(row, out, False, params) == "stop"
    assert row.tokens == ids[:hit + 1] and row.logps == [-0.5 * k for k in range(hit + 1)]
    assert row.versions == [3] * (hit + 1)
    with pytest.raises(RuntimeError, match="without their log-probs"):
        eng._advance(_Row((0, 0), [1], 32, None), SimpleNamespace(token_ids=ids, logprobs=None, finish_reason=None),
                     False, params)


@pytest.mark.parametrize("key,value", [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2)])
def test_a_penalty_or_filter_needs_temperature_1_and_the_refusal_says_why(key, value):
    """A penalty or filter was refused at every temperature, with a message that said vLLM filters 'after' and
    the trainer recomputes 'before'. The engine now starts with raw log-probs for them (relayrl's at temperature
    1 and greedy); at another temperature the refusal says which distribution each log-prob is of."""
    c = cfg({key: value, "temperature": 1.0})
    assert c.rollout.vllm_logprobs() == RAW and kwargs(c.rollout.sampling())[key] == value
    assert cfg({key: value}, eval={"k": 4, "temperature": 1.0}).rollout.vllm_logprobs() == RAW
    assert cfg({}).rollout.vllm_logprobs() == PROCESSED  # (no filter: processed, relayrl's at every temperature)
    with pytest.raises(ValueError) as info:
        cfg({key: value, "temperature": 0.7})
    msg = str(info.value)
    for words in (f"rollout.temperature=0.7 with rollout.{key} on", "raw_logprobs", "before anything, the "
                  "temperature included", "the masked, renormalised distribution", "set rollout.temperature=1",
                  f"rollout.{key}="):
        assert words in msg, words
    # the eval.k answers' log-probs are never read (logprobs=False): another temperature is no longer refused
    assert cfg({key: value}, eval={"k": 4, "temperature": 0.6}).eval.temperature == 0.6
    # an engine started for plain sampling (processed log-probs) refuses a filtered request, saying why
    why = sampling_refusal(SamplingParams(**{key: value}), mode=PROCESSED)
    for words in ("processed_logprobs", "renormalised distribution it samples from",
                  "log_softmax(logits / temperature) over the whole vocabulary, before any penalty or filter",
                  "-log(the mass it keeps)"):
        assert words in why, words
    # and one started with raw log-probs refuses another temperature (an eval's): its log-probs would be T=1's
    assert "temperature=0.6: vLLM 0.32's raw log-probs" in sampling_refusal(SamplingParams(temperature=0.6), mode=RAW)
    assert sampling_refusal(SamplingParams(temperature=0.6, logprobs=False), mode=RAW) is None  # (not read)
    assert sampling_refusal(SamplingParams(**{key: value}, logprobs=False), mode=PROCESSED) is None
    assert sampling_refusal(SamplingParams(temperature=0.0, n=1), mode=RAW) is None  # greedy: log_softmax(logits)


def test_min_p_with_top_p_is_refused_for_vllms_filter_order():
    with pytest.raises(ValueError, match=r"rollout.min_p=0.1 with rollout.top_p=0.9: vLLM applies min_p before "
                                         r"top-k/top-p .* set one of them off"):
        cfg({"min_p": 0.1, "top_p": 0.9})
    assert kwargs(SamplingParams(min_p=0.1, top_k=5))["min_p"] == 0.1  # (min-p commutes with top-k)


@pytest.mark.slow
def test_vllms_processed_log_probs_are_of_the_masked_distribution_not_relayrls():
    """vLLM's own top-k/top-p sampler (the one its CPU and fallback GPU paths run, in processed_logprobs mode)
    returns log_softmax of the masked logits: for every sampled token it is relayrl's log-prob (native's
    sample_with, the trainer's log_softmax(logits / T)) less the log of the mass the mask keeps, which is why
    the vLLM engine refuses top_k/top_p (importing vLLM takes ~10 s; no engine starts)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from relayrl.engines.generation.sampling import sample_with

    torch.manual_seed(0)
    logits, T = torch.randn(6, 300) * 3, 0.7
    scaled = logits / T
    for k, p in ((5, None), (None, 0.9), (20, 0.8)):
        kk = None if k is None else torch.full((6,), k)
        pp = None if p is None else torch.full((6,), p)
        tok, vllm_lp = TopKTopPSampler("processed_logprobs").forward_native(scaled.clone(), {}, kk, pp)
        vllm_lp = vllm_lp.gather(1, tok[:, None]).squeeze(1)
        kept = torch.isfinite(TopKTopPSampler("processed_logits").forward_native(scaled.clone(), {}, kk, pp)[1])
        mass = (torch.softmax(scaled, -1) * kept).sum(-1)
        trainer = torch.log_softmax(scaled, -1).gather(1, tok[:, None]).squeeze(1)
        assert torch.allclose(vllm_lp, trainer - mass.log(), atol=1e-5)
        assert (mass < 0.999).all() and (vllm_lp - trainer > 1e-3).all()  # every ratio off
        # the native engine records the trainer's quantity for the same token under the same filters
        native_tok, native_lp = sample_with(logits, T, k or 0, p or 1.0, torch.rand(6, dtype=torch.float64))
        assert torch.allclose(native_lp, torch.log_softmax(scaled, -1).gather(1, native_tok[:, None]).squeeze(1),
                              atol=1e-6)
