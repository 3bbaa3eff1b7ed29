"""Several reward functions combined as GDPO does (``reward.user_aggregation=normalize_then_sum``, TRL's
``multi_objective_aggregation``): the config refuses what it cannot apply to, the engine hands each function's
scores to the step, and a training step's advantages come from them while ``reward/mean`` stays the weighted
sum of the scores."""

from __future__ import annotations

import math
import statistics
import textwrap

import pytest
import torch

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.plan import step_plan
from relayrl.config.schema import Config
from relayrl.engines.reward import RewardConfig, RewardEngine

FNS = """
def by_length(prompts, responses, answers):
    return [float(len(r) % 3) / 2.0 for r in responses]

def parity(prompts, responses, answers):
    # None: "not this function's row", as TRL's reward functions say it
    return [None if len(r) % 3 == 1 else float(len(r) % 2) for r in responses]

def _flat(p):  # a prompt whose characters sum to an even number: both functions below are flat on it
    return sum(map(ord, p)) % 2 == 0

def odd(prompts, responses, answers):
    return [0.2 if _flat(p) else 0.2 * (len(r) % 2) for p, r in zip(prompts, responses)]

def even(prompts, responses, answers):  # weighted 0.2: odd + 0.2 even is 0.2 for every response
    return [0.0 if _flat(p) else 1.0 - len(r) % 2 for p, r in zip(prompts, responses)]
"""

TWO = ["reward.verifier=user", "reward.user_fn=[a.b:f,a.b:g]", "reward.user_aggregation=normalize_then_sum"]


def _config(*over: str) -> Config:
    return load_config(Config, "recipes/arith_grpo.yaml", list(over))


def _refused(*over: str) -> str:
    with pytest.raises(ConfigError) as e:
        _config(*over)
    return str(e.value)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("over,message", [
    (["reward.user_fn=a.b:f"], "reward.user_fn names 1 (one alone is the plain group normalisation): list two or "
                               "more in reward.user_fn, or drop reward.user_aggregation"),
    (["reward.format_weight=0.1", "reward.format_regex=x"], "reward.format_weight would change the logged reward "
                                                            "and not the training: unset it"),
    (["reward.clip=1", "reward.normalize=running"], "reward.normalize, reward.clip would change the logged reward"),
    (["reward.verifier_weight=2"], "reward.verifier_weight would change"),
])
def test_the_reward_section_refuses_what_gdpo_would_ignore(over, message):
    err = _refused(*TWO, *over)
    assert "reward.user_aggregation=normalize_then_sum" in err and message in err, err


def test_a_built_in_verifier_has_no_functions_to_normalise():
    err = _refused("reward.user_aggregation=normalize_then_sum")
    assert "reward.user_fn names 0" in err, err


@pytest.mark.parametrize("advantage", ["gae", "remax", "reinforce++", "grpo-passk"])
def test_estimators_that_do_not_compare_a_reward_with_its_group_are_refused(advantage):
    from relayrl.algorithms.estimators import ESTIMATORS

    fits = [n for n, e in ESTIMATORS.items() if e.group_baseline]
    assert {"grpo", "drgrpo", "rloo", "grpo-loo", "reinforce++-baseline", "grpo-batch-std", "opo"} == set(fits)
    err = _refused(*TWO, f"algorithm.advantage={advantage}")
    assert f"algorithm.advantage={advantage} does not compare a reward with its group's: use one of " \
           f"{', '.join(fits)} (grpo-batch-std is TRL's and the GDPO paper's)" in err, err


