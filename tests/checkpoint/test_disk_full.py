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


def test_a_full_disk_met_writing_the_runs_files_is_one_message_naming_run_dir(tmp_path, monkeypatch):
    """metrics.jsonl (or spans, an evaluation report) on a full disk: the write and the close after it (the
    buffered line again) raised bare ``OSError: [Errno 28]``s, printed as a traceback."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.telemetry.sinks import JsonlSink
    from relayrl.workflows.registry import train

    real_log, real_close = JsonlSink.log, JsonlSink.close

    def log(self, step, metrics):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device")  # (a flush names no file)
        real_log(self, step, metrics)

    def close(self):
        real_close(self)
        raise OSError(errno.ENOSPC, "No space left on device")  # the buffered line, flushed again

    monkeypatch.setattr(JsonlSink, "log", log)
    monkeypatch.setattr(JsonlSink, "close", close)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    run = tmp_path / "run"
    cfg = load_config(Config, "recipes/arith_sft.yaml", [
        f"run.dir={run}", "trainer.steps=4", "run.save_every=2", "eval.size=8", "eval.every=0", "run.threads=1",
        "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256"])
    with pytest.raises(DiskFullError) as e:
        train(cfg)
    assert is_user_error(e.value)
    assert str(e.value) == (f"no space left on the file system of run.dir={run} (1.0 MB left there) to write the "
                            f"run's files in step 3 (metrics.jsonl, spans.jsonl, eval/ reports); the run stopped "
                            f"there. Free space, or give a run.dir on a larger disk (resume=auto goes on from the "
                            f"last complete checkpoint)")
    assert (run / "checkpoints" / "step-000002" / "manifest.json").is_file()


def test_only_a_full_run_dir_is_called_full(tmp_path, monkeypatch):
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: Usage(10 << 30, 1 << 30, 9 << 30))
    assert atomic.run_files_full(full, tmp_path, 1) is None  # another file system (/dev/shm, say) is full
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    assert atomic.run_files_full(OSError(errno.EIO, "I/O error"), tmp_path, 1) is None
    elsewhere = OSError(errno.ENOSPC, "No space left on device", "/dev/shm/relayrl-1-bucket")
    assert atomic.run_files_full(elsewhere, tmp_path, 1) is None
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "eval" / "eval-step000003.json"))
    assert f"to write the run's files in step 1 ({tmp_path / 'eval' / 'eval-step000003.json'}); " in str(
        atomic.run_files_full(quota, tmp_path, 1))


def test_with_one_checkpoint_kept_the_message_does_not_say_to_keep_fewer(tmp_path, monkeypatch):
    """A save needs room for the new checkpoint beside the last one (pruned once the new one is complete), so
    run.keep_checkpoints=1 on a disk with room for one fails every save; the message said to lower it."""
    cm = CheckpointManager(tmp_path / "checkpoints", keep=1)
    _save(cm, 1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_mod.torch, "save", full)
    with pytest.raises(DiskFullError) as e:
        _save(cm, 2)
    msg = str(e.value)
    assert "lower run.keep_checkpoints" not in msg
    assert ("Free space or give a run.dir on a larger disk: with run.keep_checkpoints=1 a save still needs room "
            "for the new checkpoint beside the last one, which is removed once the new one is complete") in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    with pytest.raises(DiskFullError, match=r"Free space, lower run.keep_checkpoints \(now 3\), or give"):
        _save(CheckpointManager(tmp_path / "checkpoints", keep=3), 2)
