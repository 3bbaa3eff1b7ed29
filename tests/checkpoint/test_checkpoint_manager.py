"""CheckpointManager: round trip, atomicity, corruption, shape checks, pruning, resume policy."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    resume_from,
    restore_rng_state,
    shapes_of,
)
from relayrl.checkpoint import manager as manager_mod


def _make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int, sampler: torch.Generator) -> None:
    """Draws from every RNG a run uses: torch (data, dropout), NumPy, Python, a named sampler."""
    for _ in range(steps):
        x = torch.randn(5, 4) * float(np.random.rand() + 0.5)
        noise = torch.rand(5, 3, generator=sampler) * random.random()
        loss = ((model(x) - noise) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _save(cm, step, model, opt, sched, sampler=None, **kw):
    return cm.save(
        step,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        trainer_state={"data": {"consumed": list(range(step))}},
        rng_state=capture_rng_state({"sampler": sampler} if sampler is not None else {}),
        **kw,
    )


def test_round_trip_then_two_steps_is_bitwise_identical(tmp_path):
    cm = CheckpointManager(tmp_path)
    model, opt, sched = _make()
    sampler = torch.Generator().manual_seed(123)
    random.seed(1), np.random.seed(2)
    _train(model, opt, sched, 2, sampler)
    path = _save(cm, 2, model, opt, sched, sampler, config={"algo": "grpo"})
    _train(model, opt, sched, 2, sampler)  # the uninterrupted continuation
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = opt.state_dict()

    model2, opt2, sched2 = _make(seed=99)  # different init, then restored
    sampler2 = torch.Generator().manual_seed(0)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # scramble the globals
    ck = cm.load(path, expected_shapes=shapes_of(model2))
    assert ck.step == 2 and ck.trainer_state == {"data": {"consumed": [0, 1]}, "step": 2}
    assert ck.config == {"algo": "grpo"}
    model2.load_state_dict(ck.model_state)
    opt2.load_state_dict(ck.optimizer_state)
    sched2.load_state_dict(ck.scheduler_state)
    restore_rng_state(ck.rng_state, {"sampler": sampler2})
    _train(model2, opt2, sched2, 2, sampler2)

    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k
    for pid, st in opt2.state_dict()["state"].items():
        assert torch.equal(st["exp_avg_sq"], ref_opt["state"][pid]["exp_avg_sq"])
    assert sched2.last_epoch == sched.last_epoch == 4


def test_tied_weights_are_saved_as_copies(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    state = {"emb.weight": emb.weight, "head.weight": head.weight, "t": torch.ones(3, 2).t()}  # + non-contiguous
    path = CheckpointManager(tmp_path).save(1, model_state=state, optimizer_state=None, scheduler_state=None,
                                            trainer_state={})
    ck = CheckpointManager(tmp_path).load(path)
    assert torch.equal(ck.model_state["emb.weight"], ck.model_state["head.weight"])
    assert ck.model_state["t"].shape == (2, 3) and ck.optimizer_state is None and ck.scheduler_state is None


def test_keep_k_pruning_and_latest(tmp_path):
    cm = CheckpointManager(tmp_path, keep=2)
    model, opt, sched = _make()
    assert cm.latest() is None
    for step in (1, 2, 3, 5):
        _save(cm, step, model, opt, sched)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000005"]
    assert cm.latest() == tmp_path / "step-000005"
    _save(cm, 5, model, opt, sched)  # re-saving the same step replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000005"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointManager(tmp_path, keep=0)


@pytest.fixture
def saved(tmp_path):
    model, opt, sched = _make()
    _train(model, opt, sched, 1, torch.Generator().manual_seed(0))
    return _save(CheckpointManager(tmp_path), 1, model, opt, sched), model


def test_resuming_from_a_run_directory_names_its_checkpoints(tmp_path):
    """verl's resume_from_path habit: the run's directory, not its checkpoints'; the message gives the path."""
    model, opt, sched = _make()
    root = tmp_path / "run" / "checkpoints"
    _save(CheckpointManager(root), 2, model, opt, sched)
    with pytest.raises(CheckpointError) as e:
        resume_from(root, tmp_path / "run")
    assert str(e.value).endswith(f"{tmp_path / 'run'} is a run directory: run.resume={root} resumes its newest "
                                 f"checkpoint (step-000002), or run.resume=auto with run.dir={tmp_path / 'run'}")


def test_corrupted_file_is_named(saved):
    path, _ = saved
    data = bytearray((path / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: corrupted: sha256"):
        CheckpointManager(path.parent).load(path)


def test_truncated_safetensors_is_refused(saved):
    path, _ = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: 40 bytes, manifest says \d+"):
        CheckpointManager(path.parent).load(path)


def test_unreadable_safetensors_with_matching_manifest(saved):
    path, _ = saved
    f = path / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header}")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"size": f.stat().st_size, "sha256": manager_mod._sha256(f)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read as safetensors"):
        CheckpointManager(path.parent).load(path)


def test_missing_file_manifest_and_version(saved):
    path, _ = saved
    (path / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.pt: missing"):
        CheckpointManager(path.parent).load(path)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99 is incompatible"):
        CheckpointManager(path.parent).load(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing; the checkpoint is incomplete"):
        CheckpointManager(path.parent).load(path)
    assert CheckpointManager(path.parent).latest() is None


def test_different_model_shape_names_key_and_both_shapes(saved):
    path, _ = saved
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 5))
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(path.parent).load(path, expected_shapes=shapes_of(other))
    msg = str(info.value)
    assert "model.safetensors" in msg and "'2.weight': checkpoint (3, 8) vs model (5, 8)" in msg
    assert "'2.bias': checkpoint (3,) vs model (5,)" in msg
    renamed = {("x." + k if k.startswith("0.") else k): v for k, v in shapes_of(other).items()}
    with pytest.raises(CheckpointError, match=r"missing keys \['x\.0\.bias', 'x\.0\.weight'\].*unexpected keys"):
        CheckpointManager(path.parent).load(path, expected_shapes=renamed)


