"""A run resumed with another trainer.mini_batches / trainer.epochs (optimizer steps per RL step) goes on with
the LR its new settings give at the checkpoint's step: the scheduler, which counts optimizer steps, is moved
there at restore (actor and critic)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.training.config import OptimConfig
from relayrl.engines.training.steps import make_scheduler, rescaled_scheduler_state


def _at(cfg: OptimConfig, total: int, state: dict | None = None, steps: int = 0) -> tuple[float, dict]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    sched = make_scheduler(opt, cfg, total)
    if state is not None:
        sched.load_state_dict(state)
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched.get_last_lr()[0], sched.state_dict()


def test_the_scheduler_position_moves_to_the_new_optimizer_steps_per_rl_step():
    cfg = OptimConfig(lr=1.0, schedule="linear", warmup_steps=0)
    _, saved = _at(cfg, total=8 * 1, steps=3)  # 3 RL steps x 1 optimizer step
    moved = rescaled_scheduler_state(saved, 1, 4)
    assert moved["last_epoch"] == 12 and saved["last_epoch"] == 3  # (a copy)
    lr, _ = _at(cfg, total=8 * 4, state=moved)
    want, _ = _at(cfg, total=8 * 4, steps=12)  # the new settings' run at RL step 3
    assert lr == pytest.approx(want) and want == pytest.approx(1 - 12 / 32)
    assert rescaled_scheduler_state(saved, 2, 2) is saved and rescaled_scheduler_state(None, 1, 4) is None
    assert rescaled_scheduler_state({"last_epoch": 12, "_step_count": 13}, 4, 1) == {"last_epoch": 3,
                                                                                      "_step_count": 4}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_resume_with_more_mini_batches_trains_at_the_lr_the_new_settings_give(tmp_path, tiny_dir, estimator):
    from grpo_runs import run_grpo

    common = ["engine.optim.schedule=linear", "engine.optim.lr=1e-3", "run.save_every=2", "data.prompts_per_step=4",
              f"algorithm.advantage={estimator}"]
    if estimator == "gae":
        common += ["critic.optim.schedule=linear", "critic.optim.lr=1e-3"]
    run_grpo(tmp_path / "cut", tiny_dir, "trainer.steps=2", *common)
    resumed = run_grpo(tmp_path / "cut", tiny_dir, "trainer.steps=4", "trainer.mini_batches=2", "run.resume=auto",
                       *common)
    whole = run_grpo(tmp_path / "whole", tiny_dir, "trainer.steps=4", "trainer.mini_batches=2", *common)
    keys = ["actor/lr"] + (["critic/lr"] if estimator == "gae" else [])
    want = {(r["step"], k): r[k] for r in whole if r["step"] > 2 for k in keys}
    assert {(r["step"], k): r[k] for r in resumed if r["step"] > 2 for k in keys} == pytest.approx(want, rel=1e-9)
