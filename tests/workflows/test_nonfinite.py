"""A NaN loss in any trained role stops the run naming the role and the metric (run.on_nonfinite=stop) or is
skipped and counted (skip): PPO's critic and the reward model of ``workflow: rm``, whose bad updates the
engine skipped while the run went on without a word (only ``actor/*`` and ``sft/loss`` were checked)."""

from __future__ import annotations

import json

import pytest

from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.errors import RunStopped
from relayrl.workflows import losses
from relayrl.workflows.registry import train

TINY = ["trainer.steps=2", "eval.size=8", "eval.every=0", "telemetry.sinks=[jsonl]", "run.threads=1",
        "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256"]
CASES = {  # recipe, the loss to poison, its overrides, the metric that turns NaN, the role's name
    "critic": ("arith_ppo", losses.ValueLoss, ["data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6"],
               "critic/vf_loss", "critic"),
    "rm": ("arith_rm", losses.BTLoss, ["trainer.batch_size=4"], "rm/loss", "reward model"),
}


def _poison(monkeypatch, cls) -> None:
    """Every loss of ``cls`` is NaN (and so its gradients)."""
    real = cls.__call__

    def nan_loss(self, mb):
        loss, metrics = real(self, mb)
        return loss * float("nan"), {k: float("nan") if k.endswith("loss") else v for k, v in metrics.items()}

    monkeypatch.setattr(cls, "__call__", nan_loss)


def _config(run_dir, case: str, *over: str) -> Config:
    recipe, _, extra, _, _ = CASES[case]
    return load_config(Config, f"recipes/{recipe}.yaml", [f"run.dir={run_dir}", *TINY, *extra, *over])


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_a_nan_update_stops_the_run_naming_the_role(tmp_path, monkeypatch, case):
    _, cls, _, metric, role = CASES[case]
    _poison(monkeypatch, cls)
    with pytest.raises(RunStopped) as info:
        train(_config(tmp_path, case))
    msg = str(info.value)
    assert msg.startswith(f"step 1: {metric} is nan (non-finite) in the {role}'s update"), msg
    assert f"The {role}'s update was not applied; the last good weights are saved in " in msg
    assert "run.on_nonfinite=skip" in msg
    assert (tmp_path / "checkpoints" / "step-000001" / "manifest.json").is_file()
    assert [r["step"] for r in _records(tmp_path)] == [0, 1]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_skip_mode_skips_and_counts_the_nan_updates(tmp_path, monkeypatch, capsys, case):
    _, cls, _, metric, role = CASES[case]
    _poison(monkeypatch, cls)
    train(_config(tmp_path, case, "run.on_nonfinite=skip"))
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert [r.get("run/nonfinite_skips") for r in recs] == [None, 1.0, 2.0]
    assert all(r[metric] is None for r in recs[1:])  # (NaN is written as null)
    out = capsys.readouterr().out
    assert f"in the {role}'s update" in out and "not applied (run.on_nonfinite=skip; 2 skipped so far)" in out


@pytest.mark.slow
def test_skip_mode_stops_after_its_limit_of_updates_skipped_in_a_row(tmp_path, monkeypatch, capsys):
    """Every batch failing is broken weights or optimizer state, not a bad batch: ``run.nonfinite_skip_limit``
    skips in a row stop the run as ``stop`` does, the last good weights saved."""
    _, cls, _, metric, role = CASES["critic"]
    _poison(monkeypatch, cls)
    with pytest.raises(RunStopped) as info:
        train(_config(tmp_path, "critic", "run.on_nonfinite=skip", "run.nonfinite_skip_limit=2", "trainer.steps=3"))
    msg = str(info.value)
    assert msg.startswith(f"step 2: {metric} is nan (non-finite) in the {role}'s update"), msg
    assert "run.on_nonfinite=skip skipped the 2 last updates in a row (run.nonfinite_skip_limit=2)" in msg
    assert (tmp_path / "checkpoints" / "step-000002" / "manifest.json").is_file()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2] and recs[1]["run/nonfinite_skips"] == 1.0
    assert "1 in a row, the run stops at run.nonfinite_skip_limit=2" in capsys.readouterr().out
