"""``data.retire_solved`` in GRPO runs: a row whose group a step solves is never drawn again after that step
(sync, with dynamic sampling dropping the solved groups; off-policy, where batches drawn ahead still finish),
a resumed run keeps the retired rows, and a run whose every row is retired stops early, evaluated,
checkpointed and exported, and resumes to nothing left to train; a graded reward retires at data.retire_score.

The reward (``dataflow_rewards.solves_even``) solves every response to a prompt whose first number is even and
none of the others, so the even rows retire on their first step and the odd ones never do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.workflows.pipeline import GRPOPipeline

pytestmark = pytest.mark.slow  # (short runs of the tiny model, a few seconds each)

ROOT = Path(__file__).resolve().parents[2]
ROWS, P = 12, 4
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "eval.size=4", "eval.every=0", "eval.before_training=false",
       f"data.prompts_per_step={P}", "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]",
       "run.threads=1", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256", "reward.verifier=user",
       "reward.user_fn=dataflow_rewards:solves_even", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
       "data.retire_solved=0.9"]


@pytest.fixture
def data(tmp_path) -> list[str]:
    """Overrides naming a :data:`ROWS`-row training file (row i: ``"i+i="``, i = 1..ROWS) and a held-out file."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                             for i in range(1, ROWS + 1)))
    held.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(1, 5)))
    return ["data.task=null", f"data.path={train}", f"data.eval_path={held}"]


@pytest.fixture
def steps(monkeypatch) -> list[tuple[int, list[int], dict[int, float]]]:
    """Per step whose stages all returned: ``(step, the file rows of its groups, pass rate by file row)``."""
    out: list[tuple[int, list[int], dict[int, float]]] = []
    run = GRPOPipeline._run

    def recorded(self, f, stages):
        run(self, f, stages)
        st = f.state
        rows = [p.meta["row"] for p in st.problems]
        out.append((f.step, rows, {rows[g]: r for g, r in st.pass_rates.items()}))

    monkeypatch.setattr(GRPOPipeline, "_run", recorded)
    return out


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if "data/retired" in r]


def _check_retired(steps, ahead: int) -> None:
    """Every even row drawn is solved in each group of it, and drawn in no step more than ``ahead`` steps after
    the first step that drew it (``ahead`` = trainer.off_policy_steps: batches drawn before it retired); odd
    rows are never solved."""
    first: dict[int, int] = {}
    for step, rows, rates in steps:
        for row in rows:
            first.setdefault(row, step)
            if row % 2 == 0:
                assert step <= first[row] + ahead, (row, first[row], step, steps)
        assert set(rates) == set(rows)  # every group judged has its pass rate, kept or dropped
        for row, rate in rates.items():
            assert rate == (1.0 if row % 2 == 0 else 0.0), (row, rate)
    assert {r for r in first if r % 2 == 0} == set(range(2, ROWS + 1, 2)), first  # every even row was met


