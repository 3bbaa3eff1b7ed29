"""The tools environment's final answer keeps what its reward functions logged (TRL's ``log_extra``, a verl
dict's extras): in the step's ``info``, the episode, the dock row and the score stage's sample columns, as a
single-turn response's are (:mod:`relayrl.environments.extras`). (They were dropped.)"""

from __future__ import annotations

import textwrap

import torch

from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.reward.config import RewardConfig
from relayrl.environments.base import Episode, EpisodeEnd, StepResult
from relayrl.environments.config import EnvConfig, EpisodeSpec, build_env_factory
from relayrl.environments.episodes import EpisodeLimits, run_episodes

FNS = """
    def judged(prompts, completions, log_extra, **kwargs):  # TRL's shape: what it logs is a function of the text
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        log_extra("pred", [t.strip()[::-1] for t in texts])
        log_extra("chars", [len(t) for t in texts])
        return [float(t.strip() == "42") for t in texts]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's dict with extras
        return {"score": 1.0, "pred": solution_str.strip(), "acc": True}
"""


def _factory(tmp_path, fn: str):
    (tmp_path / "fns.py").write_text(textwrap.dedent(FNS))
    spec = EpisodeSpec(EnvConfig(name="tools", max_turns=2, max_tokens=64),
                       RewardConfig(verifier="user", user_fn=f"{tmp_path}/fns.py:{fn}"), None, {})
    return build_env_factory(spec)


def test_the_final_answers_logged_columns_are_in_its_steps_info(tmp_path):
    env = _factory(tmp_path, "judged")()
    env.reset(Problem("6*7=", "42"))
    r = env.step(" 42 ")
    assert r.done and r.reward == 1.0
    assert r.info["log_extra"] == {"pred": "24", "chars": 4}


def test_a_verl_dicts_extras_are_in_the_final_answers_info(tmp_path):
    env = _factory(tmp_path, "compute_score")()
    env.reset(Problem("6*7=", "42"))
    r = env.step("forty-two")
    assert r.reward == 1.0 and r.info["log_extra"]["pred"] == "forty-two", r.info


class Logs:
    """One step; its info logs a column (a function of the action, so a mix-up of episodes shows)."""

    def reset(self, problem):
        return ""

    def step(self, action):
        return StepResult("", reward=1.0, done=True, info={"log_extra": {"said": action, "n": len(action)}})


class LogsBad:
    def reset(self, problem):
        return ""

    def step(self, action):
        return StepResult("", reward=1.0, done=True, info={"log_extra": {"obj": object()}})


def test_an_episode_keeps_its_steps_columns_and_a_bad_one_is_its_error(tiny_model, tiny_tokenizer):
    engine = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=8)
    probs = [Problem(f"{i}+{i}=", str(2 * i)) for i in range(2)]
    prompts = [tiny_tokenizer(p.prompt)["input_ids"] for p in probs]
    params = SamplingParams(n=2, max_new_tokens=4)
    eps = run_episodes(engine, tiny_tokenizer, probs, prompts, Logs, params, EpisodeLimits(max_turns=2, max_tokens=40))
    assert all(e.end is EpisodeEnd.DONE for e in eps)
    assert all(e.extras == {"said": e.turn_texts[-1], "n": len(e.turn_texts[-1])} for e in eps), \
        [(e.extras, e.turn_texts) for e in eps]
    bad = run_episodes(engine, tiny_tokenizer, probs, prompts, LogsBad, params,
                       EpisodeLimits(max_turns=2, max_tokens=40))
    assert all(e.end is EpisodeEnd.ERROR and "LogsBad.step" in e.error and "'obj'" in e.error for e in bad), \
        [e.error for e in bad]


class _Reader:
    def __init__(self, cols):
        self.cols = cols

    def read(self):
        return self.cols


def test_an_episodes_columns_travel_through_the_dock_row_to_the_score_stages_samples():
    from relayrl.workflows.rollout_stream import group_rows
    from relayrl.workflows.scoring import ScoreWorker

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    eps = [Episode(0, s, [1, 2], token_ids=[7, 8], logprobs=[-0.1, -0.2], loss_mask=[1, 1], reward=float(s),
                   turns=1, end=EpisodeEnd.DONE, token_versions=[0, 0], extras={"pred": f"é{s}", "k": [s]})
           for s in range(3)]
    eps[2].extras = {}
    cols, _ = group_rows([1, 2], 0, [e.completion(Tok()) for e in eps], eps)
    assert all(t.dtype == torch.uint8 for t in cols["env_extras"])
    worker = ScoreWorker(None, Tok(), None, lambda scores, lengths: scores)
    out = worker.score_rows(_Reader(cols), [Problem("p", "a")], extra=2)
    assert out.scores == [0.0, 1.0, 2.0]
    assert out.extra == [{"pred": "é0", "k": [0]}, {"pred": "é1", "k": [1]}]  # (the first 2 rows: the room left)
