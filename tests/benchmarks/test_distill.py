"""benchmarks/distill.py: its figures from the runs' metrics, and (slow) the whole comparison on tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import distill  # noqa: E402


def test_steps_to_the_target_and_the_curve(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "eval/accuracy": 0.2}, {"step": 1, "reward/mean": 0.1}, {"step": 10, "eval/accuracy": 0.6},
        {"step": 20, "eval/accuracy": 0.9}, {"step": 30, "eval/accuracy": 0.85}]))
    acc = distill.curve(tmp_path)
    assert acc == {0: 0.2, 10: 0.6, 20: 0.9, 30: 0.85}
    assert distill.steps_to(acc, 0.9 * 0.95, 30) == "20"
    assert distill.steps_to(acc, 0.95, 30) == ">30"


def test_the_side_by_side_table_and_last_line(capsys):
    """The helpers losses.py and pref_losses.py print with: a column a run, and each run's last accuracy."""
    acc = {"ppo": {0: 0.09, 10: 0.5, 40: 0.89}, "gpg": {0: 0.09, 40: 0.905}}
    distill.print_curves(acc, ["ppo", "gpg"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["step", "ppo", "gpg"] and rows[2].split() == ["10", "50.0%", "nan%"]
    assert distill.final_accuracy(acc, ["ppo", "gpg"]) == "ppo 89.0%, gpg 90.5% (student 9.0%)"


@pytest.mark.slow
def test_the_comparison_runs_and_ends_with_its_line(tmp_path, tiny_dir, monkeypatch, capsys):
    """Teacher and student both the tiny model (no training of the demo's models): both runs train, evaluate
    at the asked steps, and the last line has the asked form."""
    import demo_models

    monkeypatch.setattr(distill, "teacher_model", lambda seed, steps, stop, threads=(): (tiny_dir, 0.5))
    monkeypatch.setattr(demo_models, "sft_model", lambda seed=0, overrides=(): tiny_dir)
    distill.main(["--steps", "2", "--eval-every", "1", "--eval-size", "8", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("distill: opd ") and "after 2 steps (teacher 50.0%); steps to 90% of teacher: opd " in last
    assert sorted(distill.curve(tmp_path / "opd")) == [0, 1, 2] == sorted(distill.curve(tmp_path / "grpo"))
