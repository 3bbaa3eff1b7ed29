"""The prompt source's retired rows (``data.retire_solved``): skipped in the rest of the epoch and in every
later one, identified by position (not by prompt text), kept in the checkpoint state, and an empty source
refuses to draw. Pure and fast: no model."""

from __future__ import annotations

import json

import pytest

from relayrl.data.tasks import Problem
from relayrl.workflows.session import PromptSource, RowsExhausted


def _rows(n: int) -> list[Problem]:
    return [Problem(f"{i}+{i}=", str(2 * i)) for i in range(n)]


def _walk(src: PromptSource, n: int) -> list[int]:
    """The positions of the next ``n`` problems (each the row at its position)."""
    drawn = src.take(n)
    assert len(drawn) == n and all(src.problems[i] is p for i, p in zip(drawn.positions, drawn))
    return drawn.positions


@pytest.mark.parametrize("shuffle", [True, False])
def test_retired_rows_are_skipped_in_the_rest_of_the_epoch_and_in_later_ones(shuffle):
    plain, src = PromptSource(5, problems=_rows(10), shuffle=shuffle), PromptSource(5, problems=_rows(10),
                                                                                    shuffle=shuffle)
    order = [plain.take(10).positions for _ in range(3)]  # the permutations of epochs 0, 1, 2 without retiring
    first = _walk(src, 4)
    assert first == order[0][:4]
    gone = {first[1], order[0][7], order[1][0]}  # one drawn already, one later this epoch, one first next epoch
    assert src.retire(gone) == 3 and src.retire([first[1]]) == 0  # (again: nothing new)
    assert src.active_rows == 7
    rest = _walk(src, 6)  # the rest of epoch 0 less its retired row, then epoch 1 less its retired rows
    assert rest == [i for i in order[0][4:] if i not in gone] + [i for i in order[1] if i not in gone][:1]
    later = _walk(src, 13)  # the permutations do not change: retired rows are just left out
    assert later == ([i for i in order[1] if i not in gone][1:] + [i for i in order[2] if i not in gone])[:13]
    assert not gone & set(later)
    assert src.consumed == 23 and src.epoch == 2


def test_rows_are_retired_by_position_so_duplicate_prompts_stay_apart():
    problems = [Problem("dup", "1"), Problem("dup", "1"), Problem("other", "2")]
    src = PromptSource(0, problems=problems, shuffle=False)
    assert src.take(3).positions == [0, 1, 2]
    src.retire([0])
    drawn = src.take(4)
    assert drawn.positions == [1, 2, 1, 2] and [p.prompt for p in drawn] == ["dup", "other", "dup", "other"]


def test_the_retired_set_is_part_of_the_state_and_survives_a_json_round_trip():
    src = PromptSource(3, problems=_rows(12))
    src.take(5)
    src.retire([4, 9, 0])
    state = json.loads(json.dumps(src.state()))  # (as a checkpoint's trainer state stores it)
    assert state["retired"] == [0, 4, 9]
    resumed = PromptSource(3, problems=_rows(12))
    resumed.load_state(state)
    assert resumed.retired == {0, 4, 9} and resumed.active_rows == 9
    assert resumed.take(20).positions == src.take(20).positions
    # fork (the prompts a run will draw, for precomputed reference log-probs): same rows, same order
    fork = src.fork()
    assert fork.retired == src.retired and fork.retired is not src.retired
    assert fork.take(7).positions == src.take(7).positions
    # a checkpoint from before data.retire_solved has no retired rows
    del state["retired"]
    old = PromptSource(3, problems=_rows(12))
    old.load_state(state)
    assert old.retired == set() and old.active_rows == 12


def test_fork_walks_in_the_sources_order_without_shuffle():
    src = PromptSource(3, problems=_rows(6), shuffle=False)
    src.take(2)
    assert src.fork().take(4).positions == [2, 3, 4, 5] == src.take(4).positions


def test_an_all_retired_source_refuses_to_draw_and_bad_positions_are_refused():
    src = PromptSource(1, problems=_rows(3))
    src.retire(range(3))
    assert src.active_rows == 0
    with pytest.raises(RowsExhausted, match="every one of the 3 training rows is retired"):
        src.take(1)
    assert src.take(0) == []
    with pytest.raises(ValueError, match="cannot retire row 3: the training set has rows 0..2"):
        PromptSource(1, problems=_rows(3)).retire([3])
    bad = PromptSource(1, problems=_rows(3))
    state = bad.state()
    state["retired"] = [5]
    with pytest.raises(ValueError, match="retires row 5, but the training set has 3 rows"):
        bad.load_state(state)


def test_a_built_in_task_draws_without_positions_and_has_no_rows():
    from relayrl.data.tasks import make_task

    src = PromptSource(0, task=make_task("arith"))
    drawn = src.take(3)
    assert drawn.positions == [None, None, None] and len(drawn) == 3
    assert src.active_rows is None and src.state()["retired"] == []


def test_a_resume_on_other_rows_is_told_apart_from_one_on_the_same_rows():
    """(A resume after the data file was edited or reordered walked the new rows without a word.)"""
    state = json.loads(json.dumps(PromptSource(5, problems=_rows(10)).state()))  # (as a checkpoint holds it)
    assert PromptSource(5, problems=_rows(10)).rows_changed(state) is None
    assert PromptSource(5, problems=_rows(11)).rows_changed(state) == "10 rows then, 11 now"
    swapped = _rows(10)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    assert "their prompts, answers or order differ" in PromptSource(5, problems=swapped).rows_changed(state)
    edited = _rows(10)
    edited[0] = Problem("0+0=", "1")
    assert PromptSource(5, problems=edited).rows_changed(state) is not None
    del state["rows"]  # a checkpoint from before the digest: nothing to compare
    assert PromptSource(5, problems=swapped).rows_changed(state) is None
