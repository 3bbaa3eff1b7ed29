"""A tool that crashes in a multi-turn episode (issue 35 item 1), through ``relayrl train`` with a user
environment whose tool raises on the prompts whose characters sum to a multiple of 3. Before, such an episode
was trained on with reward 0; now by default the step fails naming the prompt and the cause, and
``env.on_error=drop_group`` drops that prompt's group from the step (counted in ``env/errors``). The
synchronous (colocated) step and the streaming ones (periodic, off-policy)."""

from __future__ import annotations

import json

import pytest

from flaky_env import crashes_on
from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_USER
from test_reward_errors import RUN

pytestmark = pytest.mark.slow

# (the environment gives the rewards: no reward function)
ENV = ["env.name=flaky_env:CrashingTool", "env.max_turns=1", "reward.verifier=task", "reward.user_fn=null"]
MODES = {"sync": [], "periodic": ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen"],
         "offpolicy": ["trainer.off_policy_steps=1", "placement.pools.gen=1", "placement.rollout=gen"]}


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


def _steps(run) -> list[dict]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in records if r.get("step", 0) >= 1]


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_by_default_the_step_fails_naming_the_prompt_and_the_cause(capsys, tmp_path, mode):
    code = cli.main(["train", *RUN, f"run.dir={tmp_path / 'r'}", *ENV, *MODES[mode]])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert "an episode of prompt '" in err and "ended with an environment error: env.step raised RuntimeError: " \
        "sandbox crashed running the tool for '" in err
    assert "fix the environment or tool, or set env.on_error=drop_group" in err
    prompt = err.split("an episode of prompt ", 1)[1].split(" (sample", 1)[0]
    assert crashes_on(eval(prompt))  # the prompt named is one the tool crashes on
    assert _steps(tmp_path / "r") == []  # nothing was trained on


@pytest.mark.parametrize("mode", ["sync", "periodic", "offpolicy"])
def test_drop_group_drops_the_groups_with_a_crashed_episode(capsys, tmp_path, mode):
    run = tmp_path / "r"
    code = cli.main(["train", *RUN, f"run.dir={run}", *ENV, "env.on_error=drop_group", *MODES[mode]])
    assert code == 0, capsys.readouterr().err
    steps = _steps(run)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["env/errors"] == 4 * r["dapo/dropped_groups"]  # every episode of a crashing prompt, n=4
        assert r["reward/mean"] == r["reward/mean"]  # no NaN reached the kept groups' rewards
    assert sum(r["env/errors"] for r in steps) > 0
