"""A reward function that raises for one prompt's responses (issue 35 item 2): by default the step fails naming
the prompt and the cause; ``reward.on_error=drop_group`` drops that prompt's group from the step and counts its
rows in ``reward/errors``. The synchronous (colocated) and the periodic step, through ``relayrl train``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_USER

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "trainer.steps=2", "eval.size=8", "eval.every=0",
       "data.prompts_per_step=6", "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]",
       "run.threads=1", "run.save_every=0", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
       "reward.verifier=user", "reward.user_fn=dataflow_rewards:fails_on_some_prompts"]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


def test_by_default_the_step_fails_naming_the_prompt_and_the_cause(capsys, tmp_path):
    code = cli.main(["train", *RUN, f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert "reward function dataflow_rewards:fails_on_some_prompts raised KeyError: \"no reference for '" in err
    assert ", scoring the responses to prompt '" in err and "reward.on_error=drop_group" in err
    prompt = err.split("scoring the responses to prompt ", 1)[1].split(";", 1)[0]
    assert sum(map(ord, eval(prompt))) % 3 == 0  # the prompt named is one the function fails on
    # no checkpoint: the same command again would be refused, so the error says how to run it again
    assert f"relayrl: run.dir={tmp_path / 'r'} keeps what this run wrote before it failed; to run the same " \
           f"command again add run.overwrite=true" in err, err
    assert cli.main(["train", *RUN, f"run.dir={tmp_path / 'r'}"]) == EXIT_USER
    assert "already holds a run" in capsys.readouterr().err  # (what the note forestalls)


@pytest.mark.parametrize("mode", [[], ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen"]],
                         ids=["sync", "periodic"])
def test_drop_group_drops_the_failing_groups_and_counts_their_rows(capsys, tmp_path, mode):
    run = tmp_path / "r"
    code = cli.main(["train", *RUN, f"run.dir={run}", "reward.on_error=drop_group", *mode])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1 and "reward/errors" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["reward/errors"] == 4 * r["dapo/dropped_groups"]  # n=4 rows per dropped group
    assert sum(r["reward/errors"] for r in steps) > 0  # a third of the prompts fail: some step dropped a group


def _judge_fails_on_some_prompts(self, questions):
    """An LLM judge whose server fails on the questions about a prompt whose characters sum to a multiple of 3."""
    for q in questions:
        prompt = q.split("Question: ", 1)[1].split("\nProposed answer:", 1)[0]
        if sum(map(ord, prompt)) % 3 == 0:
            raise ConnectionError(f"judge server reset the connection on {prompt!r}")
    return ["Score: 7"] * len(questions)


JUDGED = ["reward.user_fn=dataflow_rewards:by_length", "reward.judge.weight=0.5"]


@pytest.mark.parametrize("mode", [[], ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen"]],
                         ids=["sync", "periodic"])
def test_a_judge_that_fails_on_one_prompt_fails_the_step_or_drops_its_group(capsys, tmp_path, monkeypatch,
                                                                           tiny_dir, mode):
    from relayrl.engines.reward.judge import LLMJudge

    monkeypatch.setattr(LLMJudge, "ask", _judge_fails_on_some_prompts)
    judge = [f"reward.judge.path={tiny_dir}", *JUDGED]
    code = cli.main(["train", *RUN, f"run.dir={tmp_path / 'fail'}", *judge, *mode])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert f"LLM judge {tiny_dir} raised ConnectionError: judge server reset the connection on '" in err
    assert ", scoring the responses to prompt '" in err and "fix the judge, or set reward.on_error=drop_group" in err
    run = tmp_path / "drop"
    code = cli.main(["train", *RUN, f"run.dir={run}", *judge, "reward.on_error=drop_group", *mode])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert len(steps) == 2 and all(r["reward/errors"] == 4 * r["dapo/dropped_groups"] for r in steps)
    assert sum(r["reward/errors"] for r in steps) > 0
    assert all(r["reward/judge_mean"] == pytest.approx(0.7) for r in steps)  # the kept rows' verdicts


MODES = {"sync": [], "periodic": ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen"]}


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_a_failure_inside_the_step_fails_it_at_once(capsys, tmp_path, mode):
    """The function fails on training groups only (evaluations pass): the step's score stage raises the error
    within seconds (it used to wait for the failed rows' 60-second lease to expire, several times over)."""
    import time

    t0 = time.monotonic()
    code = cli.main(["train", *RUN, f"run.dir={tmp_path / 'r'}", "reward.user_fn=dataflow_rewards:fails_on_some_groups",
                     *MODES[mode]])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert time.monotonic() - t0 < 45
    assert "reward function dataflow_rewards:fails_on_some_groups raised KeyError" in err
    assert ", scoring the responses to prompt '" in err


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_a_reward_function_that_hangs_on_one_prompt_is_an_error_under_the_same_policy(capsys, tmp_path, mode):
    hangs = ["reward.user_fn=dataflow_rewards:hangs_on_some_groups", "reward.timeout_s=0.2"]
    code = cli.main(["train", *RUN, f"run.dir={tmp_path / 'fail'}", *hangs, *MODES[mode]])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert ("reward function dataflow_rewards:hangs_on_some_groups ran past reward.timeout_s=0.2 (0.2 s for the 1 "
            "prompt(s) of the call), scoring the responses to prompt '") in err
    run = tmp_path / "drop"
    code = cli.main(["train", *RUN, f"run.dir={run}", *hangs, "reward.on_error=drop_group", *MODES[mode]])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert len(steps) == 2 and all(r["reward/errors"] == 4 * r["dapo/dropped_groups"] for r in steps)
    assert sum(r["reward/errors"] for r in steps) > 0


def test_reward_functions_written_for_trl_train_on_a_chat_dataset(capsys, tmp_path):
    """TRL's shape (``completions`` and a dataset column by keyword) on chat prompts, beside a function of
    relayrl's shape, weighted: the function gets the messages and chat completions, each function's mean is
    logged, and a column one needs that the data lacks stops the run before it starts."""
    (tmp_path / "trl_rewards.py").write_text(
        "def accuracy_reward(completions, solution, **kwargs):\n"
        "    assert all(isinstance(p, list) and p[-1]['role'] == 'user' for p in kwargs['prompts']), kwargs\n"
        "    assert all(isinstance(i, int) for ids in kwargs['completion_ids'] for i in ids), kwargs\n"
        "    texts = [c[0]['content'] for c in completions]\n"
        "    return [float(t.strip() == str(s)) for t, s in zip(texts, solution)]\n\n"
        "def length(prompts, responses, answers):\n"
        "    return [0.1 * (len(r) % 3) for r in responses]\n")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "solution": 2 * i})
                            + "\n" for i in range(40)))
    base = [*RUN, "data.task=null", f"data.path={data}", "data.answer_key=solution", "eval.size=4",
            f"reward.user_fn=[{tmp_path}/trl_rewards.py:accuracy_reward,{tmp_path}/trl_rewards.py:length]",
            "reward.user_weights=[1,0.5]"]
    run = tmp_path / "r"
    assert cli.main(["train", *base, f"run.dir={run}"]) == 0, capsys.readouterr().err
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [s["step"] for s in steps if "reward/mean" in s] == [1, 2] and "eval/accuracy" in steps[0]
    for s in steps[1:]:
        assert s["reward/verifier_mean"] == pytest.approx(s["reward/fn/accuracy_reward_mean"]
                                                          + 0.5 * s["reward/fn/length_mean"])
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(40)))
    code = cli.main(["train", *base, f"data.path={other}", "data.answer_key=answer", f"run.dir={tmp_path / 'r2'}"])
    err = capsys.readouterr().err
    assert code != 0 and not (tmp_path / "r2").exists()
    assert "trl_rewards.py:accuracy_reward needs the dataset field(s) solution, which the rows lack (fields: " \
           "answer, prompt)" in err, err


def test_a_compute_score_written_for_verl_trains_on_verls_data_layout(capsys, tmp_path):
    """verl's parquet layout (chat prompt, ``reward_model.ground_truth``, ``data_source``, ``extra_info``) and
    its per-response ``compute_score``, unchanged."""
    (tmp_path / "verl_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'arith' and isinstance(extra_info['index'], int), (data_source, extra_info)\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + 0.1 * (len(solution_str) % 3)}\n")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+{i}="}],
                                        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                                        "extra_info": {"index": i}}) + "\n" for i in range(40)))
    run = tmp_path / "r"
    assert cli.main(["train", *RUN, "data.task=null", f"data.path={data}", "data.answer_key=reward_model.ground_truth",
                     "eval.size=4", f"reward.user_fn={tmp_path}/verl_reward.py:compute_score",
                     f"run.dir={run}"]) == 0, capsys.readouterr().err
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [s["step"] for s in steps if "reward/mean" in s] == [1, 2] and "eval/accuracy" in steps[0]
