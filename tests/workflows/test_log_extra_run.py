"""TRL's ``log_extra`` in a GRPO run: each row of ``RUN_DIR/samples.jsonl`` carries the columns the reward
function logged for its own response (a function of the response's text, so a mix-up of rows shows)."""

import json
import textwrap

import pytest

from grpo_runs import run_grpo

RUN_FN = """
    def tagged(prompts, completions, log_extra, **kwargs):  # TRL's shape; what it logs: a function of the completion
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        asked = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        log_extra("chars", [len(t) for t in texts])
        log_extra("reversed", [t[::-1] for t in texts])
        log_extra("reward", ["own field"] * len(texts))
        return [score(p, t) for p, t in zip(asked, texts)]

    def score(prompt, text):  # (half the prompts' groups uniform: dynamic sampling drops them)
        return 1.0 if sum(map(ord, prompt)) % 2 == 0 else float(len(text) % 3) / 2.0
"""


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_run_writes_each_samples_logged_columns_with_its_own_response(tmp_path, tiny_dir, dynamic):
    """Two steps of 2 prompts x 4 responses, 5 samples each (rows of several scoring calls); ``dynamic``: DAPO's
    dynamic sampling drops uniform groups and scores fresh prompts in later rounds."""
    (tmp_path / "logs_extra.py").write_text(textwrap.dedent(RUN_FN))
    over = ["algorithm.dynamic_sampling=true", "algorithm.max_resample_rounds=4"] if dynamic else []
    recs = run_grpo(tmp_path, tiny_dir, "telemetry.samples_per_step=5", "reward.verifier=user",
             f"reward.user_fn={tmp_path}/logs_extra.py:tagged", *over)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 5 + [2] * 5
    for step in (1, 2):  # ordered by prompt group, whatever order the scoring calls ended in
        groups = [r["group"] for r in rows if r["step"] == step]
        assert groups == sorted(groups)
    assert len({r["response"] for r in rows}) > 1  # (distinct responses: a mix-up of rows would show)
    for r in rows:
        assert r["chars"] == len(r["response"]) and r["reversed"] == r["response"][::-1]
        assert r["extra_reward"] == "own field" and r["reward"] == r["score"]
        assert r["score"] in (1.0, (len(r["response"]) % 3) / 2)
    assert not dynamic or sum(r.get("dapo/dropped_groups", 0) for r in recs) > 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_the_periodic_step_scoring_each_response_keeps_its_logged_columns(tmp_path):
    """reward.stream=sample (the rollout's own pool, trainer.mode=periodic): each response is scored alone as it
    ends, in calls of one row; the columns it logged still land in its own sample's row."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    cfg = load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={tmp_path}", "trainer.steps=2", "eval.size=8", "eval.every=0", "data.prompts_per_step=2",
        "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "telemetry.samples_per_step=6",
        "reward.verifier=user", "reward.user_fn=dataflow_rewards:logs_length", "run.save_every=0",
        "placement.pools.gen=1", "placement.rollout=gen", "trainer.mode=periodic", "reward.stream=sample"])
    GRPOPipeline(cfg).run()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 6 + [2] * 6
    assert len({r["response"] for r in rows}) > 1
    for r in rows:
        assert r["chars"] == len(r["response"]) and r["echo"] == r["response"]
        assert r["score"] == (len(r["response"]) % 3) / 2


EPISODE_FN = """
    def judged(prompts, completions, log_extra, **kwargs):  # scores a tools episode's final answer
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        log_extra("answer_chars", [len(t) for t in texts])
        log_extra("reward", ["own field"] * len(texts))
        return [float(len(t) % 2) for t in texts]
"""


@pytest.mark.slow
def test_a_tools_runs_samples_carry_the_final_answers_logged_columns(tmp_path, tiny_dir):
    """Episodes of the ``tools`` environment: each row of ``samples.jsonl`` holds what the reward function
    logged for its episode's final answer (they were dropped), ``null``-free where the episode answered."""
    (tmp_path / "judged.py").write_text(textwrap.dedent(EPISODE_FN))
    run_grpo(tmp_path, tiny_dir, "telemetry.samples_per_step=4", "env.name=tools", "env.tools=[calculator]",
             "env.max_turns=2", "env.max_tokens=32", "rollout.stop_strings=[</tool>]", "reward.verifier=user",
             f"reward.user_fn={tmp_path}/judged.py:judged")
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    answered = [r for r in rows if "answer_chars" in r]
    assert answered, rows[0]
    for r in answered:
        assert isinstance(r["answer_chars"], int) and r["extra_reward"] == "own field"
        assert r["score"] == float(r["answer_chars"] % 2)
