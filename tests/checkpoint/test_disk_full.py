"""A full disk while a checkpoint or the final model is written: one message that names the file system, what
was being written and its size, and the fixes; the partial write is removed and the last checkpoint kept."""

from __future__ import annotations

import errno
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from relayrl.checkpoint import CheckpointManager
from relayrl.checkpoint import atomic
from relayrl.checkpoint import manager as manager_mod
from relayrl.checkpoint.atomic import DiskFullError, write_dir_atomically
from relayrl.checkpoint.rundir import rerun_note
from relayrl.errors import is_user_error

Usage = namedtuple("Usage", "total used free")


def _save(cm: CheckpointManager, step: int):
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    return cm.save(step, model_state=model.state_dict(), optimizer_state=opt.state_dict(), scheduler_state=None,
                   trainer_state={})


def test_a_checkpoint_that_does_not_fit_is_one_message_and_leaves_the_last_one(tmp_path, monkeypatch):
    cm = CheckpointManager(tmp_path / "checkpoints")
    first = _save(cm, 1)

    def cryptic(*a, **k):  # torch.save on a full disk says only this
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(manager_mod.torch, "save", cryptic)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(DiskFullError) as e:
        _save(cm, 2)
    msg = str(e.value)
    assert is_user_error(e.value)
    assert f"no space left on the file system of {tmp_path / 'checkpoints'} (1.0 MB left there) to write the " \
           f"checkpoint of step 2; it takes about 0.1 MB" in msg  # the weights and Adam's moments
    assert "lower run.keep_checkpoints" in msg and "resume=auto goes on from the last complete checkpoint" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [first.name]  # no scratch left
    # plenty of room: the same failure is not called a full disk
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: Usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        _save(cm, 2)


def test_the_final_model_on_a_full_disk_names_it(tmp_path):
    def write(tmp: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=rf"to write {tmp_path / 'model'}; the partial write was removed"):
        write_dir_atomically(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == []


def test_after_a_failure_a_run_with_a_checkpoint_is_told_to_resume(tmp_path):
    run = tmp_path / "run"
    _save(CheckpointManager(run / "checkpoints"), 3)
    note = rerun_note(run, "never")
    assert note == (f"run.dir={run} holds this run's checkpoints up to step-000003: add run.resume=auto to go on "
                    f"from there, or run.overwrite=true to start over (it moves them aside to "
                    f"{run}.replaced-<time>)")
    assert rerun_note(run, "auto") is None  # the same command goes on by itself
