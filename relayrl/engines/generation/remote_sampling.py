"""What each sampling and rollout setting becomes in a ``/v1/completions`` request of ``rollout.engine=openai``
(:mod:`relayrl.engines.generation.remote`): sent with the native engine's meaning, refused with this engine, or
the server's own (documented). Torch-free; ``tests/engines/test_remote_sampling.py`` enumerates
``SamplingParams``' and ``RolloutConfig``'s fields against the two tables, so a key added later without a
decision here fails the test.

The trained response is the tokens the server sampled, as it returns their ids (``choice.token_ids``, else the
``token_id:<id>`` log-prob tokens), never a re-tokenized text. Every request therefore also asks the server to
keep what ends a row in its output: ``include_stop_str_in_output`` (vLLM's and ``relayrl serve``'s name) and
``no_stop_trim`` (SGLang's, which otherwise drops a matched stop token's id from its output ids). vLLM 0.32
keeps the completing token's id either way and cuts only its own text; relayrl decodes the text from the ids
(as the native engine does), so rewards see the stop string as they do on the native engine. A stop string
that spells a special token (``<|im_end|>``) goes as a stop token id, as the native engine stops at it: a
server decodes without special tokens, so the string would never show in its text (and vLLM started with
``--skip-tokenizer-init`` refuses stop strings at all).
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["SAMPLING_FIELDS", "ROLLOUT_KEYS", "KEEP_STOPS", "request_body"]

KEEP_STOPS = {"include_stop_str_in_output": True, "no_stop_trim": True}
"""Sent with every request: the server's output keeps the stop string and the stop token (vLLM / SGLang names;
``relayrl serve`` takes both)."""

SAMPLING_FIELDS: dict[str, str] = {
    "n": "n (one request per prompt, its n samples)",
    "temperature": "temperature",
    "top_p": "top_p, always (a field left out takes the server's default, from generation_config.json)",
    "top_k": "top_k, always (relayrl's off, 0, as -1: vLLM's and SGLang's off)",
    "min_p": "min_p, always (vLLM filters min-p before top-k/top-p, the native engine after: docs/engines.md)",
    "repetition_penalty": "repetition_penalty, always",
    "max_new_tokens": "max_tokens",
    "stop_strings": "stop (with include_stop_str_in_output and no_stop_trim); one that spells a special token "
                    "as a stop token id instead",
    "stop_token_ids": "stop_token_ids (the server's output keeps the stop token: no_stop_trim)",
    "ignore_eos": "ignore_eos (the EOS ids are the server's: its tokenizer's and generation_config.json's)",
    "logprobs": "not sent: every request asks logprobs=0 either way (the sampled ids may come back as their "
                "log-prob tokens, token_id:<id>)",
}
"""``SamplingParams`` field -> what the request carries (:func:`request_body`)."""

_SERVER = "the server's (not sent): "
ROLLOUT_KEYS: dict[str, str] = {
    **{k: f"SamplingParams.{k}: {v}" for k, v in SAMPLING_FIELDS.items()
       if k not in ("stop_token_ids", "ignore_eos", "logprobs")},
    "max_batch": _SERVER + "its own batch limit (vllm serve --max-num-seqs); rollout.concurrency is the requests "
                 "relayrl keeps in flight",
    "dtype": "the weights pushed to the server are cast to it; the server computes in the dtype it was started "
             "with",
    "engine": "which engine",
    "lora_sync": "adapter: rollout.engine=vllm only, refused (a server takes merged weights)",
    "vllm": "rollout.engine=vllm only: refused",
    "decode": "native engine only: refused",
    "decode_compile": "native engine only: refused",
    "partial": "refused (a server takes weights between requests, not between decode steps)",
    "interrupt": "refused (a server cannot take a row back)",
    "base_url": "the server's base URL",
    "served_model": "model",
    "api_key_env": "the bearer token's environment variable",
    "weight_sync": "how weights reach the server",
    "weight_dir": "where weight_sync=vllm/sglang (or relayrl by path) writes them",
    "concurrency": "requests in flight",
    "timeout_s": "a request's time limit",
    "retries": "retries on 502/503/504 and dropped connections",
    "on_error": "what a failed request does to its group",
}
"""``rollout`` config field -> how ``rollout.engine=openai`` honours it."""


def request_body(model: str, prompt: Sequence[int], params, seed: int | None,
                 special_ids: Iterable[int] = (), special_strings: Iterable[str] = ()) -> dict:
    """The ``/v1/completions`` JSON body of ``prompt`` (token ids) under ``params`` (a
    :class:`~relayrl.engines.generation.base.SamplingParams`). ``special_strings``: the stop strings that spell
    a special token, sent as their ``special_ids`` (:func:`~relayrl.engines.generation.base.special_stop_ids`)
    instead of as strings. Every sampling field goes at its neutral value too: a field left out takes the
    server's default, which vllm serve (and relayrl serve) take from the model's generation_config.json (Qwen3:
    top_k=20), and the trainer's log-probs would then be of another distribution than the one sampled."""
    body = {"model": model, "prompt": list(prompt), "n": params.n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
            "min_p": params.min_p, "repetition_penalty": params.repetition_penalty, "logprobs": 0,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **KEEP_STOPS}
    special = set(special_strings)
    if stops := [s for s in params.stop_strings if s not in special]:
        body["stop"] = stops
    if ids := sorted(set(params.stop_token_ids) | set(special_ids)):
        body["stop_token_ids"] = ids
    if params.ignore_eos:
        body["ignore_eos"] = True
    if seed is not None:
        body["seed"] = seed
    return body
