"""The generation-engine interface: records in, records out.

A rollout worker owns a :class:`GenerationEngine`; workflows never touch a model
directly. Any engine (the native Hugging Face one here, a vLLM or SGLang one
later) fits behind this protocol.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.engines.generation.config import check_scale

from relayrl.errors import UserError

__all__ = ["SamplingParams", "Completion", "GenerationEngine", "RequestFailed", "PromptFeed", "ListFeed",
           "check_prompts", "generate_from_feed", "hits_stop_string", "special_stop_ids", "stop_token_ids"]


class RequestFailed(UserError, RuntimeError):
    """The generation request of one prompt failed (a server's error reply or timeout, after its retries):
    ``index`` is the prompt's position in the request list, ``cause`` what went wrong."""

    def __init__(self, index: int, cause: str) -> None:
        super().__init__(f"the generation request of prompt {index} failed: {cause}")
        self.index, self.cause = index, cause

    def __reduce__(self):  # (keeps the fields when pickled across processes)
        return (RequestFailed, (self.index, self.cause))


class SamplingParams(BaseModel):
    """How to sample. ``temperature == 0`` means greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, description="samples per prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="keep the tokens at least min_p times as likely as the "
                         "row's most likely one (0: off)")
    repetition_penalty: float = Field(1.0, gt=0.0, description="divide the positive logits (multiply the negative "
                                      "ones) of tokens already in the row's prompt or response by this (1: off)")
    max_new_tokens: int = Field(16, ge=1)
    stop_strings: tuple[str, ...] = Field((), description="stop when the response text contains one of these")
    stop_token_ids: tuple[int, ...] = Field((), description="extra stop tokens beside the EOS ids (the tokenizer's "
                                            "and the model's generation_config.json's eos_token_id)")
    ignore_eos: bool = Field(False, description="do not stop at the EOS ids (benchmarks: fixed-length work)")
    logprobs: bool = Field(True, description="False: the caller does not read the response log-probs "
                           "(evaluation); the vLLM engine then allows filters its log-prob mode would not record "
                           "faithfully (vllm_sampling.sampling_refusal applies only the sampling refusals). The "
                           "native engine records relayrl's log-probs either way and ignores it")

    @field_validator("temperature", "repetition_penalty")
    @classmethod
    def _scale(cls, v: float, info) -> float:
        return check_scale(info.field_name, v)

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.temperature == 0.0 and self.n > 1:
            raise ValueError("greedy decoding (temperature=0) with n > 1 returns n identical samples; set n=1 or temperature > 0")
        return self


def hits_stop_string(tokenizer, tokens: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the text of ``tokens`` ends in a stop string that its newest token completed.

    Only the tail is decoded (each new token is checked as it comes, so an earlier hit already stopped the row):
    enough tokens to hold the longest stop string, whose every token is at least one byte, plus a margin for
    characters split across tokens and decoders that change a leading space."""
    if not stops:
        return False
    tail = max(len(s.encode("utf-8")) for s in stops) + 8
    text = tokenizer.decode(list(tokens[-tail:]), skip_special_tokens=True)
    return any(s in text for s in stops)


def special_stop_ids(tokenizer, stop_strings: Sequence[str]) -> set[int]:
    """Ids of the tokenizer's special tokens that ``stop_strings`` spell exactly (``<|im_end|>``, ``<end_of_turn>``).
    Responses are decoded without special tokens, so such a stop string never shows in the text: the engines stop
    at its id instead, as at the EOS."""
    if not stop_strings:
        return set()
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = set(getattr(tokenizer, "all_special_tokens", ())) | {a.content for a in added if a.special}
    return {tokenizer.convert_tokens_to_ids(s) for s in stop_strings if s in special}


def stop_token_ids(params: SamplingParams, eos: set[int], tokenizer) -> set[int]:
    """Token ids that end a row under ``params``, the same for every engine: the ``eos`` ids (the tokenizer's and
    the model's generation config's, :func:`relayrl.models.eos.eos_ids`) unless ``ignore_eos``, plus
    ``stop_token_ids`` and the special tokens ``stop_strings`` spell (:func:`special_stop_ids`)."""
    return ((set() if params.ignore_eos else set(eos)) | set(params.stop_token_ids)
            | special_stop_ids(tokenizer, params.stop_strings))


@dataclass(frozen=True)
class Completion:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the request list."""
    sample_index: int
    """0 .. n-1 among the samples of that prompt."""
    token_ids: torch.Tensor
    """[L] int64, the response tokens (the stop token included when it was sampled)."""
    logprobs: torch.Tensor
    """[L] float32, log-prob of each sampled token under ``softmax(logits / temperature)`` (before a repetition
    penalty and top-k/top-p/min-p filtering), so the trainer can recompute the same quantity."""
    finish_reason: Literal["stop", "length"]
    """``stop``: an EOS id (the tokenizer's or the model's generation config's), a stop token or a stop string
    ended it; ``length``: it hit max_new_tokens."""
    weight_version: int = 0
    """Version of the weights that generated it (for staleness accounting)."""
    text: str = field(default="", compare=False)
    """Decoded response (without special tokens)."""
    loss_mask: torch.Tensor | None = field(default=None, compare=False)
    """[L] float, 1 on the tokens the model sampled, 0 on tokens written for it: an environment's in
    multi-turn episodes (tool output, user turns), the end-of-thinking phrase of an interrupted response
    (``rollout.interrupt``); those are context and never trained on. None: every token is the model's."""
    token_versions: torch.Tensor | None = field(default=None, compare=False)
    """[L] int64, the weight version that sampled each token (they differ within a response when a partial
    rollout swapped weights in while it was being generated); None: every token is ``weight_version``'s."""
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    """``[prompt + L - 1, MoE layers, top_k]`` int16: the experts each token the engine ran was routed to
    (engines that record routing, for routing replay: :mod:`relayrl.models.routing`); None: not recorded."""
    interrupted: bool = field(default=False, compare=False)
    """A thinking budget cut the response and the end-of-thinking phrase was written into it
    (``rollout.interrupt``, :mod:`relayrl.engines.generation.interrupt`): its ``loss_mask`` is 0 there."""


class GenerationEngine(Protocol):
    """Samples responses and takes new weights in place."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> list[Completion]:
        """All ``n`` samples of every prompt, ordered by (prompt, sample)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights into the engine's model and set its weight version."""
        ...


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Raise ``ValueError`` naming the first empty prompt (an engine has no position to sample from)."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")


class PromptFeed(Protocol):
    """Rows that arrive while an engine generates (``generate_feed`` of the native and the vLLM engine):
    multi-turn episodes feed each next turn of an episode, a thinking budget the responses that re-enter."""

    def take(self) -> tuple[int, Sequence[int], int] | None:
        """A row ready now, ``(key, prompt token ids, max new tokens)``, or None; never blocks. The
        completion of that row has ``prompt_index == key``."""
        ...

    def wait(self) -> bool:
        """Block until :meth:`take` may have a row (True) or no row will ever come again (False). Called
        only while the engine has nothing to decode."""
        ...


class ListFeed:
    """A fixed list of prompts as a :class:`PromptFeed`: prompt ``i`` is row ``i``, in order, each with the
    same token budget."""

    def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        self.waiting = deque(range(len(prompts)))
        self.prompts, self.max_new = prompts, max_new_tokens

    def take(self) -> tuple[int, Sequence[int], int] | None:
        if not self.waiting:
            return None
        i = self.waiting.popleft()
        return i, self.prompts[i], self.max_new

    def wait(self) -> bool:
        return bool(self.waiting)


def generate_from_feed(generate_feed: Callable[..., None], prompts: Sequence[Sequence[int]], params: SamplingParams,
                       generator: torch.Generator | None = None,
                       on_finish: Callable[[Completion], None] | None = None,
                       between: Callable[[], bool] | None = None) -> list[Completion]:
    """An engine's ``generate`` on its ``generate_feed(feed, params, generator, on_finish, between)``: the
    prompts fed as a :class:`ListFeed` (``params.max_new_tokens`` each), every completion collected, and all
    ``params.n`` samples of every prompt returned in (prompt, sample) order; ``on_finish`` still sees each
    completion the moment it ends. Empty prompts are refused first (:func:`check_prompts`)."""
    check_prompts(prompts)
    out: dict[tuple[int, int], Completion] = {}

    def keep(c: Completion) -> None:
        out[(c.prompt_index, c.sample_index)] = c
        if on_finish is not None:
            on_finish(c)

    generate_feed(ListFeed(prompts, params.max_new_tokens), params, generator, keep, between)
    return [out[k] for k in sorted(out)]
