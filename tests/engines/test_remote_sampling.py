"""Every sampling and rollout key is sent to the server with the native engine's meaning, refused with
``rollout.engine=openai``, or the server's own (``relayrl/engines/generation/remote_sampling.py``). No server: the
request body and the config's checks are pure functions.

Both tables enumerate their model's fields: a key added to ``RolloutConfig`` or ``SamplingParams`` without a case
here (and a line in ``remote_sampling``'s tables) fails ``test_every_key_has_a_decision``."""

from __future__ import annotations

import pytest

from relayrl.config.schema import Config, RolloutConfig
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.remote_sampling import KEEP_STOPS, ROLLOUT_KEYS, SAMPLING_FIELDS


class Tok:
    """Just what special_stop_ids reads of a tokenizer: one special token, <|im_end|> (id 9)."""

    all_special_tokens = ["<|im_end|>"]
    added_tokens_decoder: dict = {}

    def convert_tokens_to_ids(self, s: str) -> int:
        return {"<|im_end|>": 9}[s]


def body(params: SamplingParams, seed: int | None = 11) -> dict:
    """What the openai engine sends for one prompt of ``params`` (its own _body, with relayrl's tokenizer)."""
    from relayrl.engines.generation.remote import RemoteGenerationEngine

    eng = object.__new__(RemoteGenerationEngine)  # (the request alone: no server to ask for its models)
    eng.model, eng.tokenizer = "m", Tok()
    return eng._body([1, 2], params, seed)


# ---------------------------------------------------------------- SamplingParams -> the request
# field -> (value, the request fields it gives; None: the field is absent)
SAMPLING_CASES: dict[str, list[tuple[object, dict]]] = {
    "n": [(4, {"n": 4})],
    "temperature": [(0.7, {"temperature": 0.7}), (0.0, {"temperature": 0.0})],
    "top_p": [(1.0, {"top_p": 1.0}), (0.9, {"top_p": 0.9})],  # (sent at the neutral value too: no server default)
    "top_k": [(0, {"top_k": -1}), (5, {"top_k": 5})],
    "min_p": [(0.0, {"min_p": 0.0}), (0.1, {"min_p": 0.1})],
    "repetition_penalty": [(1.0, {"repetition_penalty": 1.0}), (1.2, {"repetition_penalty": 1.2})],
    "max_new_tokens": [(32, {"max_tokens": 32})],
    # a special token's stop string is its id: the server decodes without special tokens and would never see it
    "stop_strings": [((), {"stop": None, "stop_token_ids": None}), (("ab",), {"stop": ["ab"], "stop_token_ids": None}),
                     (("ab", "<|im_end|>"), {"stop": ["ab"], "stop_token_ids": [9]}),
                     (("<|im_end|>",), {"stop": None, "stop_token_ids": [9]})],
    "stop_token_ids": [((5, 7), {"stop_token_ids": [5, 7]})],
    "ignore_eos": [(True, {"ignore_eos": True}), (False, {"ignore_eos": None})],
    "logprobs": [(False, {"logprobs": 0}), (True, {"logprobs": 0})],  # (asked either way: the ids may come in them)
}


@pytest.mark.parametrize("field,value,want", [(f, v, w) for f, cases in SAMPLING_CASES.items() for v, w in cases])
def test_each_sampling_field_is_sent(field, value, want):
    got = body(SamplingParams(**{field: value}, **({"n": 1} if field == "temperature" and value == 0.0 else {})))
    assert {k: got.get(k) for k in want} == want
    # what every request asks whatever the field: the sampled ids and their log-probs, and an output that keeps
    # the stop string and the stop token (vLLM's and SGLang's names), so the trained tokens are those sampled
    assert got["logprobs"] == 0 and got["return_token_ids"] is True and got["return_tokens_as_token_ids"] is True
    assert got["include_stop_str_in_output"] is True and got["no_stop_trim"] is True and got["seed"] == 11
    assert got["prompt"] == [1, 2] and got["model"] == "m"


def test_the_stop_strings_and_ids_combine_as_the_native_engines_stop_set():
    got = body(SamplingParams(stop_strings=("<|im_end|>", "\n\n"), stop_token_ids=(9, 3)))
    assert got["stop"] == ["\n\n"] and got["stop_token_ids"] == [3, 9]
    assert "seed" not in body(SamplingParams(), seed=None)
    assert KEEP_STOPS == {"include_stop_str_in_output": True, "no_stop_trim": True}


# ---------------------------------------------------------------- the rollout section with rollout.engine=openai
OPENAI = {"engine": "openai", "base_url": "http://h:1/v1"}


def cfg(rollout: dict, **sections) -> Config:
    return Config.model_validate({"model": {"device": "cpu"}, **sections, "rollout": {**OPENAI, **rollout}})


def sent(field: str, value):
    """A check that ``rollout.sampling()`` carries ``field`` into the request."""
    return lambda c: body(c.rollout.sampling())[field] == value


