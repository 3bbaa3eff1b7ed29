"""What each sampling and rollout setting means to the vLLM engine (``rollout.engine=vllm``): the same as to the
native engine, or refused naming the key. Torch-free and vLLM-free: the config checks it before anything loads,
and the engine builds vLLM's ``SamplingParams`` from :func:`sampling_kwargs`.

The two tables say, for every field of :class:`~relayrl.engines.generation.base.SamplingParams` and of the
``rollout`` config section, how the vLLM engine honours it; ``tests/engines/test_vllm_sampling.py`` enumerates
both models' fields against them, so a key added later without a decision here fails the test. The differences
that remain are listed in docs/engines.md ("Same keys, same meaning").
"""

from __future__ import annotations

from typing import Iterable

from relayrl.engines.generation.config import PLAIN_SAMPLING, narrowing

__all__ = ["SAMPLING_KEYS", "ROLLOUT_KEYS", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "NATIVE_ONLY", "OPENAI_ONLY",
           "PROCESSED_DIFFERS", "temperature_refusal", "sampling_refusal", "sampling_kwargs"]

MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature in (0, 0.01) to 0.01 (``SamplingParams.__post_init__``, with a warning): it would sample
and report log-probs at another temperature than the trainer recomputes at."""
MAX_TEMPERATURE = 2.0
"""vLLM refuses temperatures above 2."""

PROCESSED_DIFFERS = (
    "vLLM 0.32's processed log-probs (logprobs_mode=processed_logprobs, which this engine records) are log_softmax of "
    "the logits after its repetition penalty, the temperature, min_p and the top-k/top-p masks: of the renormalised "
    "distribution it samples from; relayrl records, and the trainer recomputes, log_softmax(logits / temperature) "
    "over the whole vocabulary, before any penalty or filter (the native engine's sampling.py), so a filter would "
    "raise every kept token's log-prob by -log(the mass it keeps) and a penalty would shift it, and every ratio "
    "would be off (vLLM's raw_logprobs are taken before the temperature as well)")
"""Why the vLLM engine refuses a penalty or a filter: what vLLM's ``Sampler`` (``v1/sample/sampler.py``, its
``TopKTopPSampler``) takes the processed log-probs of, and what relayrl's log-probs mean."""

SAMPLING_KEYS: dict[str, str] = {
    "n": "one vLLM request per sample (n=1), each with its own seed drawn from the worker's generator",
    "temperature": "temperature (0: greedy, log-probs under softmax(logits) on both engines); refused in (0, 0.01) "
                   "and above 2",
    "top_p": "refused unless 1 (vLLM's processed log-probs are of the masked, renormalised distribution: PROCESSED_DIFFERS); sent as top_p=1",
    "top_k": "refused unless 0 (off; -1, vLLM's off, is refused by the config); sent as top_k=0",
    "min_p": "refused unless 0; sent as min_p=0",
    "repetition_penalty": "refused unless 1; sent as repetition_penalty=1",
    "max_new_tokens": "max_tokens (the row's budget less the tokens it has, after a resubmission)",
    "stop_strings": "checked by relayrl on the decoded tail after every step, the completing token kept, as "
                    "native; one that spells a special token is a stop token id",
    "stop_token_ids": "stop_token_ids (the stop token kept as the last token, as native)",
    "ignore_eos": "vLLM always gets ignore_eos=True; the EOS ids (tokenizer's and generation_config.json's) are "
                  "in stop_token_ids unless ignore_eos",
}
"""``SamplingParams`` field -> how the vLLM engine maps it (:func:`sampling_kwargs`)."""

NATIVE_ONLY = ("decode", "decode_compile")
"""``rollout`` keys only the native engine reads: refused with another engine when set."""
OPENAI_ONLY = ("base_url", "served_model", "api_key_env", "weight_sync", "weight_dir", "concurrency", "timeout_s",
               "retries", "on_error")
"""``rollout`` keys only ``rollout.engine=openai`` reads: refused with another engine when set."""

ROLLOUT_KEYS: dict[str, str] = {
    **{k: f"SamplingParams.{k}: {v}" for k, v in SAMPLING_KEYS.items() if k not in ("stop_token_ids", "ignore_eos")},
    "max_batch": "vLLM's max_num_seqs",
    "dtype": "vLLM's dtype",
    "engine": "which engine",
    "vllm": "vLLM's start-up arguments (engine_args)",
    "partial": "requests in flight aborted and resubmitted as prompt + tokens so far at a weight update",
    "interrupt": "the thinking budget: a row re-enters as a new request with the phrase (the engine knows nothing "
                 "of it)",
    **{k: "native engine only: refused with rollout.engine=vllm" for k in NATIVE_ONLY},
    **{k: "rollout.engine=openai only: refused with rollout.engine=vllm" for k in OPENAI_ONLY},
}
"""``rollout`` config field -> how ``rollout.engine=vllm`` honours it."""


def temperature_refusal(key: str, t: float, greedy: bool = True) -> str | None:
    """Why vLLM cannot sample at temperature ``t`` set by ``key`` (``rollout.temperature``), naming the fix; None
    when it can. ``greedy``: the key may be 0 (greedy decoding)."""
    if t > MAX_TEMPERATURE:
        return f"{key}={t:g}: vLLM samples at temperatures up to 2 (it refuses more); set {key} <= 2"
    if 0.0 < t < MIN_TEMPERATURE:
        return (f"{key}={t:g}: vLLM raises a temperature below {MIN_TEMPERATURE} to {MIN_TEMPERATURE}, so it would "
                f"sample (and record log-probs) at another temperature than the trainer recomputes; set {key} >= "
                f"{MIN_TEMPERATURE}{', or 0 for greedy' if greedy else ''}")
    return None


def sampling_refusal(settings, prefix: str = "") -> str | None:
    """Why the vLLM engine cannot sample as ``settings`` (a ``SamplingParams`` or the ``rollout`` section) say,
    naming each key (under ``prefix``, e.g. ``rollout.``) and its neutral value; None when it can."""
    if (why := temperature_refusal(f"{prefix}temperature", settings.temperature)) is not None:
        return why
    if bad := narrowing(settings):
        fix = ", ".join(f"{prefix}{k}={PLAIN_SAMPLING[k]} (got {v})" for k, v in bad.items())
        return f"{PROCESSED_DIFFERS}: set {fix}"
    return None


def sampling_kwargs(params, *, max_tokens: int, seed: int | None, stop_ids: Iterable[int]) -> dict:
    """vLLM ``SamplingParams`` keyword arguments for one request (one sample) of ``params`` (a
    :class:`~relayrl.engines.generation.base.SamplingParams`): ``max_tokens`` new tokens at most, ``seed`` (None:
    vLLM's own draw), ``stop_ids`` the stop token ids (EOS ids unless ``ignore_eos``, ``stop_token_ids``, the
    special tokens the stop strings spell). Stop strings are not passed: the engine checks them itself. Raises
    ValueError where the vLLM engine would sample otherwise than the native one (:func:`sampling_refusal`)."""
    if (why := sampling_refusal(params)) is not None:
        raise ValueError(f"the vLLM engine: {why}")
    if max_tokens < 1:
        raise ValueError(f"the vLLM engine: a request needs max_tokens >= 1 (got {max_tokens})")
    return dict(n=1, temperature=params.temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                seed=seed, max_tokens=max_tokens, stop_token_ids=sorted(set(stop_ids)), ignore_eos=True,
                logprobs=0, detokenize=False)
