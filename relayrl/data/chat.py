"""Multi-turn SFT: which tokens of a rendered conversation are the assistant's (the ones trained on).

Two sources of the mask, both from the tokenizer's own chat template:

* a template that marks assistant text with ``{% generation %}`` ... ``{% endgeneration %}`` gives it
  directly (``apply_chat_template(..., return_assistant_tokens_mask=True)``, transformers);
* otherwise the mask is the difference of prefixes, as TRL and OpenRLHF build it: the tokens of assistant
  message ``i`` are those after ``render(messages[:i], add_generation_prompt=True)`` up to the end of
  ``render(messages[:i+1])``: the reply and what the template closes it with (ChatML's ``<|im_end|>``
  and newline). That needs a template whose rendering of a prefix of the conversation is a prefix of the
  whole; one that is not (e.g. it rewrites earlier turns) is refused with the row's reason.

System and user turns, and tool results, are context: they get 0 and are never trained on.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

__all__ = ["assistant_mask", "conversation_ids", "check_conversations", "unstopped_turn_end", "ChatMaskError"]


class ChatMaskError(ValueError):
    """The conversation cannot be masked (no assistant turn, or a template that is not prefix-stable)."""


def _ids(tokenizer, messages: Sequence[dict], generation_prompt: bool, kwargs: Mapping[str, Any]) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_mask(tokenizer, messages: Sequence[dict],
                   template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """``(token ids of the whole conversation, mask)`` with mask 1 on the assistant turns' tokens
    (``template_kwargs``: more variables for the chat template, ``data.chat_template_kwargs``)."""
    kw = dict(template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        raise ChatMaskError("multi-turn SFT needs a tokenizer with a chat template")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatMaskError("the conversation has no assistant turn to train on")
    if "{% generation %}" in tokenizer.chat_template or "{%- generation %}" in tokenizer.chat_template:
        out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    ids = _ids(tokenizer, messages, False, kw)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _ids(tokenizer, messages[:i], True, kw), _ids(tokenizer, messages[:i + 1], False, kw)
        if ids[:len(before)] != before or ids[:len(through)] != through:
            raise ChatMaskError(f"the chat template renders the conversation up to message {i + 1} differently "
                                f"from the start of the whole conversation, so the assistant's tokens cannot be "
                                f"found by prefixes; use a template with {{% generation %}} markers")
        for t in range(len(before), len(through)):
            mask[t] = 1
    if not any(mask):
        raise ChatMaskError("the chat template renders none of the assistant's tokens, so there is nothing to train "
                            "on; use a template that writes the assistant turns")
    return ids, mask


def conversation_ids(tokenizer, messages: Sequence[dict],
                     template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], tuple[list[int], list[int]]]:
    """A conversation as an SFT row: ``(prompt ids, (response ids, loss mask))``, the prompt being every
    token before the first assistant token (the trainer's packing keeps the prompt apart)."""
    ids, mask = assistant_mask(tokenizer, messages, template_kwargs)
    first = mask.index(1)
    return ids[:first], (ids[first:], mask[first:])


def check_conversations(tokenizer, problems: Sequence, template_kwargs: Mapping[str, Any] | None = None) -> None:
    """Mask every conversation of ``problems`` (the rows with ``meta["conversation"]``) once, before training:
    a row the template cannot mask is a :class:`~relayrl.data.errors.DatasetError` naming its file and row (all
    of them counted, the first :data:`~relayrl.data.datasets.MAX_ROW_ERRORS` listed), as a malformed row is."""
    from pathlib import Path

    from relayrl.data.datasets import MAX_ROW_ERRORS
    from relayrl.data.errors import DatasetError

    bad: list[str] = []
    for p in problems:
        if "conversation" not in p.meta:
            continue
        try:
            assistant_mask(tokenizer, p.meta["conversation"], template_kwargs)
        except ChatMaskError as e:
            bad.append(f"{Path(p.meta['source']).name} row {p.meta['row']}: {e}")
    if len(bad) == 1:
        raise DatasetError(bad[0])
    if bad:
        shown = "" if len(bad) <= MAX_ROW_ERRORS else f" (the first {MAX_ROW_ERRORS} listed)"
        source = Path(problems[0].meta["source"]).name
        raise DatasetError(f"{source}: {len(bad)} bad rows{shown}; fix them or the chat template "
                           f"(model.chat_template):\n  " + "\n  ".join(bad[:MAX_ROW_ERRORS]))


_PROBE = "relayrl-turn-end-probe"


def unstopped_turn_end(tokenizer, template_kwargs: Mapping[str, Any] | None,
                       stop_strings: Sequence[str], eos: Collection[int] = ()) -> str | None:
    """A line saying that the chat template closes an assistant turn with a special token the rollout does not
    stop at (neither the tokenizer's EOS, nor one of ``eos`` (the model's generation config's EOS ids:
    :func:`relayrl.models.eos.config_eos_ids`), nor one of ``stop_strings``, ``rollout.stop_strings``), and the fix;
    None when it stops there, or the template closes a turn with no special token. A model trained on the
    template's conversations (multi-turn SFT trains the turn's end) then ends its reply where the generation
    goes on to ``max_new_tokens``, past the reply the verifier should see."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    talk = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    text = tokenizer.apply_chat_template(talk, tokenize=False, **dict(template_kwargs or {}))
    after = text.rpartition(_PROBE)[2]
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = set(getattr(tokenizer, "all_special_tokens", ())) | {a.content for a in added if a.special}
    end = next((t for t in sorted(special, key=len, reverse=True) if t and after.startswith(t)), None)
    if end is None or end == tokenizer.eos_token or end in stop_strings:
        return None
    if tokenizer.convert_tokens_to_ids(end) in eos:
        return None
    return (f"relayrl: the chat template ends an assistant turn with {end!r}, which is neither the tokenizer's EOS "
            f"({tokenizer.eos_token!r}) nor an eos_token_id of the model's generation_config.json, so generation "
            f"does not stop there; add rollout.stop_strings=[{end!r}] "
            f"to end each response at the end of its turn, as a model trained on the template's turns does")
