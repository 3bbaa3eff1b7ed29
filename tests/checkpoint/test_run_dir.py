"""One run per run directory (claim, config fingerprint), the manifest's step, atomic directories."""

import json
from pathlib import Path

import pytest
import torch

from relayrl.checkpoint import CheckpointError, CheckpointManager, load_checkpoint, resume_from, verify_checkpoint
from relayrl.checkpoint.atomic import write_dir_atomically
from relayrl.checkpoint.rundir import (
    FINGERPRINT,
    RunDirError,
    check_fingerprint,
    check_run_dir,
    claim_run_dir,
    config_differences,
    hold_run_dir,
    release_run_dir,
    saved_config,
)
from relayrl.errors import is_user_error


def _save(root: Path, step: int, config: dict | None = None) -> Path:
    model = torch.nn.Linear(2, 2)
    return CheckpointManager(root).save(step, model_state=model.state_dict(), optimizer_state=None,
                                        scheduler_state=None, trainer_state={"data": {"pos": step}}, config=config)


def test_a_fresh_run_refuses_a_dir_with_checkpoints_naming_it_and_the_ways_out(tmp_path):
    run = tmp_path / "run"
    assert claim_run_dir(run, "never", overwrite=False) is None  # nothing there yet
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n")
    assert claim_run_dir(run, "never", overwrite=False) is None  # an empty metrics.jsonl and checkpoints/: no run yet
    _save(run / "checkpoints", 4)
    with pytest.raises(RunDirError) as info:
        claim_run_dir(run, "never", overwrite=False)
    msg = str(info.value)
    assert f"run.dir={run} already holds a run with checkpoints (step-000004)" in msg
    assert "run.resume=auto" in msg and f"run.dir={run}-2" in msg and "run.overwrite=true" in msg
    assert is_user_error(info.value)
    assert claim_run_dir(run, "auto", overwrite=False) is None  # resuming it is what the directory is for
    own = run / "checkpoints" / "step-000004"
    assert claim_run_dir(run, str(own), overwrite=False) is None  # an explicit checkpoint of this run
    other = _save(tmp_path / "other" / "checkpoints", 9)
    with pytest.raises(RunDirError, match="resumed from another run's checkpoint"):
        claim_run_dir(run, str(other), overwrite=False)  # would continue run "other" among this run's files
    assert claim_run_dir(tmp_path / "fresh", str(other), overwrite=False) is None  # a new dir: fine


