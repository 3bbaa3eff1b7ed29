"""benchmarks/retire.py: the training sums it writes are the demo task's, none held out, and its held-out file is
the task's own held-out set."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import retire  # noqa: E402


def test_the_training_sums_are_distinct_and_none_is_held_out(tmp_path):
    train, held = retire.write_sums(tmp_path, 40, seed=3)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held_rows = [json.loads(x) for x in held.read_text().splitlines()]
    assert len(rows) == 40 and len({r["prompt"] for r in rows}) == 40 and len(held_rows) == 200
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held_rows}
    for r in rows:
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        assert r["answer"] == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99
    assert retire.write_sums(tmp_path / "again", 40, seed=3)[0].read_text() == train.read_text()
