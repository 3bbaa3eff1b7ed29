"""A step's ``reward/fn/NAME_*`` and ``reward/model_std`` are over the step's rows however its scoring calls split
them. They were the row-weighted mean of each call's figure: a call of one row (``reward.stream=sample``) has std
0, so the step's std shrank towards 0, and a function that returned ``None`` for every row of a call (TRL's "not
this function's row") counted that call's rows as 0 in its mean."""

from __future__ import annotations

import math
import statistics
import textwrap

import pytest
import torch

from relayrl.data.tasks import Problem
from relayrl.engines.reward import RewardConfig, RewardEngine
from relayrl.workflows.rollout_stream import GroupRecord
from relayrl.workflows.scoring import ScoreWorker
from relayrl.workflows.state import StepState
from relayrl.workflows.step_metrics import add_call_metrics, step_metrics

FNS = """
    def length(prompts, responses, answers):
        return [float(len(r)) for r in responses]

    def odd_only(completions, **kwargs):  # TRL's shape: None for the rows that are not its own
        return [float(len(c)) if len(c) % 2 else None for c in completions]
"""

LENGTHS = [1, 2, 3, 4, 6, 5, 8, 2]


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class _Reader:
    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def read(self):
        return {"group": [i // 4 for i in self.rows], "response_ids": [torch.ones(LENGTHS[i]) for i in self.rows]}


def _step(tmp_path, calls: list[list[int]]) -> dict[str, float]:
    """The step's metrics of the rows ``LENGTHS`` scored in ``calls`` (row indexes each), as the score stage
    gathers them."""
    (tmp_path / "call_fns.py").write_text(textwrap.dedent(FNS))
    engine = RewardEngine(RewardConfig(verifier="user", user_fn=[f"{tmp_path}/call_fns.py:length",
                                                                 f"{tmp_path}/call_fns.py:odd_only"]))
    worker = ScoreWorker(engine, _Tok(), None, lambda scores, lengths: scores)
    st = StepState(problems=[Problem("p0", "a"), Problem("p1", "b")], positions=[None] * 2)
    st.records = [GroupRecord(group=g, lengths=LENGTHS[4 * g:4 * g + 4], prompt_len=2, truncated=[False] * 4)
                  for g in range(2)]
    for rows in calls:
        out = worker.score_rows(_Reader(rows), st.problems)
        add_call_metrics(st.reward_metrics, out.metrics, sum(x == x for x in out.scores), out.rows)
        st.scores += out.scores
        st.rewards += out.rewards
    return step_metrics(st, step=1, prompts_per_step=2, tri_model=False, session=None)


@pytest.mark.parametrize("calls", [[[0, 1, 2, 3], [4, 5, 6, 7]], [[i] for i in range(8)], [[0, 2], [1, 3, 4, 5, 6, 7]]])
def test_a_functions_mean_and_std_are_over_the_steps_rows_however_the_calls_split_them(tmp_path, calls):
    m = _step(tmp_path, calls)
    odd = [float(n) for n in LENGTHS if n % 2]
    assert m["reward/fn/length_mean"] == pytest.approx(statistics.fmean(LENGTHS), rel=1e-12)
    assert m["reward/fn/length_std"] == pytest.approx(statistics.pstdev(LENGTHS), rel=1e-12)
    assert m["reward/fn/odd_only_mean"] == pytest.approx(statistics.fmean(odd), rel=1e-12)  # (its own rows only)
    assert m["reward/fn/odd_only_std"] == pytest.approx(statistics.pstdev(odd), rel=1e-12)


def test_a_reward_model_std_pools_its_calls_and_the_running_moments_do_not():
    calls: dict = {}
    for rm in ([1.0], [3.0], [2.0, 6.0]):  # three calls: a std over the step's rows, not 0 from single rows
        add_call_metrics(calls, {"reward/model_mean": statistics.fmean(rm), "reward/model_std": statistics.pstdev(rm),
                                 "reward/norm_mean": 0.5, "reward/norm_std": 2.0}, len(rm))

    class _Session:  # (a step with no samples says so in the run's log)
        class tracker:
            @staticmethod
            def write_text(line):
                pass

    st = StepState(problems=[None], positions=[None])
    st.reward_metrics = calls
    m = step_metrics(st, step=1, prompts_per_step=1, tri_model=False, session=_Session())
    assert m["reward/model_mean"] == 3.0
    assert m["reward/model_std"] == pytest.approx(statistics.pstdev([1.0, 3.0, 2.0, 6.0]), rel=1e-12)
    assert m["reward/norm_mean"] == 0.5 and m["reward/norm_std"] == 2.0  # (running moments: as the calls saw them)
    assert not any(math.isnan(v) for v in m.values())
