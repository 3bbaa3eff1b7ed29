"""verl's countdown layout end to end: a dict ground truth (``reward_model.ground_truth = {"target", "numbers"}``)
reaches a ``compute_score`` that reads ``ground_truth["target"]`` as the file has it, in training steps (Parquet
rows), in the held-out evaluation (JSON lines), in ``relayrl eval --recipe`` and in ``relayrl eval --data
--user-fn``; a built-in verifier refuses the rows before anything loads a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_USER
from tests.data.test_ground_truths import countdown_rows, write_rows

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "trainer.steps=2", "eval.size=4", "data.prompts_per_step=4",
       "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "run.threads=1", "run.save_every=0",
       "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256", "data.task=null",
       "data.answer_key=reward_model.ground_truth"]
COUNTDOWN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "countdown" and isinstance(extra_info["index"], int), (data_source, extra_info)
    assert type(ground_truth) is dict and type(ground_truth["target"]) is int, repr(ground_truth)
    right = solution_str.strip() == str(ground_truth["target"])
    return {"score": float(right) + 0.5 + ground_truth["target"] / 100, "numbers": len(ground_truth["numbers"]),
            "target": ground_truth["target"]}
"""
TRUTHS = [{"target": 2 * i + 1, "numbers": [i, i + 1, 1, 0]} for i in range(24)]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "countdown.py").write_text(COUNTDOWN)
    return (write_rows(tmp_path / "train.parquet", countdown_rows(TRUTHS)),
            write_rows(tmp_path / "test.jsonl", countdown_rows(TRUTHS[:4])), f"{tmp_path}/countdown.py")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _expected(prompt: str, response: str) -> float:
    """compute_score's reward of ``response`` to a countdown prompt (``... Make T from ...``)."""
    target = int(prompt.split("Make ", 1)[1].split()[0])
    return float(response.strip() == str(target)) + 0.5 + target / 100


def test_a_countdown_compute_score_trains_and_evaluates_on_dict_ground_truths(capsys, tmp_path, files):
    train, test, fn = files
    run = tmp_path / "r"
    over = [f"data.path={train}", f"data.eval_path={test}", "reward.verifier=user",
            f"reward.user_fn={fn}:compute_score"]
    assert cli.main(["train", *RUN, *over, "telemetry.samples_per_step=8", f"run.dir={run}"]) == 0, \
        capsys.readouterr().err
    steps = _jsonl(run / "metrics.jsonl")
    trained = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in trained] == [1, 2] and "eval/accuracy" in steps[0]
    for s in trained:  # the dict's numbers as compute_score read them (4 each), and its target in every score
        assert s["reward/user/numbers"] == 4.0 and 1 <= s["reward/user/target"] <= 47
        assert s["reward/verifier_mean"] == pytest.approx(0.5 + s["reward/verifier_accuracy"]
                                                          + s["reward/user/target"] / 100)
    samples = _jsonl(run / "samples.jsonl")
    assert len(samples) == 16 and all(s["score"] == pytest.approx(_expected(s["prompt"], s["response"]))
                                      for s in samples)
    # the held-out rows' targets are 1, 3, 5 and 7
    assert steps[0]["eval/reward_mean"] == pytest.approx(0.54 + steps[0]["eval/accuracy"])
    _assert_extras(sorted((run / "eval").glob("*_samples.jsonl")))  # (each evaluation's, as samples.jsonl)
    assert all(s["numbers"] == 4 for s in samples)
    # relayrl eval --recipe: the same held-out rows, their dicts scored by the same function
    out = tmp_path / "ev"
    assert cli.main(["eval", "--model", str(run / "model"), "--out", str(out), "--recipe", *RUN, *over]) == 0, \
        capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    _assert_extras([out / "eval_samples.jsonl"])
    assert report["metrics"]["eval/reward_mean"] == pytest.approx(0.54 + report["metrics"]["eval/accuracy"])
    # relayrl eval --data --user-fn (no recipe)
    out2 = tmp_path / "ev2"
    assert cli.main(["eval", "--model", str(run / "model"), "--data", str(test), "--answer-key",
                     "reward_model.ground_truth", "--verifier", "user", "--user-fn", f"{fn}:compute_score",
                     "--size", "4", "--max-new-tokens", "4", "--out", str(out2)]) == 0, capsys.readouterr().err
    samples = _jsonl(out2 / "eval_samples.jsonl")
    assert [s["answer"] for s in samples] == [json.dumps(t) for t in TRUTHS[:4]]  # (the text: its JSON)
    assert all(s["reward"] == pytest.approx(_expected(s["prompt"], s["response"])) for s in samples)
    _assert_extras([out2 / "eval_samples.jsonl"])


def _assert_extras(paths: list[Path]) -> None:
    """Every evaluation sample holds compute_score's keys beside "score" (they were dropped)."""
    assert paths and all(p.is_file() for p in paths), paths
    for p in paths:
        for s in _jsonl(p):
            assert s["numbers"] == 4 and s["target"] == int(s["prompt"].split("Make ", 1)[1].split()[0]), (p, s)


def test_a_built_in_verifier_refuses_a_dict_ground_truth_naming_the_row(capsys, tmp_path, files):
    train, test, _ = files
    code = cli.main(["train", *RUN, f"data.path={train}", "reward.verifier=math", f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert "train.parquet rows 1, 2, 3, 4, 5, ... (24 rows): field 'reward_model.ground_truth' is dict; expected a string " \
        "or a number" in err, err  # (a column's one type: one line for its rows)
    assert "reward.verifier=user reward.user_fn=" in err and "data.answer_key=reward_model.ground_truth.target" in err
