"""The async_flow benchmark's ceiling (the time until a step's samples are generated and scored) and its rounds."""

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from async_flow import round_ends, scored_s, summarize  # noqa: E402


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


def test_rounds_cover_every_step_once():
    assert round_ends(100, 1) == [100]
    assert round_ends(100, 4) == [25, 50, 75, 100]
    assert round_ends(10, 3) == [3, 7, 10]


def test_summary_leaves_out_the_first_warmup_steps_of_every_round(tmp_path):
    """A round starts a fresh process, whose first steps are slow: with rounds ending at steps 3 and 6 and
    --warmup 1, steps 1 and 4 are left out of the averages."""
    run = tmp_path / "periodic-split"
    run.mkdir()
    slow = {1: 9.0, 4: 7.0}
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    rows += [{"step": s, "perf/step_time_s": slow.get(s, 1.0 + s / 100), "perf/tokens": 100.0,
              "response/length_mean": 5.0, "response/clip_ratio": 0.0} for s in range(1, 7)]
    rows += [{"step": 6, "eval/accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    a = argparse.Namespace(warmup=1)
    r = summarize("periodic-split", tmp_path, a, starts=[1, 4], wall=12.0)
    assert r["step_s"] == pytest.approx((1.02 + 1.03 + 1.05 + 1.06) / 4)
    assert (r["accuracy0"], r["accuracy"], r["wall_s"]) == (0.1, 0.9, 12.0)
