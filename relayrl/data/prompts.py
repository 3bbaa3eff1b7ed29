"""A :class:`~relayrl.data.tasks.Problem`'s prompt as the model sees it: rendered with the tokenizer's chat
template when it has chat messages (:func:`render_prompt`; the HybridFlow/verl data path applies the template when a
prompt is encoded, so one dataset serves models with different templates), as plain ``role: content`` text
(:func:`render_plain`), as token ids (:func:`encode_prompt`), and what identifies it for a cache of encoded prompts
(:func:`prompt_identity`)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from relayrl.data.errors import DatasetError
from relayrl.data.tasks import Problem

__all__ = ["encode_prompt", "prompt_identity", "render_plain", "render_prompt"]


def render_plain(messages: list[dict[str, str]]) -> str:
    """Chat messages as readable text (``role: content`` lines), for logs and templateless tokenizers."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render_prompt(tokenizer, problem: Problem, chat_template: bool | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The text the model sees for ``problem`` (before tokenization).

    ``chat_template``: None (auto) applies the tokenizer's chat template iff the
    problem has chat messages; True applies it always (a text prompt becomes one
    user message); False never (the ``prompt`` text as is). The generation prompt
    (e.g. ``<|im_start|>assistant``) is appended when the template is applied, unless the messages end with
    an assistant message: that one is continued (TRL's ``continue_final_message``). ``template_kwargs``
    (``data.chat_template_kwargs``): more variables for the template, e.g. ``{"enable_thinking": False}``.
    """
    return _render(tokenizer, problem, chat_template, template_kwargs)[0]


def _render(tokenizer, problem: Problem, chat_template: bool | None,
            template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """(text, whether the chat template was applied)."""
    messages = problem.meta.get("messages")
    use = (messages is not None) if chat_template is None else bool(chat_template)
    if not use:
        return problem.prompt, False
    if not getattr(tokenizer, "chat_template", None):
        why = ("the prompt is chat messages (the row's, or its text with data.system_prompt's message)"
               if chat_template is None else "chat_template=True")
        raise DatasetError(
            f"{why} but tokenizer {_tokenizer_name(tokenizer)!r} has no chat template; give the run one with "
            "model.chat_template (a Jinja file, a tokenizer directory or the template itself; relayrl eval: "
            "--chat-template), or set data.chat_template=false to encode the prompt as plain text"
        )
    msgs = messages if messages is not None else [{"role": "user", "content": problem.prompt}]
    tools = problem.meta.get("tools")  # the run's tools, in the template's tools list (env.tools_in_prompt)
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    # a prompt that ends with the assistant's own words (a prefill: "The answer is") is continued, as TRL renders
    # it (continue_final_message): no end of turn and no new assistant turn after it
    prefill = msgs[-1].get("role") == "assistant"
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, **extra), True


def prompt_identity(problem: Problem) -> str:
    """What decides ``problem``'s prompt ids besides a run's template options: its text, and its chat messages and
    tools where it has them (a chat row and a text row whose plain text agrees, e.g. ``user: hi``, encode apart;
    so do two rows that offer other tools). A cache of encoded prompts is keyed on it."""
    messages, tools = problem.meta.get("messages"), problem.meta.get("tools")
    if messages is None and tools is None:
        return problem.prompt
    return json.dumps([problem.prompt, messages, tools], sort_keys=True, default=str)


def encode_prompt(tokenizer, problem: Problem, chat_template: bool | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids ``[L]`` of ``problem``'s prompt (see :func:`render_prompt` for ``chat_template``).

    Templated text already carries its special tokens, so the tokenizer adds none
    then; plain text gets the tokenizer's usual special tokens (e.g. a BOS).
    """
    text, templated = _render(tokenizer, problem, chat_template, template_kwargs)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
