"""Text the run does not write itself, tokenized as plain text: what tools and environments write into an
episode's context, and a policy's response where a judge or a reward model reads it.

Such text (a tool's output, an environment's observation or reset text, a response) may hold the
tokenizer's special-token strings: a python tool that prints ``<|im_end|>``, a search result that quotes
``<|endoftext|>``. Tokenized the usual way, those strings become the special tokens themselves, so a tool's
output could close the model's turn, open a turn of another role or end the sequence in the context the model
is trained on. Here such text is plain: its special-token strings become ordinary text tokens (the tokenizer's
``split_special_tokens``) and decode back to the same text. Only the parts an environment marks with
:func:`markup` keep their special tokens: the chat template's own tokens around a tool message
(``env.tool_results=chat``), or the turns a user simulator renders itself::

    markup("<|im_end|>\\n<|im_start|>user\\n") + reply + markup("<|im_end|>\\n<|im_start|>assistant\\n")

A response a reward model or an LLM judge reads is plain text too: a policy that spells ``<|im_end|>`` with
ordinary tokens would otherwise close its turn in the scorer's context and write what follows (a forged
question, a forged verdict), a way to hack the reward.

Text whose plain parts hold no special-token string tokenizes exactly as the whole string always did; only
text that would have forged a special token is tokenized in pieces.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["EnvText", "markup", "env_parts", "cut_text", "EnvTextEncoder", "special_affixes"]


class EnvText(str):
    """Environment text made of plain parts and :func:`markup` parts; as a ``str`` it is the whole text, so it
    goes wherever an observation's text goes. ``+`` keeps the parts; any other string operation (slicing,
    f-strings, ``strip``) gives a plain ``str``, whose special-token strings are then all plain text: a lost
    mark can only make text plainer, never forge a token."""

    parts: tuple[tuple[str, bool], ...]
    """``(text, is markup)`` in order."""

    def __new__(cls, parts: tuple[tuple[str, bool], ...] = ()) -> "EnvText":
        parts = tuple((t, bool(m)) for t, m in parts if t)
        self = super().__new__(cls, "".join(t for t, _ in parts))
        self.parts = parts
        return self

    def __add__(self, other):
        return EnvText(self.parts + env_parts(other)) if isinstance(other, str) else NotImplemented

    def __radd__(self, other):  # (called before str.__add__: str + EnvText keeps the parts too)
        return EnvText(env_parts(other) + self.parts) if isinstance(other, str) else NotImplemented

    def __reduce__(self):
        return EnvText, (self.parts,)


def markup(text: str) -> EnvText:
    """``text`` whose special-token strings are the tokenizer's special tokens: the chat template's own text
    (an environment's wrapper around its observation), never what a tool or a user wrote."""
    return EnvText(((str(text), True),))


def env_parts(text: str) -> tuple[tuple[str, bool], ...]:
    """``(text, is markup)`` parts of environment text; a plain ``str`` is one plain part."""
    return text.parts if isinstance(text, EnvText) else (((text, False),) if text else ())


def cut_text(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, its :func:`markup` parts kept (an :class:`EnvText` stays one)."""
    if len(text) <= chars:
        return text
    if not isinstance(text, EnvText):
        return text[:chars]
    parts, left = [], chars
    for t, is_markup in text.parts:
        if left <= 0:
            break
        parts.append((t[:left], is_markup))
        left -= len(t)
    return EnvText(tuple(parts))


class EnvTextEncoder:
    """Token ids of environment text with ``tokenizer``: plain parts as plain text, :func:`markup` parts with
    their special tokens. Not thread-safe (a fast tokenizer is not): the episode loop calls it under its lock."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special = {s: tokenizer.convert_tokens_to_ids(s) for s in tokenizer.all_special_tokens}
        self.ids = {**{t.content: i for i, t in decoder.items()}, **special}
        """Each string the tokenizer matches before its model (its added and special tokens): its id."""
        self.special_ids = (set(special.values()) | {i for i, t in decoder.items() if t.special}) - _unknown(tokenizer)
        """The ids plain text must not produce."""
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        """The most characters one token's text holds (its vocabulary string's length bounds it)."""
        longest_first = sorted(self.ids, key=len, reverse=True)  # (as the tokenizer matches: <|im_end|> before <|im)
        self.pattern = re.compile("|".join(map(re.escape, longest_first))) if self.ids else None
        self.forged: Counter[str] = Counter()
        """The special tokens that plain text would have produced, tokenized the usual way."""

    def __call__(self, text: str) -> list[int]:
        """``text``'s ids. First encoded whole, as the tokenizer always did: when its special tokens are exactly
        those of the markup, that is the answer (the usual case: nothing changes, token for token). Else a plain
        part held a special-token string, and the text is encoded in pieces (:meth:`_pieces`)."""
        if not text:
            return []
        whole = self._encode(str(text), split=False)
        marked = self._marked(text)
        specials = [i for i in whole if i in self.special_ids]
        wanted = [i for _, _, i in marked if i in self.special_ids]
        if specials == wanted:
            return whole  # (the usual case: no plain part forged a special token; as the tokenizer always did)
        self.forged.update(self.tokenizer.convert_ids_to_tokens(list((Counter(specials) - Counter(wanted)).elements())))
        return self._pieces(str(text), marked)

    def head(self, text: str, room: int) -> list[int]:
        """The first ``room`` ids of ``text`` (:meth:`__call__`), encoding no more of it than they need: a tool
        that prints megabytes is cut before it is tokenized, not after (10 MB took 18 s). The text is cut at
        4 characters a token, then twice that until it gives ``room`` ids and a margin of 8 past them (the
        tokens near a cut can differ from the whole text's), or at the most characters ``room + 8`` tokens
        hold."""
        need = room + 8
        chars = 4 * need
        while True:
            if chars >= len(text) or chars >= need * self.max_token_chars:
                return self(cut_text(text, min(len(text), need * self.max_token_chars)))[:room]
            ids = self(cut_text(text, chars))
            if len(ids) >= need:
                return ids[:room]
            chars *= 2

    def _marked(self, text: str) -> list[tuple[int, int, int]]:
        """``(start, end, id)`` of the added tokens inside ``text``'s markup parts, each part matched on its own."""
        out, at = [], 0
        for t, is_markup in env_parts(text):
            if is_markup and self.pattern is not None:
                out += [(at + m.start(), at + m.end(), self.ids[m.group()]) for m in self.pattern.finditer(t)]
            at += len(t)
        return out

    def _pieces(self, text: str, marked: list[tuple[int, int, int]]) -> list[int]:
        """The markup's added tokens by id, the text between them as plain text: the pieces the tokenizer itself
        splits a string into at its added tokens, with none taken from the plain parts."""
        ids, at = [], 0
        for start, end, i in marked:
            ids += self._encode(text[at:start], split=True)
            ids.append(i)
            at = end
        return ids + self._encode(text[at:], split=True)

    def _encode(self, text: str, split: bool) -> list[int]:
        """``text``'s ids: as plain text (``split``), or as the tokenizer always encodes (its own defaults)."""
        if not text:
            return []
        kw = {"split_special_tokens": True} if split else {}
        ids = list(self.tokenizer(text, add_special_tokens=False, **kw)["input_ids"])
        if split and (kept := [i for i in ids if i in self.special_ids]):
            raise RuntimeError(f"the tokenizer {type(self.tokenizer).__name__} kept the special token "
                               f"{self.tokenizer.convert_ids_to_tokens(kept[0])!r} of environment text that "
                               "should be plain (it does not honour split_special_tokens)")
        return ids


def _unknown(tokenizer) -> set[int]:
    """The unknown token's id when it is that alone: plain text may produce it (a character the vocabulary
    lacks), and it marks no boundary. Not when it is also the end of sequence or another role's token (the tiny
    tokenizer's ``<|endoftext|>`` is both)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "sep", "cls", "mask")}
    return {unk} if unk is not None and unk not in roles else set()


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text by default (``add_special_tokens``: a BOS for
    Llama-family tokenizers, nothing for Qwen's), for text encoded without them (:class:`EnvTextEncoder`)."""
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if not bare or at is None:
        raise RuntimeError(f"the tokenizer {type(tokenizer).__name__} encodes 'a' as {full} with its special tokens "
                           f"and as {bare} without: not the same text between added tokens")
    return full[:at], full[at + len(bare):]