def test_overwrite_moves_the_old_run_aside_without_deleting_it(tmp_path):
    run = tmp_path / "run"
    _save(run / "checkpoints", 2)
    note = claim_run_dir(run, "never", overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and str(aside[0]) in note
    assert (aside[0] / "checkpoints" / "step-000002" / "manifest.json").is_file()
    assert not run.exists()


def _traces(run: Path, which: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    if which == "metrics":
        (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    elif which == "model":
        (run / "model").mkdir()
    elif which == "config":
        (run / "config.json").write_text(json.dumps({"workflow": "sft", "run": {}, "model": {}, "trainer": {}}))
    else:  # a checkpoint the run was killed while writing
        (run / "checkpoints" / "step-000003").mkdir(parents=True)


@pytest.mark.parametrize("which,says", [("metrics", "metrics.jsonl with 2 records"), ("model", "model/"),
                                        ("config", "config.json"), ("partial", "unfinished checkpoints/step-000003")])
def test_a_run_without_a_complete_checkpoint_is_a_run_too(tmp_path, which, says):
    run = tmp_path / "run"
    _traces(run, which)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for resume in ("never", "auto"):
        with pytest.raises(RunDirError) as info:
            claim_run_dir(run, resume, overwrite=False)
        msg = str(info.value)
        assert f"run.dir={run} already holds a run" in msg and says in msg, msg
        assert "run.overwrite=true" in msg and f"run.dir={run}-2" in msg
        with pytest.raises(RunDirError):
            check_run_dir(run, resume, overwrite=False)  # the same refusal, before anything is loaded
    assert "run.resume=auto has nothing to resume" in msg  # resume=auto says why it cannot resume
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing touched
    check_run_dir(run, "auto", overwrite=True)  # overwrite: no refusal; the claim moves the run aside
    note = claim_run_dir(run, "auto", overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and str(aside[0]) in note and not run.exists()
    assert sorted(p.relative_to(aside[0]) for p in aside[0].rglob("*")) == before


def test_a_checkpoint_makes_the_other_traces_the_run_that_resume_auto_continues(tmp_path):
    run = tmp_path / "run"
    for which in ("metrics", "model", "config"):
        _traces(run, which)
    _save(run / "checkpoints", 2)
    assert claim_run_dir(run, "auto", overwrite=False) is None
    check_run_dir(run, "auto", overwrite=False)
    with pytest.raises(RunDirError, match=r"already holds a run with checkpoints \(step-000002\)"):
        claim_run_dir(run, "never", overwrite=False)


def test_a_run_dir_must_not_be_or_hold_the_model_it_starts_from(tmp_path):
    model, run = tmp_path / "m", tmp_path / "run"
    model.mkdir()
    for key in ("model.path", "trainer.init_from", "reward.model"):
        for where, says in ((model, f"run.dir={model} is {key}={model}"),
                            (model / "sub", f"run.dir={model / 'sub'} lies inside {key}={model}")):
            with pytest.raises(RunDirError) as info:
                check_run_dir(where, "never", overwrite=False, models={key: str(model)})
            assert says in str(info.value) and "choose a run.dir outside it" in str(info.value)
    inner = run / "model"
    with pytest.raises(RunDirError) as info:  # e.g. init_from=RUN/model with run.dir=RUN (and run.overwrite)
        check_run_dir(run, "never", overwrite=True, models={"trainer.init_from": str(inner), "model.path": None})
    assert f"trainer.init_from={inner} lies inside run.dir={run}" in str(info.value)
    assert "run.overwrite=true would move it aside" in str(info.value)
    check_run_dir(tmp_path / "elsewhere", "never", overwrite=False, models={"model.path": str(model),
                                                                           "trainer.init_from": None})


def test_a_config_json_that_is_not_a_relayrl_run_config_is_never_overwritten(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    for overwrite in (False, True):
        with pytest.raises(RunDirError) as info:
            check_run_dir(hf, "never", overwrite=overwrite)
        msg = str(info.value)
        assert f"run.dir={hf} holds a config.json that is not a relayrl run config" in msg
        assert "model_type='qwen2'" in msg and "choose another run.dir" in msg
    (hf / "config.json").write_text("{not json")
    with pytest.raises(RunDirError, match="not a relayrl run config"):
        check_run_dir(hf, "never", overwrite=False)
    (hf / "config.json").write_text(json.dumps({"workflow": "sft", "run": {}, "model": {}, "trainer": {}}))
    with pytest.raises(RunDirError, match="already holds a run"):  # relayrl's: a previous run
        check_run_dir(hf, "never", overwrite=False)
    check_run_dir(hf, "never", overwrite=True)


@pytest.mark.parametrize("torn", ["", '{"workflow": "grpo", "run": {"dir": "runs/g"'])
def test_a_torn_config_json_beside_the_runs_checkpoints_does_not_block_its_resume(tmp_path, torn):
    """A run killed (or out of disk) while it rewrote RUN_DIR/config.json at its start left it empty or cut; the
    run's checkpoints say whose directory it is, so resume=auto goes on (the run writes config.json again)."""
    run = tmp_path / "run"
    _save(run / "checkpoints", 4)
    (run / "config.json").write_text(torn)
    check_run_dir(run, "auto", overwrite=False)
    with pytest.raises(RunDirError, match="already holds a run with checkpoints"):  # still the run's: not overwritten
        check_run_dir(run, "never", overwrite=False)
    (run / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # a model's config: refused as before
    with pytest.raises(RunDirError, match="not a relayrl run config"):
        check_run_dir(run, "auto", overwrite=False)


def test_the_run_writes_its_config_json_whole_or_not_at_all(tmp_path, monkeypatch):
    from relayrl.workflows import session

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"workflow": "grpo", "run": {}, "model": {}, "trainer": {}}))
    before = (run / "config.json").read_text()
    real = Path.write_text

    def torn(self, text, *a, **k):  # the disk fills half-way
        real(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError):
        session.write_run_config(run, {"workflow": "grpo"})
    assert (run / "config.json").read_text() == before and sorted(p.name for p in run.iterdir()) == ["config.json"]
    monkeypatch.undo()
    session.write_run_config(run, {"workflow": "sft"})
    assert json.loads((run / "config.json").read_text()) == {"workflow": "sft"}
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_fingerprint_says_which_keys_differ_and_ignores_the_others():
    saved = {"workflow": "grpo", "run": {"seed": 1, "save_every": 2}, "model": {"tiny": {"hidden_size": 64}},
             "trainer": {"steps": 4, "init_from": "a/model"}, "algorithm": {"advantage": "grpo"}}
    same = json.loads(json.dumps(saved))
    same["trainer"]["steps"], same["run"]["save_every"] = 10, 5  # extending a run is fine
    assert config_differences(saved, same) == []
    other = json.loads(json.dumps(same))
    other["run"]["seed"], other["algorithm"]["advantage"] = 2, "gae"
    assert config_differences(saved, other) == ["run.seed: checkpoint 1, now 2",
                                                "algorithm.advantage: checkpoint 'grpo', now 'gae'"]
    with pytest.raises(CheckpointError, match=r"(?s)belongs to a run with another configuration.*run.seed: "
                                              r"checkpoint 1, now 2.*run.resume_check=false"):
        check_fingerprint(Path("ck"), saved, other)
    check_fingerprint(Path("ck"), None, other)  # a checkpoint without a saved config: nothing to compare
    assert "run.seed" in FINGERPRINT and "trainer.steps" not in FINGERPRINT


def test_a_lora_run_resumed_with_another_alpha_is_refused():
    saved = {"workflow": "grpo", "model": {"lora": {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0}}}
    other = json.loads(json.dumps(saved))
    other["model"]["lora"]["dropout"] = 0.1  # a training-time option: fine
    assert config_differences(saved, other) == []
    other["model"]["lora"]["alpha"] = 64  # the adapter's scale: another model
    assert config_differences(saved, other) == ["model.lora.alpha: checkpoint 32, now 64"]
    other["model"]["lora"]["alpha"] = 32
    other["model"]["lora"]["target_parameters"] = ["mlp.experts.gate_up_proj"]  # adapters on other tensors
    assert config_differences(saved | {"model": {"lora": {**saved["model"]["lora"], "target_parameters": None}}},
                              other) == ["model.lora.target_parameters: checkpoint None, now ['mlp.experts.gate_up_proj']"]


def test_lora_targets_in_another_order_are_the_same_adapters():
    """Old behaviour: model.lora.target_modules listed in another order was refused as another model."""
    lora = {"enabled": True, "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    saved = {"workflow": "grpo", "model": {"lora": lora}}
    other = {"workflow": "grpo", "model": {"lora": {**lora, "target_modules": ["v_proj", "q_proj"]}}}
    assert config_differences(saved, other) == []
    other["model"]["lora"]["target_modules"] = ["v_proj", "k_proj"]
    assert config_differences(saved, other) == ["model.lora.target_modules: checkpoint ['q_proj', 'v_proj'], now "
                                                "['v_proj', 'k_proj']"]


def test_saved_config_reads_the_checkpoint_config(tmp_path):
    path = _save(tmp_path, 1, config={"workflow": "sft", "run": {"seed": 3}})
    assert saved_config(path) == {"workflow": "sft", "run": {"seed": 3}}
    assert saved_config(_save(tmp_path / "b", 1)) is None


def test_a_manifest_whose_step_was_edited_is_refused(tmp_path):
    path = _save(tmp_path, 2)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["step"] = 7
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="says step 7 but its directory is step-000002"):
        resume_from(tmp_path, "auto")
    moved = tmp_path / "step-000007"
    path.rename(moved)  # the directory renamed to match: the trainer state still says 2
    with pytest.raises(CheckpointError, match="says step 7 but trainer_state.json says step 2"):
        verify_checkpoint(moved, hashes=False)
    with pytest.raises(CheckpointError, match="says step 7 but trainer_state.json says step 2"):
        load_checkpoint(moved)
    manifest["step"] = "7"
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="step is '7', not an int"):
        verify_checkpoint(moved)


def test_write_dir_atomically_swaps_whole_directories(tmp_path):
    final = tmp_path / "model"

    def write(content: str):
        def fill(tmp: Path) -> None:
            assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-model-")
            (tmp / "config.json").write_text(content)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "w.bin").write_bytes(b"x" * 10)
        return fill

    assert write_dir_atomically(final, write("v1")) == final
    assert (final / "config.json").read_text() == "v1"

    def killed(tmp: Path) -> None:
        (tmp / "config.json").write_text("")  # a 0-byte file, then the writer dies
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dir_atomically(final, killed)
    assert (final / "config.json").read_text() == "v1"  # the old export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no scratch left behind
    write_dir_atomically(final, write("v2"))
    assert (final / "config.json").read_text() == "v2" and (final / "sub" / "w.bin").stat().st_size == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_write_dir_atomically_removes_scratch_of_dead_processes(tmp_path):
    stale = tmp_path / ".tmp-model-999999999"  # no such pid
    stale.mkdir()
    (stale / "config.json").write_text("")
    write_dir_atomically(tmp_path / "model", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert not stale.exists() and (tmp_path / "model" / "config.json").read_text() == "{}"


def test_the_tiny_shape_matters_only_when_the_tiny_default_is_the_model():
    saved = {"model": {"path": None, "tiny": {"hidden_size": 64}}, "trainer": {"init_from": "sft/model"}}
    current = {"model": {"path": None, "tiny": {"hidden_size": 256}}, "trainer": {"init_from": "sft/model"}}
    check_fingerprint(Path("ck"), saved, current)  # the model comes from init_from: tiny.* is unused
    saved["trainer"]["init_from"] = current["trainer"]["init_from"] = None
    with pytest.raises(CheckpointError, match=r"model.tiny: checkpoint \{'hidden_size': 64\}, now \{'hidden_size': 256\}"):
        check_fingerprint(Path("ck"), saved, current)


HOLD = """
import sys
from relayrl.checkpoint.rundir import hold_run_dir
hold_run_dir(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_a_run_dir_is_held_by_one_run_and_the_refusal_names_the_holder(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    run = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as e:
            hold_run_dir(run)
        msg = str(e.value)
        assert f"run.dir={run} is in use by another run (pid {other.pid} on {socket.gethostname()}, started " in msg
        assert f"choose another run.dir (e.g. run.dir={run}-2)" in msg and is_user_error(e.value)
        (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the live run's files: the early check names the
        for resume, overwrite in (("never", False), ("auto", False), ("never", True)):  # holder, not a way out
            with pytest.raises(RunDirError) as e:  # (resume=auto, overwrite) that the lock would refuse next
                check_run_dir(run, resume, overwrite)
            assert f"is in use by another run (pid {other.pid} on " in str(e.value), (resume, overwrite)
            assert "run.resume=auto" not in str(e.value) and "run.overwrite" not in str(e.value)
        assert run.is_dir() and (run / "metrics.jsonl").is_file()  # nothing moved aside
    finally:
        other.stdin.close()
        other.wait(30)
    hold_run_dir(run)  # the holder is gone: its lock with it
    hold_run_dir(run)  # held by this process already: a restart takes it again
    release_run_dir(run)


def test_overwrite_moves_the_lock_aside_with_the_run_and_the_new_run_holds_its_own(tmp_path):
    run = tmp_path / "run"
    hold_run_dir(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "moved the previous run" in claim_run_dir(run, "never", overwrite=True)
    hold_run_dir(run)
    assert (run / ".relayrl.lock").read_text().startswith('{"pid": ')
    release_run_dir(run)


def test_resume_refuses_another_training_split_or_answer_rule_but_not_another_held_out_set():
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    def cfg(*extra):
        return load_config(Config, None, ["data.task=null", "data.path=d/train.jsonl", "reward.verifier=math",
                                               *extra]).model_dump(mode="json")

    saved = cfg()
    for key, value in [("hf_split", "test"), ("answer_regex", "(\\d+)$"), ("system_prompt", "Think."),
                       ("prompt_key", "question"), ("chat_template", "false")]:
        with pytest.raises(CheckpointError, match=f"data.{key}: checkpoint"):
            check_fingerprint(Path("ck"), saved, cfg(f"data.{key}={value}"))
    check_fingerprint(Path("ck"), saved, cfg("data.eval_path=d/test.jsonl"))  # the held-out set may change


def test_resuming_an_older_checkpoint_of_the_run_itself_is_refused_with_the_way_to_branch(tmp_path):
    """The run would go on beside its later checkpoints (run.resume=auto would take those next) and replace its
    model/; run.overwrite would move the very checkpoint aside, so it is refused either way."""
    run = tmp_path / "run"
    first, newest = _save(run / "checkpoints", 1), _save(run / "checkpoints", 2)
    check_run_dir(run, str(newest), overwrite=False)  # the newest: going on is what the directory is for
    for overwrite in (False, True):
        with pytest.raises(RunDirError) as info:
            check_run_dir(run, str(first), overwrite=overwrite)
        msg = str(info.value)
        assert "which has later ones (step-000002)" in msg and "run.resume=auto" in msg, msg
        assert f"run.dir={run}-from-step-000001 run.resume={first}" in msg
    check_run_dir(tmp_path / "branch", str(first), overwrite=False)  # what the message proposes is accepted
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_a_run_dir_that_is_or_lies_under_a_file_is_refused_naming_the_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for run in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run"):
        with pytest.raises(RunDirError, match=f"{tmp_path / 'notes.txt'} is a file, not a directory"):
            check_run_dir(run, "never", overwrite=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_run_whose_reference_moved_resumed_without_its_syncs_is_refused():
    """trainer.ref_sync_every=0 loads no reference from the checkpoint: the starting model would silently become
    the KL (or DPO) anchor again. Another period, or one above trainer.steps (no more updates), is fine."""
    saved = {"workflow": "grpo", "trainer": {"steps": 4, "ref_sync_every": 2}}
    now = json.loads(json.dumps(saved))
    now["trainer"]["ref_sync_every"] = 1000
    check_fingerprint(Path("ck"), saved, now)
    now["trainer"]["ref_sync_every"] = 0
    with pytest.raises(CheckpointError, match=r"(?s)trainer.ref_sync_every: checkpoint 2, now 0.*starting model.*"
                                              r"above trainer.steps.*run.resume_check=false"):
        check_fingerprint(Path("ck"), saved, now)
    saved["trainer"]["ref_sync_every"] = 0  # the reference never moved: it is the starting model either way
    check_fingerprint(Path("ck"), saved, now)


def test_a_resume_path_that_does_not_exist_is_named_as_such_before_the_run_dir_is_judged(tmp_path):
    """run.resume=sometimes (a typo of a mode) in a run.dir holding a run was refused as "a run resumed from
    another run's checkpoint (sometimes) there would mix the two", and in a fresh one as "sometimes: resume
    path does not exist"; neither said it names no checkpoint and which modes there are."""
    run = tmp_path / "run"
    _save(run / "checkpoints", 2)
    for where in (run, tmp_path / "fresh"):
        with pytest.raises(CheckpointError) as info:
            check_run_dir(where, "sometimes", overwrite=False)
        msg = str(info.value)
        assert "run.resume=sometimes" in msg and "no such checkpoint" in msg and "never, auto" in msg, msg
        assert is_user_error(info.value)
    with pytest.raises(CheckpointError, match="run.resume=sometimes: no such checkpoint"):
        resume_from(run / "checkpoints", "sometimes")