# field -> (its value, a check on the accepted config, or the words naming the key in its refusal)
ROLLOUT_CASES: dict[str, tuple[dict, object]] = {
    "n": ({"n": 4}, sent("n", 4)),
    "temperature": ({"temperature": 0.6}, sent("temperature", 0.6)),
    "top_p": ({"top_p": 0.9}, sent("top_p", 0.9)),
    "top_k": ({"top_k": 20}, sent("top_k", 20)),
    "min_p": ({"min_p": 0.05}, sent("min_p", 0.05)),
    "repetition_penalty": ({"repetition_penalty": 1.1}, sent("repetition_penalty", 1.1)),
    "max_new_tokens": ({"max_new_tokens": 24}, sent("max_tokens", 24)),
    "stop_strings": ({"stop_strings": ["</answer>"]}, sent("stop", ["</answer>"])),
    # the server's: its own batch limit; relayrl keeps rollout.concurrency requests in flight
    "max_batch": ({"max_batch": 12}, lambda c: "max_batch" not in body(c.rollout.sampling())),
    "dtype": ({"dtype": "bfloat16"}, lambda c: c.rollout.dtype == "bfloat16"),  # (the pushed weights' dtype)
    "engine": ({}, lambda c: c.rollout.remote() is not None),
    "vllm": ({"vllm": {"memory_utilization": 0.2}}, "rollout.vllm is read by rollout.engine=vllm only"),
    "decode": ({"decode": "static"}, "rollout.decode is read by the native engine only"),
    "decode_compile": ({"decode_compile": True}, "rollout.decode_compile is read by the native engine only"),
    "partial": ({"partial": True}, "rollout.partial swaps new weights"),
    "lora_sync": ({"lora_sync": "adapter"}, "rollout.engine=openai takes merged weights only"),
    "interrupt": ({"interrupt": {"after_tokens": 4}}, "rollout.interrupt"),
    "base_url": ({"base_url": "http://h:2/v1"}, lambda c: c.rollout.remote().base_url == "http://h:2/v1"),
    "served_model": ({"served_model": "m"}, lambda c: c.rollout.remote().model == "m"),
    "api_key_env": ({"api_key_env": "K"}, lambda c: c.rollout.remote().api_key_env == "K"),
    "weight_sync": ({"weight_sync": "none"}, lambda c: c.rollout.remote().weight_sync == "none"),
    "weight_dir": ({"weight_dir": "/tmp/w"}, lambda c: c.rollout.remote().weight_dir == "/tmp/w"),
    "concurrency": ({"concurrency": 4}, lambda c: c.rollout.remote().concurrency == 4),
    "timeout_s": ({"timeout_s": 5.0}, lambda c: c.rollout.remote().timeout_s == 5.0),
    "retries": ({"retries": 1}, lambda c: c.rollout.remote().retries == 1),
    "on_error": ({"on_error": "drop_group"}, lambda c: c.rollout.on_error == "drop_group"),
}


@pytest.mark.parametrize("field", list(ROLLOUT_CASES))
def test_each_rollout_key_is_sent_refused_or_the_servers(field):
    rollout, want = ROLLOUT_CASES[field]
    extra = {"partial": {"trainer": {"off_policy_steps": 1}},
             "lora_sync": {"model": {"device": "cpu", "lora": {"enabled": True, "r": 8}}}}.get(field, {})
    if isinstance(want, str):
        with pytest.raises(ValueError) as info:
            cfg(rollout, **extra)
        assert want in str(info.value)
        return
    assert want(cfg(rollout, **extra))


def test_every_key_has_a_decision():
    """A new rollout or sampling key needs an openai decision: a case above and a line in remote_sampling's tables."""
    assert set(ROLLOUT_CASES) == set(RolloutConfig.model_fields) == set(ROLLOUT_KEYS)
    assert set(SAMPLING_CASES) == set(SamplingParams.model_fields) == set(SAMPLING_FIELDS)


@pytest.mark.slow
def test_vllm_serves_request_reads_every_field_as_sent():
    """vLLM 0.32's own request model (what ``vllm serve`` validates a completions body with) turns the openai
    engine's body into the SamplingParams relayrl means: the filters as sent, the stop text kept, the special
    token's stop as an id (importing vLLM takes ~10 s; no server starts)."""
    from relayrl.engines.generation.config import vllm_available

    if not vllm_available():
        pytest.skip("needs vLLM")
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                            max_new_tokens=12, stop_strings=("</answer>", "<|im_end|>"), stop_token_ids=(5,))
    sp = CompletionRequest.model_validate(body(params)).to_sampling_params(max_tokens=12)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens, sp.seed) == (
        2, 0.7, 0.9, 20, 0.05, 1.1, 12, 11)
    assert sp.stop == ["</answer>"] and sp.include_stop_str_in_output and set(sp.stop_token_ids) == {5, 9}
    assert sp.logprobs == 0 and not sp.ignore_eos
    # top_k off: relayrl's 0 goes as -1, which vLLM reads as off too
    assert CompletionRequest.model_validate(body(SamplingParams())).to_sampling_params(max_tokens=4).top_k in (0, -1)
