"""Request records of the OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``).

Field names and meanings follow the OpenAI API; the extensions are vLLM's
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``return_tokens_as_token_ids``, ``return_token_ids``), so a client written for
vLLM works unchanged, plus SGLang's ``no_stop_trim`` (what ``rollout.engine=openai`` sends to any
server). Unknown fields and options the server does not implement
(``echo``, ``best_of > 1``, presence and frequency penalties, ``logit_bias``,
``suffix``, tools) are refused with a 400 naming
the field, never silently ignored (so is a key given twice in one JSON object: ``relayrl.serving.app``). Integer fields are strict, as OpenAI's API
(``true`` or ``"5"`` for ``max_tokens`` is refused, not read as 1 or 5), and
floats must be finite. Server-side limits (``ServeLimits``) are checked by the
app, which knows the model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)

from relayrl.engines.generation.config import check_scale

__all__ = ["ServeLimits", "CompletionRequest", "ChatMessage", "ChatCompletionRequest", "WeightsRequest",
           "FieldError"]


class FieldError(ValueError):
    """A refusal by a check across fields, naming the field it is about: pydantic locates a model validator's
    error at the model itself, so the app reads ``field`` for the error's ``param`` (and prefixes ``reason`` with
    the field's full path, as for any other invalid field)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class ServeLimits(BaseModel):
    """What one request may ask of ``relayrl serve`` (refused with 400/413/503 beyond)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body (weight payloads excepted)")
    max_tokens: int = Field(1024, ge=1, description="largest max_tokens of one request")
    max_n: int = Field(16, ge=1, description="largest n (samples per prompt)")
    max_prompts: int = Field(64, ge=1, description="prompts in one /v1/completions request")
    max_waiting: int = Field(1024, ge=1, description="requests queued beyond the running batch before 503")
    max_stop: int = Field(4, ge=0, description="stop strings per request")
    max_top_logprobs: int = Field(20, ge=0)
    body_timeout_s: float = Field(60.0, gt=0, description="seconds to receive a request body (408 beyond)")
    weights_timeout_s: float = Field(600.0, gt=0, description="seconds to receive a weights payload (408 beyond)")
    weight_load_timeout_s: float = Field(600.0, gt=0, description="seconds a received weight load may take to be "
                                         "applied, waiting for the running batch to drain included (503 beyond)")


class StreamOptions(BaseModel):
    """``stream_options`` (with ``stream=true``): OpenAI's ``include_usage``, a last chunk with the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # (NaN passed le=100 checks' wording)

    model: str | None = Field(None, description="the served model's name (null: the one model this server serves, "
                              "as vLLM's server)")
    max_tokens: StrictInt | None = Field(None, description="new tokens per sample (null: the server's default, 16)")
    temperature: StrictFloat | None = Field(None, ge=0.0, le=100.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 disables")
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0, description="vLLM extension; 0 disables")
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, description="vLLM extension; 1 disables")
    n: StrictInt | None = Field(None, ge=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM extension")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer")
    user: str | None = None
    ignore_eos: StrictBool | None = Field(False, description="vLLM extension: do not stop at EOS")
    return_tokens_as_token_ids: StrictBool | None = Field(False, description="vLLM extension: logprob tokens "
                                                          "as 'token_id:<id>'")
    return_token_ids: StrictBool | None = Field(False, description="vLLM extension: prompt_token_ids and "
                                                "token_ids in each choice")
    include_stop_str_in_output: StrictBool | None = Field(False, description="vLLM extension: keep the stop "
                                                          "string's or stop token's text at the end of the text")
    no_stop_trim: StrictBool | None = Field(False, description="SGLang extension: the same as "
                                            "include_stop_str_in_output (token_ids and the log-probs keep every "
                                            "sampled token either way)")
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens={v} must be >= 1")
        return v

    @field_validator("temperature", "repetition_penalty")
    @classmethod
    def _scale(cls, v: float | None, info) -> float | None:
        return check_scale(info.field_name, v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        # one reason instead of pydantic's two (one per member of the union, located at "stop.str" and so on)
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            return v
        raise ValueError(f"give a string or a list of strings, not {type(v).__name__}"
                         f"{'' if not isinstance(v, list) else ' holding other values'}")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and "" in v):  # (it would match at once: every text would be empty)
            raise ValueError("an empty stop string is not allowed; remove it")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "_Request":
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise FieldError(name, "not supported by relayrl serve; leave it unset or 0")
        if self.logit_bias:
            raise FieldError("logit_bias", "not supported by relayrl serve; leave it unset")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream=true")
        if self.temperature == 0 and (self.n or 1) > 1:
            raise FieldError("n", f"temperature=0 is greedy, so n={self.n} samples would be identical; set n=1 or "
                             "temperature > 0")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, description="top alternatives per token (0: the sampled token's "
                                       "only)")
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # one reason instead of pydantic's four (one per member of the union, located at "prompt.str" and so on)
        if isinstance(v, str) or (isinstance(v, list) and (all(isinstance(x, str) for x in v) or _is_ids(v)
                                                           or all(_is_ids(x) for x in v))):
            return v
        raise ValueError("give a text, a list of texts, a list of token ids, or a list of token-id lists")

    @model_validator(mode="after")
    def _completion_only(self) -> "CompletionRequest":
        if self.echo:
            raise FieldError("echo", "not supported by relayrl serve; leave it false")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise FieldError("best_of", "not supported by relayrl serve; leave it unset")
        if self.suffix:
            raise FieldError("suffix", "not supported by relayrl serve; leave it unset")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "an empty list; give a text, token ids, or a list of either")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: a text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)  # (not bool, as StrictInt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    """Given to the chat template beside role and content, as vLLM does: a template with a place for it renders
    it, one without leaves it out (it is the model's own format)."""

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        # one reason instead of pydantic's two (one per member of the union, "content.str" and "content.list[...]")
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            return v
        raise ValueError(f"give a text or a list of text parts ({{'type': 'text', 'text': ...}}), not "
                         f"{type(v).__name__}{'' if not isinstance(v, list) else ' holding other values'}")

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":  # (an assistant turn may be empty)
            raise FieldError("content", f"a {self.role!r} message needs 'content' (text, or a list of text parts)")
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.get("type") != "text":
                raise FieldError(f"content.{i}.type", f"{part.get('type')!r} parts are not supported by relayrl "
                                 "serve; give text parts ({'type': 'text', 'text': ...})")
            if not isinstance(part.get("text"), str):
                raise FieldError(f"content.{i}.text", "a text part needs 'text' (a string)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)  # (text parts only: checked above)


RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "messages"})
"""Arguments of ``apply_chat_template`` that the server passes itself (vLLM refuses the first two as well)."""


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: more variables of the "
                                                        "chat template (enable_thinking, ...), passed to the "
                                                        "tokenizer's apply_chat_template")
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> "ChatCompletionRequest":
        if self.tools or self.tool_choice not in (None, "none"):
            raise FieldError("tools" if self.tools else "tool_choice", "tools are not supported by relayrl serve; "
                             "leave tools and tool_choice unset")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise FieldError("response_format", "only type 'text' is supported by relayrl serve")
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise FieldError("max_completion_tokens", f"max_completion_tokens={self.max_completion_tokens} must "
                                 "be >= 1")
            if self.max_tokens is None:
                self.max_tokens = self.max_completion_tokens
            elif self.max_tokens != self.max_completion_tokens:
                raise FieldError("max_completion_tokens", f"max_tokens={self.max_tokens} and max_completion_tokens="
                                 f"{self.max_completion_tokens} disagree; give one of them")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        taken = sorted(RESERVED_TEMPLATE_KWARGS & (self.chat_template_kwargs or {}).keys())
        if taken:
            raise FieldError("chat_template_kwargs", f"{', '.join(taken)} cannot be set here (the server sets "
                             "them); remove them")
        return self


class WeightsRequest(BaseModel):
    """``POST /v1/relayrl/weights`` as JSON: load a safetensors file (or a directory of them) by path."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="a .safetensors file, or a directory whose *.safetensors files are loaded")
    version: StrictInt = Field(ge=0, description="weight version the engine reports afterwards")