def test_a_length_penalty_outside_the_functions_other_workflows_and_episodes_are_refused():
    err = _refused(*TWO, "algorithm.overlong_shaping=true", "algorithm.overlong_cache=2")
    assert "algorithm.overlong_shaping's length penalty would not reach them" in err, err
    with pytest.raises(ConfigError) as e:
        load_config(Config, "recipes/arith_sft.yaml", [*TWO, "trainer.steps=1"])
    err = str(e.value)
    assert "which workflow sft does not compute: drop reward.user_aggregation" in err, err
    with pytest.raises(ConfigError, match="env.name='tools' gives each episode one reward from its environment"):
        load_config(Config, "recipes/toolsum_grpo.yaml", TWO)


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo", "reinforce++-baseline", "grpo-batch-std"])
def test_group_baseline_estimators_take_it_and_the_run_says_which_is_trls(advantage):
    cfg = _config(*TWO, f"algorithm.advantage={advantage}", "reward.user_weights=[1,0.2]")
    assert cfg.reward.decoupled and cfg.reward.fn_weights == [1.0, 0.2]
    notes = step_plan(cfg).notes
    said = any("TRL and the GDPO paper normalise it over the batch (algorithm.advantage=grpo-batch-std)" in n
               for n in notes)
    assert said == (advantage != "grpo-batch-std"), notes
    assert _config("reward.verifier=user", "reward.user_fn=a.b:f").reward.user_aggregation == "sum"  # the default


# ------------------------------------------------------------------ engine
def test_the_engine_gives_each_functions_scores_beside_the_weighted_sum(tmp_path):
    (tmp_path / "fns.py").write_text(textwrap.dedent(FNS))
    fns = [f"{tmp_path}/fns.py:by_length", f"{tmp_path}/fns.py:parity"]
    e = RewardEngine(RewardConfig(verifier="user", user_fn=fns, user_weights=[1.0, 0.2],
                                  user_aggregation="normalize_then_sum"))
    responses = ["", "a", "ab", "abc"]
    rewards, metrics, each = e.score_each(["p"] * 4, responses, [None] * 4)
    assert [xs[0] for xs in each] == [0.0, 0.5, 1.0, 0.0]
    assert each[1][1] != each[1][1] and [each[i][1] for i in (0, 2, 3)] == [0.0, 0.0, 1.0]  # NaN: its None
    assert rewards == pytest.approx([0.0, 0.5, 1.0, 0.2])  # the weighted sum, None adding nothing
    assert metrics["reward/mean"] == pytest.approx(sum(rewards) / 4)
    assert e.score(["p"] * 4, responses, [None] * 4) == (rewards, {**metrics, "reward/score_time_s": pytest.approx(
        metrics["reward/score_time_s"], abs=1.0)})
    assert e.verify(["p"] * 4, responses, [None] * 4) == rewards  # evaluation: the sum, as before


# -------------------------------------------------------------- a training step
def _reference(fn_scores: torch.Tensor, weights: list[float], groups: list[int]) -> list[float]:
    """TRL's normalize_then_sum with plain Python: each function over each group's rows it scored, then the
    weighted sum, then (grpo-batch-std) over the batch."""
    c = [0.0] * len(groups)
    for k, w in enumerate(weights):
        for g in set(groups):
            rows = [i for i, x in enumerate(groups) if x == g and not math.isnan(fn_scores[i, k])]
            xs = [float(fn_scores[i, k]) for i in rows]
            if len(xs) < 2 or max(xs) == min(xs):
                continue  # a flat function adds 0
            mean, std = statistics.fmean(xs), statistics.stdev(xs)
            for i, x in zip(rows, xs):
                c[i] += w * (x - mean) / (std + 1e-4)
    mean_g = {g: statistics.fmean(c[i] for i in range(len(c)) if groups[i] == g) for g in set(groups)}
    std = statistics.stdev(c)
    return [(x - mean_g[g]) / (std + 1e-6) for x, g in zip(c, groups)]