def test_bad_trainer_state_is_refused_before_writing(tmp_path):
    cm = CheckpointManager(tmp_path)
    state = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match=r"trainer_state\['data'\]\['pos'\] of type Tensor"):
        cm.save(1, model_state=state, optimizer_state=None, scheduler_state=None,
                trainer_state={"data": {"pos": torch.tensor(3)}})
    with pytest.raises(ValueError, match=r"trainer_state\['step'\] is 4"):
        cm.save(1, model_state=state, optimizer_state=None, scheduler_state=None, trainer_state={"step": 4})
    with pytest.raises(TypeError, match=r"model_state\['b'\] is a list"):
        cm.save(1, model_state={"b": [1]}, optimizer_state=None, scheduler_state=None, trainer_state={})
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_exception_mid_save_keeps_previous_checkpoint(saved, monkeypatch):
    path, model = saved
    cm = CheckpointManager(path.parent)
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if str(f).endswith("rng.pt"):
            raise OSError("disk full")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(manager_mod.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        cm.save(2, model_state=model.state_dict(), optimizer_state=None, scheduler_state=None, trainer_state={})
    assert cm.latest() == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # temp dir cleaned up
    assert cm.load(path).step == 1


_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from relayrl.checkpoint import CheckpointManager
    from relayrl.checkpoint import manager as m
    root, marker = Path(sys.argv[1]), Path(sys.argv[2])
    cm = CheckpointManager(root)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    cm.save(1, model_state=state, optimizer_state=None, scheduler_state=None, trainer_state={"pos": 1})
    real = m._fsync_file
    def slow_fsync(path):
        real(path)
        if Path(path).name == "model.safetensors":
            marker.write_text("in save")
            time.sleep(60)
    m._fsync_file = slow_fsync
    cm.save(2, model_state={"w": state["w"] * 2}, optimizer_state=None, scheduler_state=None, trainer_state={"pos": 2})
    """
)


@pytest.mark.multiproc
def test_sigkill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(marker)], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "child exited before reaching the save"
            assert time.monotonic() < deadline, "child never reached the second save"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = sorted(p.name for p in root.iterdir())
    assert names == [f".tmp-step-000002-{proc.pid}", "step-000001"]
    cm = CheckpointManager(root)
    assert cm.latest() == root / "step-000001"
    ck = cm.load(cm.latest())
    assert ck.trainer_state["pos"] == 1 and torch.equal(ck.model_state["w"], torch.arange(1000, dtype=torch.float32))
    plan = resume_from(root, "auto")
    assert plan.path == root / "step-000001"
    cm.save(2, model_state={"w": torch.zeros(1)}, optimizer_state=None, scheduler_state=None, trainer_state={})
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]  # dead pid's temp dir removed


# ----------------------------------------------------------------------------- resume policy


def test_resume_policy(tmp_path, saved):
    path, _ = saved
    root = path.parent
    assert resume_from(root, "never").path is None
    plan = resume_from(root, "auto")
    assert plan.path == path and "step 1" in plan.message
    assert resume_from(root, str(path)).path == path
    assert resume_from(root, root).path == path  # a root of checkpoints: its newest

    empty = tmp_path / "empty"
    plan = resume_from(empty, "auto")
    assert plan.path is None and "no checkpoint" in plan.message and "starting from step 0" in plan.message
    empty.mkdir()
    (empty / ".tmp-step-000003-999999").mkdir()
    assert "ignored 1 unfinished save" in resume_from(empty, "auto").message

    with pytest.raises(CheckpointError, match="does not exist"):
        resume_from(root, tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resume_from(root, empty)
    broken = root / "step-000009"
    broken.mkdir()
    with pytest.raises(CheckpointError, match="step-000009/manifest.json: missing.*newest checkpoint is incomplete"):
        resume_from(root, "auto")
    # the way on names the checkpoint before it and moves the incomplete one aside (nothing deleted)
    with pytest.raises(CheckpointError, match=r"To resume from step-\d+, the newest checkpoint before it, move it "
                                              r"out of the way: mv \S+/step-000009 \S+/damaged-step-000009 "
                                              r"\(then run.resume=auto again\)"):
        resume_from(root, "auto")
    shutil.move(str(broken), str(root / "damaged-step-000009"))
    assert resume_from(root, "auto").path is not None and resume_from(root, "auto").path.name != "step-000009"


def test_a_damaged_newest_checkpoint_is_refused_naming_the_one_before_it(tmp_path):
    model, opt, sched = _make()
    cm = CheckpointManager(tmp_path)
    first = _save(cm, 1, model, opt, sched)
    weights = first / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(CheckpointError) as e:  # the only one: nothing older to name
        resume_from(tmp_path, "auto")
    assert str(e.value).startswith(f"{weights}: truncated") and "mv " not in str(e.value)
    newest = _save(cm, 2, model, opt, sched)
    (newest / "optimizer.pt").write_bytes((newest / "optimizer.pt").read_bytes()[:-1])
    with pytest.raises(CheckpointError) as e:
        resume_from(tmp_path, "auto")
    assert str(e.value).endswith(f"To resume from step-000001, the newest checkpoint before it, move it out of the "
                                 f"way: mv {newest} {tmp_path / 'damaged-step-000002'} (then run.resume=auto again)")
    newest.rename(tmp_path / "damaged-step-000002")
    with pytest.raises(CheckpointError, match="truncated"):  # (the one before is damaged too, here)
        resume_from(tmp_path, "auto")
