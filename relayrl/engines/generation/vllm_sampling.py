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
           "RAW", "PROCESSED", "PROCESSED_DIFFERS", "RAW_BEFORE_TEMPERATURE", "MIN_P_ORDER",
           "logprobs_mode", "temperature_refusal", "sampling_refusal", "sampling_kwargs"]

MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature in (0, 0.01) to 0.01 (``SamplingParams.__post_init__``, with a warning): it would sample
and report log-probs at another temperature than the trainer recomputes at."""
MAX_TEMPERATURE = 2.0
"""vLLM refuses temperatures above 2."""

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"

PROCESSED_DIFFERS = (
    "vLLM 0.32's processed log-probs (logprobs_mode=processed_logprobs) are log_softmax of the logits after its "
    "repetition penalty, the temperature, min_p and the top-k/top-p masks: of the renormalised distribution it "
    "samples from; relayrl records, and the trainer recomputes, log_softmax(logits / temperature) over the whole "
    "vocabulary, before any penalty or filter (the native engine's sampling.py), so a filter would raise every kept "
    "token's log-prob by -log(the mass it keeps) and a penalty would shift it, and every ratio would be off")
"""Why processed log-probs cannot carry a penalty or a filter: what vLLM's ``Sampler`` (``v1/sample/sampler.py``,
its ``TopKTopPSampler``) takes them of, and what relayrl's log-probs mean."""

RAW_BEFORE_TEMPERATURE = (
    "vLLM 0.32's raw log-probs (logprobs_mode=raw_logprobs, which the vLLM engine records when a penalty or a filter "
    "is on) are log_softmax of the model's logits before anything, the temperature included: relayrl's "
    "log_softmax(logits / temperature) at temperature 1 (and greedy) only; its processed log-probs would include "
    "the filters (of the masked, renormalised distribution)")
"""Why a penalty or a filter needs temperature 1 on vLLM."""

MIN_P_ORDER = (
    "vLLM applies min_p before top-k/top-p (after the temperature), the native engine after them (Hugging Face's "
    "order); with both on, vLLM takes the nucleus of the min-p survivors' renormalised distribution, another set of "
    "tokens than the native engine samples from")
"""Why min_p with top_p < 1 is refused on vLLM (min_p commutes with top_k: both keep the most likely token)."""

SAMPLING_KEYS: dict[str, str] = {
    "n": "one vLLM request per sample (n=1), each with its own seed drawn from the worker's generator",
    "temperature": "temperature (0: greedy, log-probs under softmax(logits) on both engines); refused in (0, 0.01) "
                   "and above 2",
    "top_p": "top_p at temperature 1 or 0 (raw_logprobs: RAW_BEFORE_TEMPERATURE); refused at another",
    "top_k": "top_k at temperature 1 or 0 (0: off; -1, vLLM's off, is refused by the config); refused at another",
    "min_p": "min_p at temperature 1 or 0; refused at another, and with top_p < 1 (MIN_P_ORDER)",
    "repetition_penalty": "repetition_penalty (on the prompt's and the response's tokens, as native) at "
                          "temperature 1 or 0; refused at another",
    "max_new_tokens": "max_tokens (the row's budget less the tokens it has, after a resubmission)",
    "stop_strings": "checked by relayrl on the decoded tail after every step, the completing token kept, as "
                    "native; one that spells a special token is a stop token id",
    "stop_token_ids": "stop_token_ids (the stop token kept as the last token, as native)",
    "ignore_eos": "vLLM always gets ignore_eos=True; the EOS ids (tokenizer's and generation_config.json's) are "
                  "in stop_token_ids unless ignore_eos",
    "logprobs": "vLLM always returns the sampled token's log-prob (logprobs=0); False (evaluation, which does not "
                "read them): the log-prob refusals (PROCESSED_DIFFERS, RAW_BEFORE_TEMPERATURE) are lifted, the "
                "sampling ones (the temperature bounds, MIN_P_ORDER) stay",
}
"""``SamplingParams`` field -> how the vLLM engine maps it (:func:`sampling_kwargs`)."""

NATIVE_ONLY = ("decode", "decode_compile")
"""``rollout`` keys only the native engine reads: refused with another engine when set."""
OPENAI_ONLY = ("base_url", "served_model", "api_key_env", "weight_sync", "weight_dir", "concurrency", "timeout_s",
               "retries", "on_error")
"""``rollout`` keys only ``rollout.engine=openai`` reads: refused with another engine when set."""

ROLLOUT_KEYS: dict[str, str] = {
    **{k: f"SamplingParams.{k}: {v}" for k, v in SAMPLING_KEYS.items()
       if k not in ("stop_token_ids", "ignore_eos", "logprobs")},
    "max_batch": "vLLM's max_num_seqs",
    "dtype": "vLLM's dtype",
    "engine": "which engine",
    "vllm": "vLLM's start-up arguments (engine_args)",
    "partial": "requests in flight aborted and resubmitted as prompt + tokens so far at a weight update",
    "lora_sync": "adapter: the engine starts with enable_lora and each sync loads the adapter as a new LoRA "
                 "(vllm_lora); merged: plain weights",
    "interrupt": "the thinking budget: a row re-enters as a new request with the phrase (the engine knows nothing "
                 "of it)",
    **{k: "native engine only: refused with rollout.engine=vllm" for k in NATIVE_ONLY},
    **{k: "rollout.engine=openai only: refused with rollout.engine=vllm" for k in OPENAI_ONLY},
}
"""``rollout`` config field -> how ``rollout.engine=vllm`` honours it."""