def _one_step(tmp_path, aggregation: str, monkeypatch, *over: str,
              fns: tuple[str, str] = ("by_length", "parity")) -> tuple[dict[str, float], list[tuple]]:
    import relayrl.workflows.scoring as scoring
    from relayrl.workflows.pipeline import GRPOPipeline

    seen = []
    advantage_rows = scoring.advantage_rows

    def spy(a, rewards, lengths, groups, **kw):  # what the advantage stage reads and computes
        out = advantage_rows(a, rewards, lengths, groups, **kw)
        seen.append((rewards.tolist(), kw.get("fn_scores"), groups.tolist(),
                     [float(r[0]) for r in out[0]["advantages"]]))
        return out

    monkeypatch.setattr(scoring, "advantage_rows", spy)
    path = tmp_path / "fns.py"
    path.write_text(textwrap.dedent(FNS))
    cfg = _config(f"run.dir={tmp_path / aggregation}", "trainer.steps=1", "eval.size=4", "eval.every=0",
                  "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]",
                  "run.save_every=0", "run.threads=1", "model.tiny.hidden_size=64",
                  "model.tiny.intermediate_size=256", "reward.verifier=user",
                  f"reward.user_fn=[{path}:{fns[0]},{path}:{fns[1]}]", "reward.user_weights=[1.0,0.2]",
                  f"reward.user_aggregation={aggregation}", "algorithm.advantage=grpo-batch-std", *over)
    wf = GRPOPipeline(cfg)
    try:
        wf.begin()
        metrics = wf.step(1)
    finally:
        wf.shutdown()
    return metrics, seen


@pytest.mark.slow
def test_a_training_step_takes_gdpos_advantages_and_logs_the_raw_sum(tmp_path, monkeypatch):
    m_sum, (sum_call,) = _one_step(tmp_path, "sum", monkeypatch)
    m_gdpo, (gdpo_call,) = _one_step(tmp_path, "normalize_then_sum", monkeypatch)
    rewards, fn_scores, groups, adv = gdpo_call
    assert sum_call[1] is None and fn_scores.shape == (16, 2) and torch.isnan(fn_scores[:, 1]).any()
    # the same samples: the rewards column (and reward/mean) is the weighted sum of the scores in both runs
    assert rewards == sum_call[0] and m_gdpo["reward/mean"] == m_sum["reward/mean"]
    torch.testing.assert_close(torch.tensor(rewards), torch.nan_to_num(fn_scores) @ torch.tensor([1.0, 0.2]))
    assert m_gdpo["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    # the advantages: TRL's normalize_then_sum, not GRPO's batch-std of the sum
    assert adv == pytest.approx(_reference(fn_scores, [1.0, 0.2], groups), abs=1e-4)
    assert sum_call[3] != pytest.approx(adv, abs=1e-2)
    assert m_gdpo["actor/grad_norm"] > 0 and m_gdpo["actor/grad_norm"] != pytest.approx(m_sum["actor/grad_norm"])


@pytest.mark.slow
def test_dynamic_sampling_keeps_a_group_whose_sum_is_flat_but_whose_functions_are_not(tmp_path, monkeypatch):
    """DAPO drops a group with no signal: under GDPO, one where every function is flat, not one where only
    the weighted sum is (here every response's sum is 0.2, yet odd and even lengths are told apart)."""
    m, calls = _one_step(tmp_path, "normalize_then_sum", monkeypatch, "algorithm.dynamic_sampling=true",
                         "algorithm.max_resample_rounds=4", fns=("odd", "even"))
    assert m["reward/mean"] == pytest.approx(0.2) and m["dapo/dropped_groups"] > 0
    (rewards, fn_scores, groups, adv), = calls
    assert rewards == pytest.approx([0.2] * len(rewards))
    assert len(rewards) == 4 * (m["dapo/sampled_groups"] - m["dapo/dropped_groups"]) > 0
    for g in set(groups):  # every kept group: its parities differ, and so do its advantages
        rows = [i for i, x in enumerate(groups) if x == g]
        assert len({float(fn_scores[i, 0]) for i in rows}) == 2 and len({round(adv[i], 4) for i in rows}) == 2
