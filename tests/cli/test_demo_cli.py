"""``relayrl demo``'s own checks: every stage's overrides before any stage trains."""

from __future__ import annotations

import pytest

from relayrl.cli import commands, main as cli
from relayrl.workflows.session import RunInterrupted


def _demo_without_training(capsys, tmp_path, monkeypatch, *args: str) -> tuple[int, str]:
    """``relayrl demo --dir tmp_path ARGS`` whose stages fail the test if one starts: its exit code and stderr."""
    def no_training(cfg):
        raise AssertionError(f"stage {cfg.run.dir} started")

    monkeypatch.setattr(commands, "_run", no_training)
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    code = cli.main(["demo", f"--dir={tmp_path}", *args])
    return code, capsys.readouterr().err


def test_a_mistake_in_a_later_stage_is_refused_before_the_first_stage_trains(capsys, tmp_path, monkeypatch):
    code, err = _demo_without_training(capsys, tmp_path, monkeypatch, "--grpo", "rollout.temperatur=0")
    assert code != 0 and "rollout.temperatur: unknown key; did you mean rollout.temperature?" in err, err
    assert "Traceback" not in err and not any(tmp_path.iterdir())
    with pytest.raises(AssertionError, match="base"):  # (the check itself: without the mistake, stage 1 runs)
        cli.main(["demo", f"--dir={tmp_path}"])


def test_another_run_in_a_later_stage_s_directory_is_refused_before_the_first_stage_trains(capsys, tmp_path,
                                                                                          monkeypatch):
    """``--dir`` holding a run the demo did not make in its grpo stage's place: refused at once (it was refused
    when that stage started, after the base and SFT stages had trained for minutes)."""
    other = tmp_path / "grpo"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0}\n')
    code, err = _demo_without_training(capsys, tmp_path, monkeypatch)
    assert code != 0 and f"run.dir={other} already holds a run that wrote no complete checkpoint" in err, err
    (other / ".relayrl-demo").touch()  # (one a demo made is replaced when its stage starts)
    with pytest.raises(AssertionError, match="base"):
        cli.main(["demo", f"--dir={tmp_path}"])


def test_a_demo_stopped_in_a_stage_is_replaced_by_the_next_demo(capsys, tmp_path, monkeypatch):
    """A demo interrupted while a stage trains (``--dir``) left that stage's partial run; the next demo replaces
    it, as it replaces a finished demo's, instead of refusing it as another run (it was refused: the stage
    directory was marked only when its stage finished), and the interruption's message says so."""
    def stopped(cfg):
        run_dir = cfg.run.dir
        run_dir.mkdir(parents=True, exist_ok=True)  # (as the run's claim of its directory does)
        (run_dir / "config.json").write_text(cfg.model_dump_json())
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        raise RunInterrupted(f"interrupted at step 2; no checkpoint was written yet (run.save_every=0), so there "
                             f"is nothing to resume. To start over, run the same command with run.overwrite=true "
                             f"run.dir={run_dir} (...)")

    monkeypatch.setattr(commands, "_run", stopped)
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    assert cli.main(["demo", f"--dir={tmp_path}"]) == 130
    assert (tmp_path / "base" / "metrics.jsonl").is_file()
    err = capsys.readouterr().err  # (the run's advice, run.overwrite=true with the same command, is not a demo's)
    assert "interrupted in stage 1/3" in err and "run the same relayrl demo command again" in err, err
    assert "run.overwrite=true" not in err

    def fresh(cfg):
        assert not (cfg.run.dir / "metrics.jsonl").exists(), "the partial run is still there"
        raise AssertionError(f"stage {cfg.run.dir.name} started")

    monkeypatch.setattr(commands, "_run", fresh)
    with pytest.raises(AssertionError, match="stage base started"):
        cli.main(["demo", f"--dir={tmp_path}"])
    assert "replacing the previous demo run" in capsys.readouterr().out


def test_a_demo_running_in_the_same_directory_is_refused_not_replaced(capsys, tmp_path, monkeypatch):
    """A stage directory a demo marked, held by a live run (another demo training there, in another process):
    refused before anything trains, naming that run, instead of deleted under it."""
    import json

    stage = tmp_path / "sft"
    stage.mkdir()
    (stage / ".relayrl-demo").touch()
    (stage / "config.json").write_text(json.dumps({"workflow": "sft", "run": {}, "model": {}, "trainer": {}}))
    holder = _hold(stage / ".relayrl.lock", "now")
    try:
        code, err = _demo_without_training(capsys, tmp_path, monkeypatch)
        assert code != 0 and f"run.dir={stage} is in use by another run (pid {holder.pid}" in err, err
        assert (stage / "config.json").is_file()
    finally:
        holder.kill()
        holder.wait()


def _hold(lock, started: str):
    """A process that holds the flock of ``lock`` (as a run or a demo in another process does) until killed."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, sys, time\n"
        f"f = open({str(lock)!r}, 'w')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"f.write(json.dumps({{'pid': os.getpid(), 'host': 'here', 'started': {started!r}}})); f.flush()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_two_demos_started_together_in_one_directory_the_second_is_refused(capsys, tmp_path, monkeypatch):
    """Two demos started at once both pass the stage checks (no stage is held yet); each then replaced the stage
    the other trained in. The demo holds its directory's lock: the second is refused, naming the first."""
    holder = _hold(tmp_path / ".relayrl.lock", "just now")
    try:
        code, err = _demo_without_training(capsys, tmp_path, monkeypatch)
        assert code != 0, err
        assert f"relayrl demo: {tmp_path} is in use by another demo or run (pid {holder.pid} on here" in err, err
        assert "another --dir" in err and "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(AssertionError, match="base"):  # (the lock gone with its process: the demo starts)
        cli.main(["demo", f"--dir={tmp_path}"])


def test_a_run_started_in_a_stage_after_the_demo_s_checks_is_not_deleted(capsys, tmp_path, monkeypatch):
    """A stage the demo would replace, taken by a live run between the demo's first checks and that stage's start:
    the demo refuses it there instead of deleting the directory under that run."""
    import json

    stage = tmp_path / "sft"
    holders = []

    def base_stage(cfg):
        if cfg.run.dir.name != "base":
            raise AssertionError(f"stage {cfg.run.dir} started")
        stage.mkdir()  # (while stage 1 trains, a run (marked as a demo's) takes the sft stage's directory)
        (stage / ".relayrl-demo").touch()
        (stage / "config.json").write_text(json.dumps({"workflow": "sft", "run": {}, "model": {}, "trainer": {}}))
        holders.append(_hold(stage / ".relayrl.lock", "meanwhile"))
        return tmp_path / "base" / "model"

    monkeypatch.setattr(commands, "_run", base_stage)
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    try:
        code = cli.main(["demo", f"--dir={tmp_path}"])
        err = capsys.readouterr().err
        assert code != 0 and f"run.dir={stage} is in use by another run (pid {holders[0].pid}" in err, err
        assert (stage / "config.json").is_file()
    finally:
        for h in holders:
            h.kill()
            h.wait()
