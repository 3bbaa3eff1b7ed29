"""``trainer.total_epochs`` in a run: the session resolves it into ``trainer.steps`` over the training rows (after
the held-out rows are carved out), grpo, sft and dpo end after that many steps with their prompt source at the
end of ``total_epochs`` passes, and a run stopped midway resumes to the same last step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_INTERRUPTED
from relayrl.workflows.session import PromptSource

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
        "reward.verifier=exact", "eval.every=0", "eval.before_training=false", "eval.size=4", "trainer.steps=null"]


def _sums(path: Path, rows: int) -> Path:
    """``rows`` sums with a chosen (true) and a rejected (ten less) answer."""
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i + 7}=", "answer": str(2 * i + 7),
                                        "rejected": str(2 * i - 3)}) + "\n" for i in range(10, 10 + rows)))
    return path


@pytest.fixture
def sources(monkeypatch) -> list[PromptSource]:
    """The prompt sources the runs of a test build, in order."""
    built: list[PromptSource] = []
    init = PromptSource.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(PromptSource, "__init__", recorded)
    return built


def _steps(run_dir: Path, key: str) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, filter(str.strip, lines)) if key in r]


def _passes(src: PromptSource) -> float:
    return src.consumed / len(src.problems)


@pytest.mark.slow  # (three short runs on the tiny model, ~15 s)
@pytest.mark.parametrize("recipe,over,rows,steps,key", [
    # 20 training rows (the held-out set is a file of its own), 8 prompts a step: ceil(20 / 8) = 3
    ("arith_grpo.yaml", ["trainer.total_epochs=1", "data.prompts_per_step=8", "rollout.n=2",
                         "rollout.max_new_tokens=6"], 20, 3, "reward/mean"),
    # 30 rows less the 4 held out of the same file = 26 rows, 8 a step: ceil(2 x 26 / 8) = 7
    ("arith_sft.yaml", ["trainer.total_epochs=2", "trainer.batch_size=8"], 26, 7, "sft/loss"),
    # 12 pairs (held-out file of its own), 4 a step: ceil(1.5 x 12 / 4) = 5
    ("arith_dpo.yaml", ["trainer.total_epochs=1.5", "trainer.batch_size=4"], 12, 5, "dpo/loss"),
], ids=["grpo", "sft", "dpo"])
def test_a_run_ends_after_total_epochs_passes(capsys, tmp_path, sources, recipe, over, rows, steps, key):
    own_eval = recipe != "arith_sft.yaml"
    train = _sums(tmp_path / "train.jsonl", rows if own_eval else rows + 4)
    data = ["data.task=null", f"data.path={train}"]
    if own_eval:
        data.append(f"data.eval_path={_sums(tmp_path / 'held.jsonl', 4)}")
    run = tmp_path / "run"
    code = cli.main(["train", str(ROOT / "recipes" / recipe), *FAST, *data, *over, f"run.dir={run}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    per = 8 if recipe != "arith_dpo.yaml" else 4
    epochs = next(o.split("=")[1] for o in over if o.startswith("trainer.total_epochs="))
    assert f"relayrl: trainer.total_epochs={epochs} over {rows} rows at {per} a step" in out and \
           f": {steps} steps" in out, out
    assert _steps(run, key) == list(range(1, steps + 1))
    (src,) = sources
    assert len(src.problems) == rows
    assert float(epochs) <= _passes(src) < float(epochs) + per / rows  # the last step ends the last pass
    saved = json.loads((run / "config.json").read_text())["trainer"]
    assert saved["steps"] == steps and saved["total_epochs"] is None  # the config records what ran


@pytest.mark.slow  # (an SFT run stopped at step 3 of 7 and resumed, ~10 s)
def test_a_total_epochs_run_stopped_midway_resumes_to_the_same_last_step(capsys, tmp_path, sources, monkeypatch):
    train = _sums(tmp_path / "train.jsonl", 30)
    args = ["train", str(ROOT / "recipes" / "arith_sft.yaml"), *FAST, "data.task=null", f"data.path={train}",
            "trainer.total_epochs=2", "trainer.batch_size=8", "run.save_every=1", f"run.dir={tmp_path / 'run'}"]
    take = PromptSource.take
    taken: list[list[int]] = []

    def stop_at_third(self, n):
        if len(taken) == 2 and len(sources) == 1:
            raise KeyboardInterrupt
        out = take(self, n)
        taken.append([p.meta["row"] for p in out])
        return out

    monkeypatch.setattr(PromptSource, "take", stop_at_third)
    assert cli.main(args) == EXIT_INTERRUPTED
    out, err = capsys.readouterr()
    assert "26 rows at 8 a step (trainer.batch_size): 7 steps" in out and "interrupted at step 3" in err, (out, err)
    assert _steps(tmp_path / "run", "sft/loss") == [1, 2]

    assert cli.main([*args, "run.resume=auto"]) == 0, capsys.readouterr().err
    assert "26 rows at 8 a step (trainer.batch_size): 7 steps" in capsys.readouterr().out
    assert _steps(tmp_path / "run", "sft/loss") == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())[-1].endswith("7")
    # the rows an uninterrupted run would take, in its order
    straight = PromptSource(sources[0].seed, problems=sources[0].problems)
    assert taken == [[p.meta["row"] for p in take(straight, 8)] for _ in range(7)]
    assert 2 <= _passes(sources[1]) < 2 + 8 / 26


@pytest.mark.slow  # (a 2-step SFT run, ~5 s)
def test_max_rows_caps_the_training_rows_before_the_epochs_are_counted(capsys, tmp_path, sources):
    """data.max_rows=10 of 26 training rows with data.shuffle=false: the first 10, walked in the file's order;
    trainer.total_epochs counts passes over those 10 (ceil(1 x 10 / 5) = 2 steps)."""
    train = _sums(tmp_path / "train.jsonl", 30)
    run = tmp_path / "run"
    code = cli.main(["train", str(ROOT / "recipes" / "arith_sft.yaml"), *FAST, "data.task=null", f"data.path={train}",
                     "data.max_rows=10", "data.shuffle=false", "trainer.total_epochs=1", "trainer.batch_size=5",
                     f"run.dir={run}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "data.max_rows=10: training on 10 of 26 rows, the first ones (data.shuffle=false)" in out, out
    assert "over 10 rows at 5 a step (trainer.batch_size): 2 steps" in out, out
    assert _steps(run, "sft/loss") == [1, 2]
    (src,) = sources
    rows = [p.meta["row"] for p in src.problems]
    assert len(rows) == 10 and rows == sorted(rows) and not src.shuffle
    assert src.consumed == 10 and src.pos == 10  # one pass, in order
