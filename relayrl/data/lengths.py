"""Prompts against the model's context: ``relayrl train`` and ``relayrl eval`` refuse, before generating, a
token budget or a prompt that the model's ``max_position_embeddings`` cannot hold (positions past it were
never trained, and generating towards a huge budget runs for ever)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from relayrl.data.tasks import Problem

__all__ = ["context_limit", "check_context"]


def context_limit(model_dir: str | Path) -> int | None:
    """The ``max_position_embeddings`` of the model's ``config.json``; None when it has none (nothing to check)."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def check_context(problems: Sequence[Problem], encode: Callable[[Problem], list[int]], budget: int, key: str,
                  limit: int, model: str | Path) -> None:
    """Refuse ``key``'s ``budget`` of new tokens when it leaves no room for any prompt (ConfigError, with the
    largest budget that fits), then the first row whose prompt plus ``budget`` exceeds ``limit`` (DatasetError,
    naming the row, how many more rows are too long, and the largest budget that fits every prompt)."""
    from relayrl.config.loader import ConfigError
    from relayrl.data.errors import DatasetError

    lengths = [len(encode(p)) for p in problems]
    if not lengths:
        return
    fitting = [n for n in lengths if n < limit]
    if budget >= limit:
        most = f"at most {limit - max(fitting)} (the longest prompt is {max(fitting)} tokens)" if fitting else \
            "fewer tokens and shorter prompts"
        raise ConfigError(f"{key}={budget} new tokens cannot fit in the model's max_position_embeddings={limit} "
                          f"({model}) beside a prompt; give {most}")
    over = [i for i, n in enumerate(lengths) if n + budget > limit]
    if not over:
        return
    i, n = over[0], lengths[over[0]]
    p = problems[i]
    row = (f"{p.meta['source']} row {p.meta['row']}" if "row" in p.meta
           else f"held-out prompt {i + 1} ({p.prompt[:40]!r})")
    lower = f", or lower {key} to at most {limit - max(fitting)}" if n < limit else ""
    more = ""
    if len(over) > 1:
        rows = [str(problems[j].meta.get("row", j + 1)) for j in over[1:]]
        what = "rows" if "row" in p.meta else "prompts"
        more = f" ({len(rows)} more too long: {what} {', '.join(rows[:10])}{', ...' if len(rows) > 10 else ''})"
    raise DatasetError(f"{row}: the prompt is {n} tokens and {key}={budget} more make {n + budget}, beyond the "
                       f"model's max_position_embeddings={limit} ({model}); shorten or drop the row{lower}{more}")
