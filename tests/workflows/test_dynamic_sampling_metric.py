"""algorithm.dynamic_sampling_metric in the score stage: Produce._judge gives the filter the scores or the
shaped rewards, writes the kept groups' rewards and retires the dropped groups' rows (the dock and the scorer
faked; no processes)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from relayrl.algorithms.dapo import overlong_penalty
from relayrl.config.plan import step_plan
from relayrl.workflows.produce import Produce

from grpo_runs import recipe_cfg


class _Dock:
    def __init__(self) -> None:
        self.written, self.retired = [], []

    def slots(self, part, rows):
        return rows

    def publish(self, receipt) -> None:
        self.written.extend(receipt)

    def retire(self, part, rows) -> None:
        self.retired.extend(rows)


def _judge(*over: str):
    cfg = recipe_cfg("algorithm.dynamic_sampling=true", "algorithm.overlong_shaping=true", "rollout.n=2",
                     "rollout.max_new_tokens=16", "algorithm.overlong_cache=4", *over)
    dock = _Dock()
    parts = SimpleNamespace(cfg=cfg, plan=step_plan(cfg), dock=dock,
                            score=lambda fn, slots, rewards, each: list(zip(slots, rewards)))
    state = SimpleNamespace(cond=threading.Condition(), scores=[], rewards=[], dropped=set(), judged=0, kept=0,
                            pass_rates={}, filtered_rewards={})
    # group 0: both right, one long (shaping splits it); group 1: right but overlong, and wrong (shaping
    # evens it out); group 2: right and wrong, both short (kept either way)
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    lengths = torch.tensor([3, 15, 3, 20, 3, 3])
    rewards = (torch.tensor(scores) + overlong_penalty(lengths, 16, 4)).tolist()
    done = [(g, [(2 * g + j, (scores[2 * g + j], rewards[2 * g + j], None)) for j in range(2)]) for g in range(3)]
    Produce(parts)._judge(SimpleNamespace(state=state, part=0), done)
    return dock, state


def test_the_score_stage_filters_on_the_metric_it_is_given():
    dock, st = _judge()
    assert dock.retired == [0, 1] and [r for r, _ in dock.written] == [2, 3, 4, 5]
    assert st.dropped == {0} and st.kept == 2 and st.judged == 3
    assert st.rewards == [0.0, 0.0, 0.0, 1.0]  # the kept rows' shaped rewards (group 1's even out at 0)
    assert st.filtered_rewards == {0: (1.0 + 0.25) / 2}  # the dropped group's mean shaped reward (dapo/dropped_...)
    # every judged group's pass rate (data.retire_solved), the dropped one too, on the scores before shaping
    # (group 1's overlong right answer is solved though its shaped reward is 0)
    assert st.pass_rates == {0: 1.0, 1: 0.5, 2: 0.5}
    dock, st = _judge("algorithm.dynamic_sampling_metric=reward")
    assert dock.retired == [2, 3] and [r for r, _ in dock.written] == [0, 1, 4, 5]
    assert st.dropped == {1} and st.kept == 2 and st.filtered_rewards == {1: 0.0}
    assert st.pass_rates == {0: 1.0, 1: 0.5, 2: 0.5}  # (the same whatever dynamic sampling compares)
    assert [w for _, w in dock.written] == [1.0, 0.25, 0.0, 1.0]


def test_the_pass_rates_count_a_response_solved_from_data_retire_score():
    """The pass rates data.retire_solved retires by count the scores >= data.retire_score (1.0 by default; here
    the scores are 1.0 and 0.0): at 0.0 every response is solved, above 1.0 none is."""
    # (data.retire_score is read only with data.retire_solved, which retires the rows of a dataset)
    retiring = ("data.task=null", "data.path=train.jsonl", "reward.verifier=exact", "data.retire_solved=0.9")
    assert _judge(*retiring, "data.retire_score=0.0")[1].pass_rates == {0: 1.0, 1: 1.0, 2: 1.0}
    assert _judge(*retiring, "data.retire_score=1.5")[1].pass_rates == {0: 0.0, 1: 0.0, 2: 0.0}
