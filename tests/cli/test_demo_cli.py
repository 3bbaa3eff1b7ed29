"""``relayrl demo``'s own checks: every stage's overrides before any stage trains."""

from __future__ import annotations

import pytest

from relayrl.cli import commands, main as cli


def test_a_mistake_in_a_later_stage_is_refused_before_the_first_stage_trains(capsys, tmp_path, monkeypatch):
    def no_training(cfg):
        raise AssertionError(f"stage {cfg.run.dir} started")

    monkeypatch.setattr(commands, "_run", no_training)
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    code = cli.main(["demo", f"--dir={tmp_path}", "--grpo", "rollout.temperatur=0"])
    err = capsys.readouterr().err
    assert code != 0 and "rollout.temperatur: unknown key; did you mean rollout.temperature?" in err, err
    assert "Traceback" not in err and not any(tmp_path.iterdir())
    with pytest.raises(AssertionError, match="base"):  # (the check itself: without the mistake, stage 1 runs)
        cli.main(["demo", f"--dir={tmp_path}"])


def test_another_run_in_a_later_stage_s_directory_is_refused_before_the_first_stage_trains(capsys, tmp_path,
                                                                                          monkeypatch):
    """``--dir`` holding a run the demo did not make in its grpo stage's place: refused at once (it was refused
    when that stage started, after the base and SFT stages had trained for minutes)."""
    def no_training(cfg):
        raise AssertionError(f"stage {cfg.run.dir} started")

    other = tmp_path / "grpo"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0}\n')
    monkeypatch.setattr(commands, "_run", no_training)
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    code = cli.main(["demo", f"--dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code != 0 and f"run.dir={other} already holds a run that wrote no complete checkpoint" in err, err
    (other / ".relayrl-demo").touch()  # (one a demo made is replaced when its stage starts)
    with pytest.raises(AssertionError, match="base"):
        cli.main(["demo", f"--dir={tmp_path}"])
