"""A generation request that fails for one prompt (issue 35 item 1), through ``relayrl train`` with
``rollout.engine=openai`` against a fake server in the test process that answers 500 (or nothing, past
``rollout.timeout_s``) for the prompts whose token ids sum to a multiple of 3. By default the step fails naming
the prompt and the cause; ``rollout.on_error=drop_group`` drops that prompt's group from the step and counts
it in ``rollout/errors``: no failed request becomes an empty or zero-reward row. The synchronous (colocated)
step, the periodic one and the off-policy one."""

from __future__ import annotations

import json

import pytest

from fake_openai import FakeServer
from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_USER
from test_reward_errors import RUN

pytestmark = pytest.mark.slow

REMOTE = ["rollout.engine=openai", "rollout.weight_sync=none", "reward.user_fn=dataflow_rewards:by_length",
          "rollout.max_new_tokens=4"]
MODES = {"sync": [], "periodic": ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen"],
         "offpolicy": ["trainer.off_policy_steps=1", "placement.pools.gen=1", "placement.rollout=gen"]}


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


@pytest.fixture
def server(request):
    s = FakeServer(**getattr(request, "param", {}))
    yield s
    s.stop()


def _train(server, run, *over) -> int:
    return cli.main(["train", *RUN, f"run.dir={run}", *REMOTE, f"rollout.base_url={server.url}", *over])


@pytest.mark.parametrize("mode", ["sync", "periodic"])
@pytest.mark.parametrize("server, cause", [({"sampled_only": True}, " answered 500: the model crashed on this prompt"),
                                           ({"sampled_only": True, "how": "hang"},
                                            ": no reply within rollout.timeout_s=1 s")],
                         indirect=["server"], ids=["error", "timeout"])
def test_by_default_the_step_fails_naming_the_prompt_and_the_cause(capsys, tmp_path, server, cause, mode):
    code = _train(server, tmp_path / "r", "rollout.timeout_s=1", *MODES[mode])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert "generating the responses to prompt '" in err and f"/v1/completions{cause}; fix the server" in err
    assert "or set rollout.on_error=drop_group to drop such a prompt's group from its step" in err
    prompt = err.split("generating the responses to prompt ", 1)[1].split(" failed:", 1)[0]
    assert server.failed and all(sum(p) % 3 == 0 for p in server.failed)
    assert eval(prompt) in {_decode(p) for p in server.failed}  # the prompt named is one whose request failed
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records] == [0]  # no step was logged


@pytest.mark.parametrize("mode", ["sync", "periodic", "offpolicy"])
def test_drop_group_drops_the_failed_groups_and_counts_them(capsys, tmp_path, server, mode):
    run = tmp_path / "r"
    code = _train(server, run, "rollout.on_error=drop_group", *MODES[mode])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "dropped the group of prompt '" in out.out and "its generation request failed: http://" in out.out
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1 and "rollout/errors" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/errors"] == r["dapo/dropped_groups"]  # every dropped group is a failed request
        assert r["perf/tokens"] > 0 and r["actor/grad_norm"] == r["actor/grad_norm"]  # the rest trained
    assert sum(r["rollout/errors"] for r in steps) > 0  # a third of the prompts fail: some group was dropped
    # the evaluations (greedy, no group to drop) scored the failed prompts as empty responses and went on
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]


def test_drop_group_with_dynamic_sampling_replaces_the_failed_groups(capsys, tmp_path, server):
    run = tmp_path / "r"
    code = _train(server, run, "rollout.on_error=drop_group", "algorithm.dynamic_sampling=true",
                  "algorithm.max_resample_rounds=8", *MODES["periodic"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert sum(r["rollout/errors"] for r in steps) > 0
    assert all(r["dapo/missing_prompts"] == 0 for r in steps)  # later rounds replaced the dropped groups


def test_the_policy_applies_to_a_server_only():
    from relayrl.config.loader import ConfigError, load_config
    from relayrl.config.schema import Config

    with pytest.raises(ConfigError, match="rollout.on_error=drop_group drops the group of a prompt whose request"):
        load_config(Config, None, ["rollout.on_error=drop_group"])
    with pytest.raises(ConfigError, match="rollout.timeout_s is read by rollout.engine=openai only"):
        load_config(Config, None, ["rollout.timeout_s=5"])
    cfg = load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=http://h:1/v1", "rollout.timeout_s=5",
                                     "rollout.retries=1", "rollout.on_error=drop_group"])
    assert (cfg.rollout.remote().timeout_s, cfg.rollout.remote().retries) == (5, 1)


_TOKENIZER = []


def _decode(ids) -> str:
    if not _TOKENIZER:
        from relayrl.models.load import load_tokenizer
        from relayrl.models.tiny import TinyModelConfig, build_tiny

        _TOKENIZER.append(load_tokenizer(build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256),
                                                    verbose=False)))
    return _TOKENIZER[0].decode(list(ids), skip_special_tokens=True).strip()[:200]
