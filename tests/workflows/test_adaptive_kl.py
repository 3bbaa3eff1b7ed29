"""The adaptive KL coefficient (Ziegler et al. 2019) from config, in every step mode: it moves the way the
controller says, is logged as actor/kl_coef, reaches the loss or the rewards, and survives a resume. The
adaptive entropy coefficient (Skywork-OR1) the same way: logged as actor/entropy_coef, checkpointed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from e2e_cli import FAST, records, relayrl

ROWS = 16  # data.prompts_per_step=2 x rollout.n=8
# kl_target far below any KL after an update; the horizon = one step's samples, so each step moves the
# coefficient by the clip: x0.8 after step 1 (the policy is still the reference: KL exactly 0), x1.2 after
ADAPTIVE = ["algorithm.kl_coef=0.05", "algorithm.kl_target=1e-12", f"algorithm.kl_horizon={ROWS}",
            "data.prompts_per_step=2", "rollout.n=8", "engine.optim={lr: 1.0e-3, warmup_steps: 0}",
            "algorithm.entropy_coef=0.01"]  # (the untrained model scores 0 everywhere: the entropy term moves it)
MODES = {
    "sync": [],
    "periodic": ["placement.pools.gen=1", "placement.rollout=gen", "trainer.mode=periodic"],
    "off-policy": ["trainer.off_policy_steps=1"],
    "kl-in-reward": ["algorithm.advantage=reinforce++", "algorithm.kl_in_reward=true"],
}


def _coefs(run_dir) -> dict[int, tuple[float, float]]:
    """step -> (actor/kl_coef, the KL the controller saw)."""
    out = {}
    for r in records(run_dir):
        if "actor/kl_coef" in r:
            out[r["step"]] = (r["actor/kl_coef"], r.get("actor/reward_kl", r.get("actor/kl_loss")))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_adaptive_kl_coefficient_follows_the_controller(tmp_path, mode):
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=3", f"run.dir={tmp_path}", *ADAPTIVE,
                *MODES[mode], *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    c = _coefs(tmp_path)
    assert sorted(c) == [1, 2, 3]
    assert c[1][0] == pytest.approx(0.05)
    assert c[1][1] == pytest.approx(0.0, abs=1e-9)  # step 1: the policy is the reference
    assert c[2][0] == pytest.approx(0.05 * 0.8)  # KL 0 < target: the coefficient falls by the clip
    assert c[2][1] > 1e-10  # after an update the KL is above the (tiny) target ...
    assert c[3][0] == pytest.approx(0.05 * 0.8 * 1.2)  # ... so it rises by the clip


@pytest.mark.slow
def test_adaptive_entropy_coefficient_applies_below_the_target_only(tmp_path):
    """The tiny model's entropy is about 5.9 nats: a target of 100 is above it (the bonus applies and its
    coefficient climbs by delta each step), a target of 1 below it (after step 1 the bonus is off, and the
    coefficient falls underneath)."""
    for target, expected in ((100.0, [0.01, 0.015, 0.02]), (1.0, [0.01, 0.0, 0.0])):
        run_dir = tmp_path / str(target)
        r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=3", f"run.dir={run_dir}", *ADAPTIVE,
                    f"algorithm.entropy_target={target}", "algorithm.entropy_coef_delta=0.005", *FAST)
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [x for x in records(run_dir) if x["step"] > 0]
        assert [x["actor/entropy_coef"] for x in recs] == pytest.approx(expected)
        assert all(3.0 < x["actor/entropy"] < 10.0 for x in recs)


@pytest.mark.slow
def test_adaptive_kl_coefficient_survives_a_resume(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = [*ADAPTIVE, "run.save_every=2", "algorithm.kl_target=1.0", *FAST,  # KL << 1: falls every step
              "algorithm.entropy_target=100", "algorithm.entropy_coef_delta=0.005"]  # entropy < 100: rises
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=4", f"run.dir={whole}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={cut}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=4", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = {s: 0.05 * 0.8 ** (s - 1) for s in (1, 2, 3, 4)}
    assert {s: v for s, (v, _) in _coefs(whole).items()} == pytest.approx(expected)
    assert {s: v for s, (v, _) in _coefs(cut).items() if s > 2} == pytest.approx({3: expected[3], 4: expected[4]})
    entropy = {r["step"]: r["actor/entropy_coef"] for r in records(cut) if r["step"] > 2}
    assert entropy == pytest.approx({3: 0.02, 4: 0.025})  # 0.01 + 0.005 per step before it, across the resume


def test_adaptive_kl_config_checks():
    from relayrl.config.schema import AlgorithmConfig

    with pytest.raises(ValidationError, match="algorithm.kl_target adapts the KL coefficient from algorithm.kl_coef"):
        AlgorithmConfig(kl_target=0.1)
    with pytest.raises(ValidationError, match="algorithm.kl_horizon=500 paces the adaptive KL"):
        AlgorithmConfig(kl_coef=0.1, kl_horizon=500)
    assert AlgorithmConfig(kl_coef=0.1, kl_target=0.05, kl_horizon=500).kl_target == 0.05
    with pytest.raises(ValidationError, match="set algorithm.entropy_target"):
        AlgorithmConfig(entropy_coef_delta=0.01)
    with pytest.raises(ValidationError, match=r"outside \[entropy_coef_min, entropy_coef_max\]"):
        AlgorithmConfig(entropy_coef=0.5, entropy_target=0.2, entropy_coef_max=0.1)
