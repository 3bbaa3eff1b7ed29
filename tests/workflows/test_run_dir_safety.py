"""A run directory never destroys what is in it: not a model directory, not a previous run that wrote no
checkpoint, not the model ``run.overwrite=true`` would move away. ``relayrl train`` run in-process through
``main()``; the refusals come before any worker starts, the runs that train take a few seconds each."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_INTERRUPTED, EXIT_USER

ROOT = Path(__file__).resolve().parents[2]
SFT, GRPO = str(ROOT / "recipes" / "arith_sft.yaml"), str(ROOT / "recipes" / "arith_grpo.yaml")
FAST = ["eval.size=8", "eval.every=0", "run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


def train(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stdout + stderr of ``relayrl train ARGV``; asserts that no traceback was printed."""
    code = cli.main(["train", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out + out.err


def snapshot(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``directory`` but the lock (it names the run that held it last)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".relayrl.lock"}


def steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_model_directory_as_run_dir_is_refused_and_left_as_it_was(capsys, tmp_path, tiny_dir):
    model = tmp_path / "victim"
    shutil.copytree(tiny_dir, model)
    before = snapshot(model)
    for key in ("model.path", "trainer.init_from"):
        code, out = train(capsys, GRPO if key == "trainer.init_from" else SFT, f"{key}={model}", f"run.dir={model}",
                          "trainer.steps=1", *FAST)
        assert code == EXIT_USER and f"run.dir={model} is {key}={model}" in out, out
        assert snapshot(model) == before
    # a model directory the run does not read (run.dir set to the wrong path): its config.json is not a run's
    code, out = train(capsys, SFT, f"run.dir={model}", "trainer.steps=1", *FAST)
    assert code == EXIT_USER and "holds a config.json that is not a relayrl run config" in out, out
    assert "model_type='qwen2'" in out
    code, out = train(capsys, SFT, f"run.dir={model}", "run.overwrite=true", "trainer.steps=1", *FAST)
    assert code == EXIT_USER and "not a relayrl run config" in out  # not a run: not moved aside either
    code, out = train(capsys, SFT, f"run.dir={model / 'runs' / 'a'}", f"model.path={model}", "trainer.steps=1", *FAST)
    assert code == EXIT_USER and f"lies inside model.path={model}" in out
    assert snapshot(model) == before and [p.name for p in tmp_path.iterdir()] == ["victim"]


def test_overwrite_does_not_move_away_the_model_the_run_starts_from(capsys, tmp_path, tiny_dir):
    run = tmp_path / "sft"
    shutil.copytree(tiny_dir, run / "model")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    before = snapshot(run)
    code, out = train(capsys, GRPO, f"trainer.init_from={run / 'model'}", f"run.dir={run}", "run.overwrite=true",
                      "trainer.steps=1", *FAST)
    assert code == EXIT_USER and f"trainer.init_from={run / 'model'} lies inside run.dir={run}" in out, out
    assert "run.overwrite=true would move it aside" in out
    assert snapshot(run) == before and [p.name for p in tmp_path.iterdir()] == ["sft"]


def test_a_start_up_failure_leaves_no_run_dir(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1="}) + "\n")  # no answer
    run = tmp_path / "a" / "run"
    code, out = train(capsys, SFT, "data.task=null", f"data.path={data}", "reward.verifier=exact", f"run.dir={run}",
                      *FAST)
    assert code == EXIT_USER and "field 'answer' is missing" in out
    assert not (tmp_path / "a").exists()


def test_init_from_a_run_or_checkpoint_directory_says_which_directory_was_meant(capsys, tmp_path, tiny_dir):
    run = tmp_path / "sft"
    shutil.copytree(tiny_dir, run / "model")
    step = run / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    (run / "config.json").write_text("{}")
    for given in (run, run / "checkpoints", step):
        code, out = train(capsys, GRPO, f"trainer.init_from={given}", f"run.dir={tmp_path / 'grpo'}",
                          "trainer.steps=1", *FAST)
        assert code == EXIT_USER and f"trainer.init_from={given}: " in out, out
        assert f"did you mean trainer.init_from={run / 'model'}?" in out, out
    assert "is a checkpoint" in out and f"run.resume={step}" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = train(capsys, SFT, f"model.path={empty}", f"run.dir={tmp_path / 'r'}", "trainer.steps=1", *FAST)
    assert code == EXIT_USER and f"model.path={empty}: the directory is empty; give a local Hugging Face model " \
        "directory" in out
    assert not (tmp_path / "grpo").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow  # (about 1 s; the full `make test` runs it)
def test_a_run_interrupted_before_its_first_checkpoint_is_kept_and_the_message_says_how_to_start_over(
        capsys, tmp_path, monkeypatch):
    from relayrl.workflows.session import Session

    real = Session.end_step

    def ctrl_c_in_step_3(self, step, *args, **kwargs):
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step, *args, **kwargs)

    run = tmp_path / "run"
    args = [SFT, f"run.dir={run}", *FAST]
    monkeypatch.setattr(Session, "end_step", ctrl_c_in_step_3)
    code, out = train(capsys, *args, "trainer.steps=100")
    monkeypatch.setattr(Session, "end_step", real)
    assert code == EXIT_INTERRUPTED and "interrupted at step 3; no checkpoint was written yet" in out, out
    assert f"run.overwrite=true run.dir={run}" in out and "run.resume=auto" not in out
    before = snapshot(run)
    assert steps(run) == [0, 1, 2]
    # what used to be suggested, and the same command again: both refused, the partial run untouched
    for extra in (["run.resume=auto"], []):
        code, out = train(capsys, *args, "trainer.steps=2", *extra)
        assert code == EXIT_USER and f"run.dir={run} already holds a run that wrote no complete checkpoint" in out
        assert "metrics.jsonl with 3 records" in out and "run.overwrite=true" in out, out
        assert snapshot(run) == before
    # what the message suggests works, and moves the partial run aside whole
    code, out = train(capsys, *args, "trainer.steps=2", "run.overwrite=true")
    assert code == 0, out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and f"moved the previous run in {run} to {aside[0]}" in out
    assert snapshot(aside[0]) == before and steps(run) == [0, 1, 2]


def test_an_in_process_restart_before_the_first_checkpoint_is_not_refused(tmp_path):
    """run.max_restarts with no checkpoint yet starts the run again as it started, in its own directory."""
    from relayrl.cluster.errors import WorkerError
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.restart import run_with_restarts
    from relayrl.workflows.session import Session

    cfg = load_config(Config, SFT, [f"run.dir={tmp_path / 'run'}", "run.max_restarts=1", *FAST])
    attempts: list[Session] = []

    def run(c: Config) -> Path:
        s = Session(c, log=lambda _: None)
        attempts.append(s)
        s.open_telemetry(2, ())
        s.tracker.log(0, {"eval/accuracy": 0.0})
        s.tracker.close()
        s.timeline.close()
        if len(attempts) == 1:
            raise WorkerError("actor", 0, "update", "rank process died", lost=True)
        return s.dir

    assert run_with_restarts(cfg, run, log=lambda _: None) == tmp_path / "run"
    assert len(attempts) == 2 and steps(tmp_path / "run") == [0]


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_a_second_run_started_in_a_held_run_dir_is_refused_naming_the_holder(capsys, tmp_path):
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    hold = "import sys; from relayrl.checkpoint.rundir import hold_run_dir as h; h(sys.argv[1]); print('held', flush=True); sys.stdin.read()"
    other = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert other.stdout.readline().strip() == "held"
        code, out = train(capsys, SFT, f"run.dir={run}", "trainer.steps=1", *FAST)
        assert code == EXIT_USER and f"run.dir={run} is in use by another run (pid {other.pid} on " in out, out
        assert [p.name for p in run.iterdir()] == [".relayrl.lock"]  # the refused run wrote nothing
    finally:
        other.stdin.close()
        other.wait(30)


def test_a_model_directory_without_config_json_is_refused_before_any_worker_starts(capsys, tmp_path, tiny_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "config.json").unlink()
    code, out = train(capsys, SFT, f"model.path={model}", f"run.dir={tmp_path / 'r'}", "trainer.steps=1", *FAST)
    assert code == EXIT_USER and f"model.path={model}: model directory {model} lacks config.json" in out, out
    assert "worker group" not in out and not (tmp_path / "r").exists()


@pytest.mark.slow  # (about 2 s; the full `make test` runs it)
def test_a_resume_with_trainer_steps_at_or_below_its_checkpoint_says_there_is_nothing_to_train(capsys, tmp_path):
    """trainer.steps=5 (say, 500 meant) resuming the checkpoint of step 6 ended with 'model saved' alone."""
    run = tmp_path / "run"
    code, out = train(capsys, SFT, f"run.dir={run}", *FAST, "trainer.steps=6", "run.save_every=3")
    assert code == 0, out
    for n, how in ((5, "past"), (6, "at")):
        code, out = train(capsys, SFT, f"run.dir={run}", *FAST, f"trainer.steps={n}", "run.resume=auto")
        assert code == 0, out
        assert (f"relayrl: the checkpoint is at step 6, {how} trainer.steps={n}: nothing left to train (raise "
                f"trainer.steps to train on)") in out, out
        assert steps(run) == list(range(7))


@pytest.mark.slow  # (about 3 s; the full `make test` runs it)
def test_a_damaged_newest_checkpoint_says_how_to_resume_the_one_before_it(capsys, tmp_path):
    """resume=auto refused the damaged newest checkpoint and resume=PATH the older one (the run has a later
    one): each message sent the user to the other. The refusal now says to move the damaged one aside."""
    run = tmp_path / "run"
    args = [SFT, f"run.dir={run}", *FAST, "run.save_every=1"]
    code, out = train(capsys, *args, "trainer.steps=3")
    assert code == 0, out
    newest = run / "checkpoints" / "step-000003"
    aside = run / "checkpoints" / "damaged-step-000003"
    for name, damage in (("optimizer.pt", "flip"), ("model.safetensors", "cut")):
        whole = (newest / name).read_bytes()
        data = bytearray(whole)
        if damage == "flip":
            data[len(data) // 2] ^= 1
        else:
            del data[len(data) // 2:]
        (newest / name).write_bytes(bytes(data))
        code, out = train(capsys, *args, "trainer.steps=4", "run.resume=auto")
        assert code == EXIT_USER and f"{newest / name}: " in out, out
        assert (f"To resume from step-000002, the newest checkpoint before it, move it out of the way: mv {newest} "
                f"{aside} (then run.resume=auto again)") in out, out
        (newest / name).write_bytes(whole)  # (the next case damages another file)
    newest.rename(aside)
    code, out = train(capsys, *args, "trainer.steps=4", "run.resume=auto")
    assert code == 0 and "resuming from" in out and "step-000002" in out, out
    assert steps(run) == [0, 1, 2, 3, 4]


@pytest.mark.slow  # (about 2 s; the full `make test` runs it)
def test_ctrl_c_while_a_checkpoint_is_written_names_that_step_and_the_checkpoint_to_resume_from(
        capsys, tmp_path, monkeypatch):
    from relayrl.checkpoint.manager import CheckpointManager

    real = CheckpointManager.save

    def ctrl_c_saving_step_2(self, step, **kwargs):
        if step == 2:
            raise KeyboardInterrupt
        return real(self, step, **kwargs)

    run = tmp_path / "run"
    monkeypatch.setattr(CheckpointManager, "save", ctrl_c_saving_step_2)
    code, out = train(capsys, SFT, f"run.dir={run}", *FAST, "trainer.steps=4", "run.save_every=1")
    assert code == EXIT_INTERRUPTED, out
    assert "interrupted at step 2, while its checkpoint was written (that checkpoint is incomplete)" in out, out
    assert "resume with run.resume=auto" in out and "step-000001" in out, out
