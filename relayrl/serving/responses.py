"""Response records of the OpenAI-compatible API: text with stop strings, log-probs, choices, SSE chunks.

Texts are decoded from the sampled ids without special tokens (as the native
engine's ``Completion.text``); a stop string ends the text before it (OpenAI's
rule) and a stop token (``stop_token_ids``, an EOS id) leaves its own text out
(vLLM's detokenizer; both kept with vLLM's ``include_stop_str_in_output``),
while ``token_ids`` and the log-probs keep every sampled token, the stop token
included (vLLM's ``return_token_ids`` does the same), so a trainer sees exactly
what was sampled. Streamed text is held back while it could still be
the start of a stop string or ends inside a multi-byte character.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from relayrl.serving.guard import error_body  # re-exported for the handlers

__all__ = ["SampleText", "Sample", "completion_body", "chat_body", "sse", "error_body", "token_text",
           "text_length"]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    """How a token is named in log-probs: its text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``, which survives tokens that are not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


class SampleText:
    """Incremental detokenization of one sample with stop strings and stop tokens (``stop_ids``: the ids that
    end a row, whose text is left out unless ``include_stop``)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], stop_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.stop_ids, self.include_stop = stop_ids, include_stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.stopped = False

    def _text(self) -> str:
        ids = self.ids
        if ids and ids[-1] in self.stop_ids and not self.include_stop:
            ids = ids[:-1]  # a stop token ends the row: it is always the last id
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            at, stop = min(hits)
            return text[:at + len(stop)] if self.include_stop else text[:at]
        return text

    def push(self, token_id: int) -> str:
        """The newly final text after ``token_id`` ("" while it is held back)."""
        self.ids.append(token_id)
        text = self._text()
        end = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):  # a multi-byte character is incomplete
                return ""
            for s in self.stops:  # the text's tail may be the start of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if s.startswith(text[-k:]):
                        end = min(end, len(text) - k)
                        break
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta

    def finish(self) -> str:
        """Whatever was held back, once the sample has ended."""
        text = self._text()
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def full(self, ids: tuple[int, ...] | list[int]) -> str:
        self.ids = list(ids)
        return self._text()


@dataclass
class Sample:
    """One finished sample as the handlers assemble it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_ids: list[int]
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def text_length(tokenizer, token_id: int) -> int:
    """How far ``token_id`` moves ``text_offset`` (characters of its text in the completion; 0 for a special
    token, which the text leaves out). vLLM moves it by the log-prob token's string, the same but for special
    tokens and ``token_id:<id>`` names; ours stays an offset into the returned text."""
    return len(tokenizer.decode([token_id], skip_special_tokens=True))


def _completion_logprobs(tokenizer, s: Sample, as_ids: bool, top_k: int) -> dict:
    tokens = [token_text(tokenizer, t, as_ids) for t in s.token_ids]
    offsets, pos = [], 0
    for t in s.token_ids:
        offsets.append(pos)
        pos += text_length(tokenizer, t)
    tops = None
    if top_k > 0:
        tops = [{token_text(tokenizer, i, as_ids): lp for i, lp in alts[:top_k]} for alts in s.top]
    return {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tokenizer, s: Sample, as_ids: bool, top_k: int) -> dict:
    def entry(i: int, lp: float) -> dict:
        text = token_text(tokenizer, i, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for j, (t, lp) in enumerate(zip(s.token_ids, s.logprobs)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(i, v) for i, v in s.top[j][:top_k]] if top_k > 0 and j < len(s.top) else []
        content.append(e)
    return {"content": content}


def _usage(samples: list[Sample], prompts: list[list[int]]) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_body(model: str, tokenizer, samples: list[Sample], prompts: list[list[int]], *,
                    logprobs: int | None, as_ids: bool, token_ids: bool) -> dict:
    choices = []
    for s in samples:
        c: dict[str, Any] = {"index": s.index, "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
        if logprobs is not None:
            c["logprobs"] = _completion_logprobs(tokenizer, s, as_ids, logprobs)
        if token_ids:
            c["token_ids"], c["prompt_token_ids"] = s.token_ids, s.prompt_ids
        choices.append(c)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(samples, prompts)}


def chat_body(model: str, tokenizer, samples: list[Sample], prompt: list[int], *, logprobs: bool,
              top_logprobs: int, as_ids: bool, token_ids: bool) -> dict:
    choices = []
    for s in samples:
        c: dict[str, Any] = {"index": s.index, "message": {"role": "assistant", "content": s.text},
                             "finish_reason": s.finish_reason, "logprobs": None}
        if logprobs:
            c["logprobs"] = _chat_logprobs(tokenizer, s, as_ids, top_logprobs)
        if token_ids:
            c["token_ids"] = s.token_ids
        choices.append(c)
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(samples, [prompt])}
    if token_ids:
        body["prompt_token_ids"] = prompt
    return body


def completion_chunk(cid: str, model: str, index: int, text: str, finish: str | None, lp: dict | None,
                     token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def chat_chunk(cid: str, model: str, index: int, delta: dict, finish: str | None, lp: dict | None,
               token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}
