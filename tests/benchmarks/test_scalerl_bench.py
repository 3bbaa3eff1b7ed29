"""benchmarks/scalerl.py: its recipes are the ones it names, the ScaleRL one differs from GRPO's in ScaleRL's
choices only, and (slow) the whole comparison runs on the tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import scalerl  # noqa: E402

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_scalerls_recipe_is_grpos_with_scalerls_choices():
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    grpo, s = (load_config(Config, RECIPES / f"{scalerl.RECIPES[n]}.yaml", []) for n in ("grpo", "scalerl"))
    a = s.algorithm
    assert (a.policy_loss, a.old_logprobs, a.loss_agg, a.advantage) == \
        ("cispo", "rollout", "prompt-mean-token-mean", "grpo-batch-std")
    assert 1 + a.clip_high == 4.0 and 1 - a.clip_low < 0.01  # the IS weight in (0, 4]: ScaleRL's epsilon_max
    assert a.dynamic_sampling and a.max_resample_rounds == 0  # zero-variance filtering, no resampling
    assert s.trainer.off_policy_steps == 8 and s.rollout.partial  # PipelineRL-8
    for section in ("data", "rollout", "engine", "eval"):  # the task, sampling, schedule and evaluation of GRPO's
        g, x = getattr(grpo, section).model_dump(), getattr(s, section).model_dump()
        assert {k: v for k, v in x.items() if k != "partial"} == {k: v for k, v in g.items() if k != "partial"}
    assert s.trainer.steps == grpo.trainer.steps


@pytest.mark.slow
def test_the_comparison_runs_and_ends_with_its_line(tmp_path, tiny_dir, monkeypatch, capsys):
    """The student is the tiny model (no training of the demo's models): every run trains, evaluates at the asked
    steps, and the last line has the asked form."""
    import demo_models

    monkeypatch.setattr(demo_models, "sft_model", lambda seed=0, overrides=(): tiny_dir)
    scalerl.main(["--steps", "2", "--eval-every", "1", "--eval-size", "8", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("scalerl: held-out accuracy at the end (2 steps): grpo ")
    assert ", dapo " in last and ", scalerl " in last and ", online-dpo " in last and "; wall grpo " in last
    for name in scalerl.RECIPES:
        assert sorted(scalerl.curve(tmp_path / name)) == [0, 1, 2], name
