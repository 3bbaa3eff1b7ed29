"""The async_flow benchmark's ceiling: the time until a step's samples are generated and scored."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from async_flow import scored_s  # noqa: E402


def span(name, step, start, end):
    return json.dumps({"name": name, "step": step, "start": start, "end": end})


def test_scored_time_ends_at_the_last_reward_or_advantage_not_the_update(tmp_path):
    f = tmp_path / "spans.jsonl"
    f.write_text("\n".join([
        span("generate", 3, 10.0, 10.8), span("reward", 3, 10.2, 11.0), span("advantage", 3, 11.0, 11.1),
        span("update", 3, 11.1, 11.7), span("relay", 3, 11.7, 11.8),
        span("generate", 4, 12.0, 12.5), span("reward", 4, 12.4, 12.7), span("update", 4, 12.7, 13.0),
        span("generate", 1, 0.0, 5.0),  # a warm-up step, not asked for
    ]))
    assert scored_s(f, {3, 4}) == pytest.approx((1.1 + 0.7) / 2)
    assert math.isnan(scored_s(tmp_path / "missing.jsonl", {3}))
