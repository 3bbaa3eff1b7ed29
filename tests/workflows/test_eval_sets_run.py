"""Several held-out sets in a run and in ``relayrl eval``: a GRPO run with ``data.eval_path=[a, b]`` logs every eval
metric overall and per source (``eval/accuracy/<source>``) to metrics.jsonl and its eval report; ``relayrl eval
--data a b`` reports the same. The reward function marks every row of one set right and none of the other's, so
the per-source accuracies differ whatever the tiny model answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "trainer.steps=1", "eval.size=3", "eval.every=0",
       "data.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "telemetry.sinks=[jsonl]",
       "run.threads=1", "run.save_every=0", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
       "eval.before_training=false"]


@pytest.fixture
def sets(tmp_path) -> dict[str, Path]:
    """A training file, held-out sets gsm8k/test.jsonl (4 rows, answers "right") and math/test.jsonl (2 rows, answers
    "wrong", data_source "bench_b"), and the reward function that scores an answer "right" 1."""
    def write(path: Path, rows: list[dict]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    fn = tmp_path / "rewards.py"
    fn.write_text("def score(prompts, responses, answers, **fields):\n"
                  "    return [1.0 if a == 'right' else 0.0 for a in answers]\n")
    return {"train": write(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": "right"} for i in range(8)]),
            "a": write(tmp_path / "gsm8k" / "test.jsonl", [{"prompt": f"{i}+2=", "answer": "right"} for i in range(4)]),
            "b": write(tmp_path / "math" / "test.jsonl",
                       [{"prompt": f"{i}+3=", "answer": "wrong", "data_source": "bench_b"} for i in range(2)]),
            "fn": fn}


@pytest.mark.slow  # (a relayrl eval run: ~2 s)
def test_a_run_logs_each_sets_metrics(capsys, tmp_path, sets):
    run = tmp_path / "r"
    data = ["data.task=null", f"data.path={sets['train']}", f"data.eval_path=[{sets['a']},{sets['b']}]",
            "reward.verifier=user", f"reward.user_fn={sets['fn']}:score", f"run.dir={run}"]
    assert cli.main(["train", *RUN, *data]) == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals, records
    last = evals[-1]
    # eval.size=3 of each set: 3 rows of gsm8k/test.jsonl (named by its stem), 2 of math/test.jsonl (named by their
    # data_source field, which comes first)
    assert last["eval/accuracy"] == pytest.approx(3 / 5)
    assert last["eval/accuracy/test"] == 1.0 and last["eval/reward_mean/test"] == 1.0
    assert last["eval/accuracy/bench_b"] == 0.0 and last["eval/reward_mean/bench_b"] == 0.0
    assert sorted(k for k in last if k.startswith("eval/accuracy/")) == ["eval/accuracy/bench_b", "eval/accuracy/test"]
    report = json.loads(next((run / "eval").glob("eval-step*.json")).read_text())
    assert report["metrics"]["eval/accuracy/bench_b"] == 0.0


def test_relayrl_eval_takes_several_data_files(capsys, tmp_path, sets, tiny_dir):
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_dir), "--data", str(sets["a"]), str(sets["b"]), "--verifier", "user",
            "--user-fn", f"{sets['fn']}:score", "--size", "3", "--max-new-tokens", "2", "--device", "cpu",
            "--out", str(out)]
    assert cli.main(args) == 0, capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    assert report["metrics"]["eval/accuracy"] == pytest.approx(3 / 5)
    assert report["metrics"]["eval/accuracy/test"] == 1.0 and report["metrics"]["eval/accuracy/bench_b"] == 0.0
    assert report["data"] == [str(sets["a"]), str(sets["b"])]
    assert "eval/accuracy/bench_b" in capsys.readouterr().out
    # one file: no per-source keys, and the report names the file as before
    assert cli.main([*args[:5], *args[6:], "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "eval.json").read_text())
    assert one["metrics"] == {"eval/accuracy": 1.0, "eval/reward_mean": 1.0} and one["data"] == str(sets["a"])


@pytest.mark.slow  # (a relayrl eval run: ~2 s)
def test_episodes_are_reported_per_source_too(capsys, tmp_path):
    """A user environment (``env.name``) evaluates episodes: their accuracy, pass@k and ``eval/env/*`` per source."""
    (tmp_path / "flag_env.py").write_text(
        "from relayrl.environments.base import StepResult\n\n"
        "class Flag:\n"
        "    def reset(self, problem):\n"
        "        self.ok = problem.meta['extra']['ok']\n"
        "        return ''\n\n"
        "    def step(self, action):\n"
        "        return StepResult('', reward=float(self.ok), done=True)\n")

    def write(name: str, ok: int, n: int) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": f"{i}+{ok}=", "answer": "1", "ok": ok}) + "\n" for i in range(n)))
        return path

    train, good, bad = write("train.jsonl", 1, 8), write("good.jsonl", 1, 3), write("bad.jsonl", 0, 1)
    run = tmp_path / "r"
    assert cli.main(["train", *RUN, "data.task=null", f"data.path={train}", f"data.eval_path=[{good},{bad}]",
                     f"env.name={tmp_path}/flag_env.py:Flag", "env.max_turns=1", "eval.k=2", "eval.temperature=1.0",
                     f"run.dir={run}"]) == 0, capsys.readouterr().err
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in x][-1]
    assert last["eval/accuracy"] == pytest.approx(3 / 4)
    assert (last["eval/accuracy/good"], last["eval/accuracy/bad"]) == (1.0, 0.0)
    assert (last["eval/pass@2/good"], last["eval/pass@2/bad"]) == (1.0, 0.0)
    assert last["eval/env/turns_mean/good"] == last["eval/env/turns_mean/bad"] == 1.0
