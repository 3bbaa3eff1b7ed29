"""The context check that ``relayrl train`` and ``relayrl eval`` share (``relayrl.data.lengths``)."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError
from relayrl.data.errors import DatasetError
from relayrl.data.lengths import check_context
from relayrl.data.tasks import Problem


def _rows(*lengths: int) -> list[Problem]:
    return [Problem("x" * n, "1", {"row": i, "source": "d.jsonl"}) for i, n in enumerate(lengths, start=1)]


def _encode(p: Problem) -> list[int]:
    return [0] * len(p.prompt)


def test_a_budget_past_the_context_names_the_largest_that_fits():
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=600 new tokens cannot fit in the model's "
                       r"max_position_embeddings=512 \(m\) beside a prompt; give at most 482 \(the longest prompt"):
        check_context(_rows(10, 30), _encode, 600, "rollout.max_new_tokens", 512, "m")


def test_every_prompt_too_long_is_counted_and_the_largest_budget_fits_all_the_others():
    with pytest.raises(DatasetError) as info:
        check_context(_rows(10, 600, 400, 700), _encode, 200, "eval.max_new_tokens", 512, "m")
    assert str(info.value) == ("d.jsonl row 2: the prompt is 600 tokens and eval.max_new_tokens=200 more make 800, "
                               "beyond the model's max_position_embeddings=512 (m); shorten or drop the row "
                               "(2 more too long: rows 3, 4)")
    with pytest.raises(DatasetError, match=r"row 2: .* or lower k to at most 112$"):
        check_context(_rows(10, 400), _encode, 200, "k", 512, "m")
    check_context(_rows(10, 312), _encode, 200, "k", 512, "m")  # exactly fits