def test_sync_run_never_draws_a_solved_row_again_and_a_resumed_run_keeps_the_retired_rows(
        capsys, tmp_path, data, steps):
    run = tmp_path / "run"
    args = ["train", *RUN, *data, f"run.dir={run}", "run.save_every=1", "algorithm.dynamic_sampling=true"]
    assert cli.main([*args, "trainer.steps=3"]) == 0, capsys.readouterr().err
    first_run = list(steps)
    drawn = {r for _, rows, _ in first_run for r in rows}
    assert drawn == set(range(1, ROWS + 1))  # 3 steps of 4 prompts (and refills) walked the whole file
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    retired = [r["data/retired"] for r in recs]
    assert retired == sorted(retired) and retired[-1] == ROWS // 2
    assert [r["data/active_rows"] for r in recs] == [ROWS - x for x in retired]
    # dynamic sampling dropped each even row's group (all rewards 1: no signal), and the row retired all the same
    assert sum(r["dapo/dropped_groups"] for r in recs) >= ROWS // 2
    saved = json.loads((run / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert len(saved["data"]["retired"]) == ROWS // 2

    steps.clear()
    assert cli.main([*args, "trainer.steps=6", "run.resume=auto"]) == 0, capsys.readouterr().err
    assert [s for s, _, _ in steps] == [4, 5, 6]
    assert all(r % 2 for _, rows, _ in steps for r in rows), steps  # only the odd rows are left
    _check_retired(first_run + steps, ahead=0)
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["data/retired"] for r in recs[3:]] == [ROWS // 2] * 3
    assert [r["data/active_rows"] for r in recs[3:]] == [ROWS // 2] * 3

    # resumed with data.retire_solved=null: every row is drawn again
    assert cli.main([*args, "trainer.steps=7", "run.resume=auto", "data.retire_solved=null"]) == 0
    out = capsys.readouterr().out
    assert f"relayrl: the checkpoint had retired {ROWS // 2} training rows; data.retire_solved=null draws them " \
           f"again" in out, out
    assert "data/retired" not in json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


def test_off_policy_batches_drawn_ahead_finish_and_later_ones_skip_the_retired_rows(capsys, tmp_path, data, steps,
                                                                                    monkeypatch):
    """Off-policy the checkpoint of step t records the data position at the start of batch t+1, drawn before step
    t retired its rows; it holds the rows retired up to step t all the same, so the resumed run skips them. The
    run is killed in step 4, batch 5 in flight, and resumed from the checkpoint of step 3."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    from killing import run_killed_in_step

    run = tmp_path / "run"
    over = [*RUN[1:], *data, f"run.dir={run}", "trainer.off_policy_steps=1", "run.save_every=1", "trainer.steps=6"]
    run_killed_in_step(monkeypatch, load_config(Config, RUN[0], over), 4)
    assert [s for s, _, _ in steps] == [1, 2, 3]
    recs = _records(run)
    assert recs[1]["data/retired"] < recs[2]["data/retired"] == ROWS // 2  # step 3 retired rows of its own
    saved = json.loads((run / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert saved["data"]["consumed"] == 3 * P  # the start of batch 4 (drawn after step 2) ...
    assert len(saved["data"]["retired"]) == ROWS // 2  # ... with the rows step 3 retired

    first = list(steps)
    steps.clear()
    assert cli.main(["train", RUN[0], *over, "run.resume=auto"]) == 0, capsys.readouterr().err
    assert [s for s, _, _ in steps] == [4, 5, 6]
    assert all(r % 2 for _, rows, _ in steps for r in rows), steps  # the regenerated batches too
    _check_retired(first + steps, ahead=1)
    assert [r["data/active_rows"] for r in _records(run)[3:]] == [ROWS // 2] * 3


def test_a_graded_reward_retires_the_rows_it_solves_at_data_retire_score(capsys, tmp_path, data, steps):
    """Partial credit below 1 (``dataflow_rewards.graded_even``: 0.6 for the even rows, under 0.5 for the odd
    ones) solves nothing at the default data.retire_score=1.0; at 0.5 the even rows are solved and retire as in
    the runs above, while train/accuracy still counts the scores >= 1.0 (none)."""
    run = tmp_path / "run"
    args = ["train", *RUN, *data, f"run.dir={run}", "reward.user_fn=dataflow_rewards:graded_even",
            "trainer.steps=3", "run.save_every=0", "data.retire_score=0.5"]
    assert cli.main(args) == 0, capsys.readouterr().err
    _check_retired(steps, ahead=0)
    recs = _records(run)
    assert recs[-1]["data/retired"] == ROWS // 2 and recs[-1]["data/active_rows"] == ROWS // 2
    assert all(r["train/accuracy"] == 0.0 for r in recs), [r["train/accuracy"] for r in recs]


@pytest.mark.parametrize("mode", [[], ["trainer.off_policy_steps=1"]], ids=["sync", "offpolicy"])
def test_a_run_whose_every_row_is_retired_stops_early_and_resumes_to_nothing(capsys, tmp_path, data, steps, mode):
    """Off-policy, the rollout thread finds no row left for the batch after the last step: the run still ends
    cleanly."""
    run = tmp_path / "run"
    args = ["train", *RUN, *data, f"run.dir={run}", "reward.user_fn=dataflow_rewards:always_solved",
            "trainer.steps=10", "run.save_every=0", *mode]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"relayrl: every one of the {ROWS} training rows is retired (solved at a pass rate >= " \
           f"data.retire_solved=0.9) at step 3 of 10; stopping early" in out, out
    assert [s for s, _, _ in steps] == [1, 2, 3]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in recs] == [1, 2, 3] and "eval/accuracy" in recs[-1]  # the last step evaluates
    assert [r["data/active_rows"] for r in recs] == [8, 4, 0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-000003"]
    assert (run / "model" / "config.json").exists()

    steps.clear()
    assert cli.main([*args, "run.resume=auto"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"relayrl: the run had retired every one of its {ROWS} training rows by step 3 (data.retire_solved); " \
           f"nothing left to train" in out, out
    assert steps == []
