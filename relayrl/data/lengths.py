"""Prompts against the model's context and ``data.max_prompt_tokens``: ``relayrl train`` and ``relayrl eval``
refuse, before generating, a token budget or a prompt that the model's ``max_position_embeddings`` cannot hold
(positions past it were never trained, and generating towards a huge budget runs for ever); a run config may
also cap a prompt's tokens (``data.max_prompt_tokens``) and leave the longer rows out
(``data.long_prompts=drop``) instead of refusing them. A prompt is never cut: a cut question can change its
answer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from relayrl.data.tasks import Problem

__all__ = ["context_limit", "over_limit", "PromptRoom", "too_long", "fit_prompts", "fit_whole"]


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions")
"""Where a ``config.json`` keeps the context (``n_positions``: GPT-2, GPT-J and CodeGen, which transformers reads
as ``max_position_embeddings``)."""


def context_limit(model_dir: str | Path) -> int | None:
    """The ``max_position_embeddings`` of the model's ``config.json`` (``n_positions`` in GPT-2's; its
    ``text_config``'s in a multimodal one's); None when it has none (nothing to check)."""
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (conf, conf.get("text_config") if isinstance(conf, dict) else None):
        for key in _CONTEXT_KEYS:
            if isinstance(c, dict) and isinstance(c.get(key), int):
                return c[key]
    return None


def over_limit(lengths: Sequence[int], *, max_tokens: int | None = None, room: int | None = None) -> list[int]:
    """Indices, in order, of the prompt ``lengths`` (tokens) above ``max_tokens`` (``data.max_prompt_tokens``)
    or above ``room`` (the model's context less the tokens generated after a prompt); None: no such limit."""
    caps = [c for c in (max_tokens, room) if c is not None]
    if not caps:
        return []
    cap = min(caps)
    return [i for i, n in enumerate(lengths) if n > cap]


@dataclass(frozen=True)
class PromptRoom:
    """What every prompt of a set must fit: ``max_tokens`` (``data.max_prompt_tokens``; None: no cap), and the
    model's context ``limit`` (``max_position_embeddings`` of ``model``; None: unknown) beside ``budget`` new
    tokens (``key``'s; None: the set is not generated from, e.g. SFT's training rows). ``drop``: the setting that
    leaves the longer rows out, as the messages name it (``relayrl eval``'s flag there)."""

    max_tokens: int | None = None
    budget: int | None = None
    key: str = ""
    limit: int | None = None
    model: str | Path = ""
    drop: str = "data.long_prompts=drop"
    limit_key: str = ""
    """The key that set ``limit`` when it is not the model's context (``rollout.vllm.max_model_len``)."""

    @property
    def context(self) -> str:
        """The limit as the messages name it: ``the model's max_position_embeddings=512 (DIR)``, or
        ``rollout.vllm.max_model_len=256``."""
        if self.limit_key:
            return f"{self.limit_key}={self.limit}"
        return f"the model's max_position_embeddings={self.limit} ({self.model})"

    @property
    def room(self) -> int | None:
        """The longest prompt the context holds beside the budget (None: nothing to check)."""
        return None if self.limit is None or self.budget is None else self.limit - self.budget

    @property
    def checks(self) -> bool:
        """Whether there is any limit to measure the prompts against."""
        return self.max_tokens is not None or self.room is not None

    def capped(self, n: int) -> bool:
        """Whether a prompt of ``n`` tokens is over ``data.max_prompt_tokens`` (else, if over, the context's)."""
        return self.max_tokens is not None and n > self.max_tokens


def _row(problems: Sequence[Problem], i: int) -> str:
    """``d.jsonl row 7`` (the row's original number), or a built-in task's ``held-out prompt 3 ('...')``."""
    p = problems[i]
    return (f"{p.meta['source']} row {p.meta['row']}" if "row" in p.meta
            else f"held-out prompt {i + 1} ({p.prompt[:40]!r})")


def _more(problems: Sequence[Problem], over: Sequence[int]) -> str:
    """`` (2 more too long: rows 3, 4)`` for the rows after the first (their original row numbers)."""
    if len(over) < 2:
        return ""
    rows = [str(problems[j].meta.get("row", j + 1)) for j in over[1:]]
    what = "rows" if "row" in problems[over[0]].meta else "prompts"
    return f" ({len(rows)} more too long: {what} {', '.join(rows[:10])}{', ...' if len(rows) > 10 else ''})"


def _check_budget(lengths: Sequence[int], room: PromptRoom) -> None:
    """Refuse a budget that leaves no room for any prompt (ConfigError, with the largest budget that fits)."""
    from relayrl.config.loader import ConfigError

    if room.room is None or room.room > 0:
        return
    fitting = [n for n in lengths if n < room.limit]
    most = f"at most {room.limit - max(fitting)} (the longest prompt is {max(fitting)} tokens)" if fitting else \
        "fewer tokens and shorter prompts"
    raise ConfigError(f"{room.key}={room.budget} new tokens cannot fit in {room.context} beside a prompt; give "
                      f"{most}")


def too_long(problems: Sequence[Problem], lengths: Sequence[int], over: Sequence[int],
             room: PromptRoom) -> Exception:
    """The DatasetError refusing ``over`` (indices from :func:`over_limit`, at least one): it names the first
    row, its length, the limit it passes, how many more rows are too long, and the fixes (among them
    ``room.drop``: ``data.long_prompts=drop``, or ``relayrl eval``'s ``--long-prompts drop``)."""
    from relayrl.data.errors import DatasetError

    i = over[0]
    n, row = lengths[i], _row(problems, i)
    drop = f", or set {room.drop} to leave out every such row"
    if room.capped(n):
        return DatasetError(f"{row}: the prompt is {n} tokens, longer than data.max_prompt_tokens={room.max_tokens}; "
                            f"raise data.max_prompt_tokens, shorten or drop the row{drop}{_more(problems, over)}")
    fitting = [m for m in lengths if m < room.limit and not room.capped(m)]  # (n among them)
    lower = f", or lower {room.key} to at most {room.limit - max(fitting)}" if n < room.limit else ""
    return DatasetError(f"{row}: the prompt is {n} tokens and {room.key}={room.budget} more make {n + room.budget}, "
                        f"beyond {room.context}; shorten or drop "
                        f"the row{lower}{drop}{_more(problems, over)}")


def _why(lengths: Sequence[int], over: Sequence[int], room: PromptRoom) -> str:
    """Why the ``over`` prompts are too long: ``longer than data.max_prompt_tokens=512 tokens``, ``too long
    for the model's max_position_embeddings=...``, or both, counted (``10 longer than ..., 2 too long ...``)."""
    capped = sum(room.capped(lengths[i]) for i in over)
    parts = []
    if capped:
        parts.append(f"longer than data.max_prompt_tokens={room.max_tokens} tokens")
    if capped < len(over):
        limit = room.limit_key or "the model's max_position_embeddings"
        parts.append(f"too long for {limit}={room.limit} beside {room.key}={room.budget} (over {room.room} tokens)")
    return parts[0] if len(parts) == 1 else f"{capped} {parts[0]}, {len(over) - capped} {parts[1]}"


def _all_dropped(what: str, lengths: Sequence[int], over: Sequence[int], room: PromptRoom) -> Exception:
    """The ConfigError refusing a drop that would leave no ``what`` prompt, with the limit that keeps the
    shortest."""
    from relayrl.config.loader import ConfigError

    shortest = min(lengths)
    fixes = []
    if room.capped(shortest):
        fixes.append(f"raise data.max_prompt_tokens to at least {shortest}")
    if room.room is not None and shortest > room.room:
        fixes.append(f"lower {room.key} to at most {room.limit - shortest}" if shortest < room.limit
                     else f"use a model whose context holds {shortest} tokens and more")
    return ConfigError(f"{room.drop} would drop all {len(lengths)} {what} prompts "
                       f"({_why(lengths, over, room)}; the shortest is {shortest} tokens): {' and '.join(fixes)}")


def fit_prompts(problems: list[Problem], encode: Callable[[Problem], list[int]], room: PromptRoom, *,
                drop: bool, what: str, log: Callable[[str], None]) -> list[Problem]:
    """The ``what`` (training, held-out) prompts that fit ``room``, measured with ``encode`` (the run's own
    token ids: chat template, system prompt). A budget that leaves no room is refused (ConfigError); a prompt
    too long is refused (DatasetError, :func:`too_long`), or with ``drop`` left out: the rows kept keep their
    identities (``meta["row"]``, ``meta["source"]``) and order, one line says how many were dropped and why,
    and a set with no row left is refused (ConfigError). Nothing is measured when ``room`` has no limit."""
    if not room.checks or not problems:
        return problems
    lengths = [len(encode(p)) for p in problems]
    _check_budget(lengths, room)
    over = over_limit(lengths, max_tokens=room.max_tokens, room=room.room)
    if not over:
        return problems
    if not drop:
        raise too_long(problems, lengths, over, room)
    if len(over) == len(problems):
        raise _all_dropped(what, lengths, over, room)
    why = _why(lengths, over, room)
    log(f"relayrl: {room.drop}: dropped {len(over)} of {len(problems)} {what} prompts"
        f"{':' if why[0].isdigit() else ''} {why}")
    gone = set(over)
    return [p for i, p in enumerate(problems) if i not in gone]


def fit_whole(problems: list[Problem], lengths: Sequence[int], limit: int, model: str | Path, *, drop: bool,
              log: Callable[[str], None]) -> list[Problem]:
    """The training rows whose whole trained sequence (``lengths``: prompt + answer + EOS, the longer answer of a
    pair) fits the model's context ``limit``: the workflows that train on a dataset's answers (sft, dpo, kto, rm).
    A longer row is refused (DatasetError naming it, its length and the rows after it), or with ``drop`` left
    out with one line, as :func:`fit_prompts` does; a row is never cut (TRL's trainers cut it at ``max_length``)."""
    from relayrl.data.errors import DatasetError

    over = over_limit(lengths, room=limit)
    if not over:
        return problems
    if not drop:
        i = over[0]
        raise DatasetError(f"{_row(problems, i)}: the prompt and its answer are {lengths[i]} tokens with the EOS, "
                           f"beyond the model's max_position_embeddings={limit} ({model}); shorten or drop the row, "
                           f"or set data.long_prompts=drop to leave out every such row{_more(problems, over)}")
    if len(over) == len(problems):
        raise DatasetError(f"every training row is longer than the model's max_position_embeddings={limit} "
                           f"({model}) as prompt + answer + EOS")
    log(f"relayrl: data.long_prompts=drop: dropped {len(over)} of {len(problems)} training rows longer than the "
        f"model's max_position_embeddings={limit} as prompt + answer + EOS")
    gone = set(over)
    return [p for i, p in enumerate(problems) if i not in gone]