def temperature_refusal(key: str, t: float, greedy: bool = True, logprobs: bool = True) -> str | None:
    """Why vLLM cannot sample at temperature ``t`` set by ``key`` (``rollout.temperature``), naming the fix; None
    when it can. ``greedy``: the key may be 0 (greedy decoding); ``logprobs``: the caller reads the log-probs (a
    rollout; evaluation does not)."""
    if t > MAX_TEMPERATURE:
        return f"{key}={t:g}: vLLM samples at temperatures up to 2 (it refuses more); set {key} <= 2"
    if 0.0 < t < MIN_TEMPERATURE:
        why = ("it would sample (and record log-probs) at another temperature than the trainer recomputes" if logprobs
               else f"it would sample at another temperature than {key} says")
        return (f"{key}={t:g}: vLLM raises a temperature below {MIN_TEMPERATURE} to {MIN_TEMPERATURE}, so {why}; "
                f"set {key} >= {MIN_TEMPERATURE}{', or 0 for greedy' if greedy else ''}")
    return None


def logprobs_mode(settings) -> str:
    """The vLLM engine's ``logprobs_mode`` for ``settings`` (the ``rollout`` section): ``raw_logprobs`` when they
    narrow the distribution (a penalty, top-k, top-p or min-p: vLLM's raw log-probs are taken before all of them,
    and are relayrl's at temperature 1 and greedy), else ``processed_logprobs`` (after the temperature alone:
    relayrl's at every temperature)."""
    return RAW if narrowing(settings) else PROCESSED


def sampling_refusal(settings, prefix: str = "", mode: str | None = None) -> str | None:
    """Why the vLLM engine cannot sample as ``settings`` (a ``SamplingParams`` or the ``rollout`` section) say and
    record relayrl's log-probs, naming each key (under ``prefix``, e.g. ``rollout.``) and its fix; None when it
    can. ``mode``: the engine's ``logprobs_mode`` (None: the one :func:`logprobs_mode` picks for ``settings``).

    Two kinds of refusal: the sampling ones (a temperature vLLM would change, :data:`MIN_P_ORDER`: vLLM would
    sample from other tokens than the native engine) always apply; the log-prob ones (:data:`PROCESSED_DIFFERS`,
    :data:`RAW_BEFORE_TEMPERATURE`: vLLM would record other log-probs than relayrl's) only when the caller reads
    them, i.e. not for a ``SamplingParams`` with ``logprobs=False`` (evaluation). The ``rollout`` section has no
    such field: a rollout's log-probs are always read."""
    t = settings.temperature
    read = getattr(settings, "logprobs", True)  # (False: only the sampling refusals below)
    if (why := temperature_refusal(f"{prefix}temperature", t, logprobs=read)) is not None:
        return why
    bad = narrowing(settings)
    fix = ", ".join(f"{prefix}{k}={PLAIN_SAMPLING[k]} (got {v})" for k, v in bad.items())
    mode = mode or logprobs_mode(settings)
    if read and mode == PROCESSED and bad:  # (an engine started for plain sampling, asked to filter)
        return f"{PROCESSED_DIFFERS}: set {fix}"
    if read and mode == RAW and t not in (0.0, 1.0):
        on = f" with {', '.join(prefix + k for k in bad)} on" if bad else ""
        return (f"{prefix}temperature={t:g}{on}: {RAW_BEFORE_TEMPERATURE}; set {prefix}temperature=1"
                f"{', or ' + fix if bad else ' (or 0, greedy)'}")
    if "min_p" in bad and "top_p" in bad:
        return f"{prefix}min_p={bad['min_p']:g} with {prefix}top_p={bad['top_p']:g}: {MIN_P_ORDER}; set one of them off"
    return None


def sampling_kwargs(params, *, max_tokens: int, seed: int | None, stop_ids: Iterable[int],
                    mode: str = PROCESSED) -> dict:
    """vLLM ``SamplingParams`` keyword arguments for one request (one sample) of ``params`` (a
    :class:`~relayrl.engines.generation.base.SamplingParams`): ``max_tokens`` new tokens at most, ``seed`` (None:
    vLLM's own draw), ``stop_ids`` the stop token ids (EOS ids unless ``ignore_eos``, ``stop_token_ids``, the
    special tokens the stop strings spell), ``mode`` the engine's ``logprobs_mode``. Stop strings are not passed:
    the engine checks them itself. Raises ValueError where the vLLM engine would sample otherwise than the native
    one, or record other log-probs (:func:`sampling_refusal`)."""
    if (why := sampling_refusal(params, mode=mode)) is not None:
        raise ValueError(f"the vLLM engine: {why}")
    if max_tokens < 1:
        raise ValueError(f"the vLLM engine: a request needs max_tokens >= 1 (got {max_tokens})")
    return dict(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                repetition_penalty=params.repetition_penalty, seed=seed, max_tokens=max_tokens,
                stop_token_ids=sorted(set(stop_ids)), ignore_eos=True, logprobs=0, detokenize=False)
