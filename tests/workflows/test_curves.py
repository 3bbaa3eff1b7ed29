"""Stored known-good learning curves of the tiny model: GRPO, DAPO, PPO and DPO (slow, about a minute here).

A change that silently breaks learning (a sign, a mask, a detached tensor, a
learning rate that never reaches the optimizer) still passes every unit test;
it does not reproduce these curves. Each run starts from the same small SFT
model (the ``base_model`` fixture: 100 SFT steps on one-digit sums, held-out
greedy accuracy 0.44), trains a few dozen steps with a fixed seed, and its
per-step metrics are compared with ``tests/workflows/curves/<name>.json``.
GRPO, DAPO and PPO train 60 steps (8 prompts x 8) on one-digit sums; DPO 30
steps on the recipe's two-digit carry sums (one-digit sums have no careless
answer to reject).

Regenerate the stored curves after an intended change of the learning
dynamics (say why in the commit)::

    RELAYRL_UPDATE_CURVES=1 .venv/bin/python -m pytest -q tests/workflows/test_curves.py

What is compared, and the tolerance (see ``TOLERANCE``): the means of each
curve over windows of ``WINDOW`` steps, not single steps. On the machine that
stored them the runs are bit-reproducible (same seed, fp32, one thread), but
another CPU, BLAS or torch version changes the float rounding, the sampled
tokens diverge after a few steps and the run is then no closer to the stored
one than a run with another seed. The tolerances are therefore the spread
over seeds: ``SEED_SPREAD`` is the largest distance of any window mean of any
compared curve from the stored one, over seeds 0-5 run on another machine
(2026-11-23, AMD EPYC; the 2026-11-22 figures from seeds 1 and 2 on the
storing machine were too small: 3 of the 4 curves failed there with seed 0
or another seed), times 1.25, and at least 0.05 (about two standard errors
of the difference of two 20-step window means of a reward whose per-step
standard deviation is 0.08, as measured here; three seeds can underestimate a
spread). A learner that stops is further away: with ``engine.optim.lr=1e-9``
GRPO's window means are 0.45, 0.46, 0.44 against the stored 0.51, 0.59, 0.59,
0.16 off in the last window (tolerance 0.103). In a few dozen steps the tiny
model gains about as much as the seed spread (GRPO +0.08, PPO +0.07, DAPO
+0.05 reward; DPO's loss falls by 0.38), so the GRPO and DPO tests also check
that their stored curve learns by more than half the tolerance (a flat curve
cannot be stored by mistake); PPO's and DAPO's gains are below that
(``UNDER_SPREAD``): their curves catch a collapse, not a learner that stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from e2e_cli import records, relayrl

CURVES = Path(__file__).resolve().parent / "curves"
UPDATE = os.environ.get("RELAYRL_UPDATE_CURVES") == "1"
WINDOW = 20  # steps per window mean (10 for the 30-step DPO run)

TINY = ["run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
        "eval.size=32", "data.eval_task_options={}"]
ONE_DIGIT = "data.task_options={min_digits: 1, max_digits: 1}"
RL = [ONE_DIGIT, "trainer.steps=60", "engine.optim.lr=3e-4", "engine.optim.warmup_steps=0", "eval.every=20"]

# name -> (recipe, overrides, the curves compared, window)
RUNS: dict[str, tuple[str, list[str], tuple[str, ...], int]] = {
    "grpo": ("arith_grpo", RL, ("reward/mean", "train/accuracy"), WINDOW),
    "dapo": ("arith_dapo", RL, ("reward/mean", "train/accuracy"), WINDOW),
    "ppo": ("arith_ppo", RL, ("reward/mean", "train/accuracy"), WINDOW),
    # two-digit sums that need a carry (the recipe's): one-digit sums have no careless answer to reject
    "dpo": ("arith_dpo", ["trainer.steps=30", "eval.every=10"], ("dpo/loss", "dpo/reward_accuracy"), 10),
}
SEED_SPREAD = {"grpo": 0.082, "dapo": 0.107, "ppo": 0.112, "dpo": 0.201}  # seeds 0-5 vs stored (module docstring)
TOLERANCE = {name: round(max(1.25 * spread, 0.05), 3) for name, spread in SEED_SPREAD.items()}
# PPO and DAPO gain +0.07 and +0.05 reward in 60 steps, less than half their seed spread (module docstring)
UNDER_SPREAD = {"ppo", "dapo"}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("curve-sft")
    r = relayrl("train", "recipes/arith_sft.yaml", f"run.dir={run}", *TINY, "trainer.steps=100", "eval.every=50",
                "data.task_options={min_digits: 1, max_digits: 1, forget_carry: 0.7}", "engine.optim.lr=3e-3")
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "model"


def run_curves(name: str, base: Path, run_dir: Path, seed: int = 0) -> dict[str, list[float]]:
    """Train run ``name`` from ``base``; its per-step curves (and held-out accuracy at eval steps)."""
    recipe, overrides, keys, _ = RUNS[name]
    r = relayrl("train", f"recipes/{recipe}.yaml", f"run.dir={run_dir}", f"trainer.init_from={base}",
                f"run.seed={seed}", *TINY, *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run_dir)
    out = {k: [x[k] for x in recs if k in x] for k in keys}
    out["eval/accuracy"] = [x["eval/accuracy"] for x in recs if "eval/accuracy" in x]
    return out


def window_means(curve: list[float], window: int) -> list[float]:
    """Means of consecutive ``window``-step windows (a last partial window is dropped)."""
    return [sum(curve[i:i + window]) / window for i in range(0, len(curve) - window + 1, window)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_learning_curve_matches_the_stored_one(name, base_model, tmp_path):
    got = run_curves(name, base_model, tmp_path)
    path = CURVES / f"{name}.json"
    if UPDATE:
        path.write_text(json.dumps({"runs": RUNS[name][:2], **got}, indent=1) + "\n")
        pytest.skip(f"stored {path}")
    stored = json.loads(path.read_text())
    window, tol = RUNS[name][3], TOLERANCE[name]
    for key in RUNS[name][2]:
        assert len(got[key]) == len(stored[key]), key
        want, have = window_means(stored[key], window), window_means(got[key], window)
        assert all(abs(a - b) <= tol for a, b in zip(want, have)), (
            f"{name} {key}: window means {[round(x, 3) for x in have]} moved from the stored "
            f"{[round(x, 3) for x in want]} by more than {tol} (see this module's docstring to regenerate)")
    first_key = RUNS[name][2][0]
    w = window_means(stored[first_key], window)
    learned = w[0] - w[-1] if first_key.endswith("loss") else w[-1] - w[0]
    assert name in UNDER_SPREAD or learned > tol / 2, f"the stored {name} curve does not learn: {w}"
