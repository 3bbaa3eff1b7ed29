"""A resumed run trains with its own config's optimizer settings; with the same settings it resumes exactly."""

import pytest
import torch

from relayrl.engines.training.base import OptimConfig
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig

pytestmark = pytest.mark.slow  # (three engines: about a second)


def _engine(tiny_dir, **optim):
    from relayrl.models.load import load_model

    torch.manual_seed(0)
    return TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(optim=OptimConfig(**optim)), total_steps=10)


def test_a_resumed_engine_takes_the_configs_lr_schedule_and_decay_and_keeps_the_step(tiny_dir):
    old = dict(lr=1e-2, warmup_steps=4, schedule="linear", weight_decay=0.0)
    trained = _engine(tiny_dir, **old)
    for _ in range(3):
        for p in trained.model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        trained.optimizer.step()
        trained.scheduler.step()
    state = trained.state()
    lr_then = trained.optimizer.param_groups[0]["lr"]
    assert lr_then == pytest.approx(1e-2 * 4 / 4)  # warm-up (step + 1) / 4 at step 3

    same = _engine(tiny_dir, **old)
    same.load_state(state)
    assert same.optimizer.param_groups[0]["lr"] == lr_then  # bit for bit: resuming changes nothing
    assert same.scheduler.get_last_lr() == trained.scheduler.get_last_lr()
    assert same.optimizer.state_dict()["param_groups"] == trained.optimizer.state_dict()["param_groups"]

    new = _engine(tiny_dir, lr=1e-3, schedule="constant", weight_decay=0.1, betas=(0.8, 0.99))
    new.load_state(state)
    group = new.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-3, 0.1, (0.8, 0.99))
    assert new.scheduler.last_epoch == 3  # the step count is the checkpoint's
    moments = new.optimizer.state[next(iter(new.model.parameters()))]
    assert float(moments["step"]) == 3.0  # and so are Adam's moments
    new.optimizer.step()
    new.scheduler.step()
    assert new.optimizer.param_groups[0]["lr"] == 1e-3
