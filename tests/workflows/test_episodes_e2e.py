"""Multi-turn episodes train from the CLI by recipe: SFT on tool demonstrations, then GRPO and PPO on
episodes (the calculator's tokens in the loss mask's 0s)."""

from __future__ import annotations

import json
import shutil

import pytest

from e2e_cli import FAST, records, relayrl

SMALL = [*FAST, "eval.size=4", "rollout.max_new_tokens=24", "env.max_tokens=48", "data.task_options.digits=3"]


@pytest.fixture(scope="module")
def tool_sft(tmp_path_factory):
    run = tmp_path_factory.mktemp("toolsum_sft")
    r = relayrl("train", "recipes/toolsum_sft.yaml", "trainer.steps=3", "trainer.batch_size=8", "eval.every=0",
                f"run.dir={run}", "eval.k=2", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1, 2, 3] and all("sft/loss" in x for x in recs[1:])
    assert "eval/env/tool_call_rate" in recs[0]  # evaluation runs episodes
    assert 0 <= recs[-1]["eval/pass@1"] <= recs[-1]["eval/pass@2"] <= 1  # and k=2 sampled ones per problem
    modes = [json.loads(x)["mode"] for x in (run / "eval" / "eval-step000003_samples.jsonl").read_text().splitlines()]
    assert modes.count("greedy") == 4 and modes.count("sample@2") == 8
    return run / "model"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["algorithm.advantage=gae", "critic.optim.lr=1e-4"],
                                   ["algorithm.clip_high=0.28", "algorithm.loss_agg=token-mean",
                                    "algorithm.dynamic_sampling=true"],
                                   ["placement.pools.gen=1", "placement.rollout=gen", "trainer.mode=periodic"],
                                   ["trainer.off_policy_steps=1", "rollout.partial=true", "reward.stream=sample"],
                                   ["env.tool_results=chat", "rollout.stop_strings=[]"]],
                         ids=["grpo", "ppo", "dapo", "periodic", "offpolicy-partial-per-sample", "chat-results"])
def test_grpo_trains_on_episodes(tool_sft, tmp_path, extra):
    """From the CLI by recipe, on the colocated loop and on the streaming dataflow (the rollout's own
    process runs the episodes and writes each finished group, or with reward.stream=sample each finished
    episode, into the dock)."""
    run = tmp_path / "grpo"
    r = relayrl("train", "recipes/toolsum_grpo.yaml", f"trainer.init_from={tool_sft}", "trainer.steps=2",
                "data.prompts_per_step=2", "rollout.n=4", "eval.every=0", f"run.dir={run}", *SMALL, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1, 2]
    for x in recs[1:]:
        for key in ("env/errors", "env/turns_mean", "env/tool_call_rate", "env/model_tokens_mean"):
            assert key in x, key
        # dynamic sampling skips a step whose groups all have equal rewards (likely on a 3-step SFT model)
        assert "reward/mean" in x or x.get("dapo/skipped_step") == 1.0
        assert x["env/turns_mean"] >= 1
        if "actor/loss" in x:
            assert x["actor/grad_norm"] == x["actor/grad_norm"]  # finite, trained
        if "placement.rollout=gen" in extra or "trainer.off_policy_steps=1" in extra:
            assert x["dock/driver_bytes"] == 0  # the episodes went from the rollout's process into the dock
        if "trainer.off_policy_steps=1" in extra:
            assert x["async/staleness_max"] <= 1
    samples = [json.loads(l) for l in (run / "eval" / "eval-step000002_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all("turns" in s for s in samples)


@pytest.mark.slow
def test_eval_by_recipe_runs_episodes_as_the_run_evaluated_them(tool_sft, tmp_path):
    """``relayrl eval --model DIR --recipe toolsum_sft.yaml`` with the SFT fixture's overrides: greedy episodes
    with the calculator on the held-out sums, scored and reported as the run's last evaluation was (every
    greedy episode the same, eval/env/* the same but for wall-clock seconds), and eval.k=2 sampled ones."""
    out = tmp_path / "eval"
    r = relayrl("eval", "--model", str(tool_sft), "--recipe", "toolsum_sft", "trainer.batch_size=8", "eval.k=2",
                *SMALL, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 held-out problems: greedy episodes (env.name=tools, at most env.max_turns=3 turns), then eval.k=2 " \
           "sampled" in r.stdout
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    trained = records(tool_sft.parent)[-1]  # step 3's evaluation
    greedy = [k for k in trained if k.startswith("eval/") and "seconds" not in k and "@" not in k]
    assert "eval/env/tool_call_rate" in greedy and "eval/env/turns_mean" in greedy
    assert {k: metrics[k] for k in greedy} == {k: trained[k] for k in greedy}
    assert 0 <= metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= 1 and "eval/avg@2" in metrics
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["mode"] for s in samples] == ["greedy"] * 4 + ["sample@2"] * 8
    assert all({"turns", "tool_calls", "end"} <= set(s) for s in samples)
    run_samples = [json.loads(x) for x in
                   (tool_sft.parent / "eval" / "eval-step000003_samples.jsonl").read_text().splitlines()]
    assert samples[:4] == run_samples[:4]


@pytest.mark.slow
def test_demo_tools_ends_with_the_accuracy_line(tmp_path):
    import re

    small = [f"--sft={o}" for o in (*SMALL, "trainer.steps=2", "trainer.batch_size=4", "eval.every=0")] + \
            [f"--grpo={o}" for o in (*SMALL, "trainer.steps=1", "data.prompts_per_step=2", "rollout.n=2", "eval.every=0")]
    r = relayrl("demo", "--tools", f"--dir={tmp_path}", *small)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"tools: accuracy \d+\.\d% -> \d+\.\d% in \d+\.\d min", last), last
    assert (tmp_path / "sft" / "model").is_dir() and (tmp_path / "grpo" / "model").is_dir()
    # A second demo replaces the stage directories a demo made, and nothing else: a run of the user's own in the
    # way (here, where the GRPO stage goes) is refused by the run directory's checks and kept, before any stage
    # trains (the demo's own SFT stage is then left as it was, not replaced).
    shutil.rmtree(tmp_path / "grpo")
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "config.json").write_text(json.dumps({"workflow": "grpo", "run": {}, "model": {},
                                                               "trainer": {}}))
    (tmp_path / "grpo" / "notes.txt").write_text("mine")
    r = relayrl("demo", "--tools", f"--dir={tmp_path}", *small)
    assert r.returncode != 0
    assert "replacing the previous demo run" not in r.stdout and (tmp_path / "sft" / "model").is_dir()
    assert "run.overwrite" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "grpo" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_user_environment_trains_on_a_dataset_with_no_reward_settings(tmp_path):
    """A user environment on ``data.path`` brings its rewards: the default ``reward.verifier=task`` (no task
    here) is not asked for, and the environment reads a row's other fields from ``problem.meta["extra"]``."""
    (tmp_path / "len_env.py").write_text(
        "from relayrl.environments.base import StepResult\n\n"
        "class TargetLength:\n"
        "    def reset(self, problem):\n"
        "        self.target = problem.meta['extra']['target']\n"
        "        return ''\n\n"
        "    def step(self, action):\n"
        "        return StepResult('', reward=float(abs(len(action) - self.target) <= 2), done=True)\n")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "target": i % 5})
                            + "\n" for i in range(40)))
    run = tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", "data.task=null", f"data.path={data}", "eval.size=4",
                f"env.name={tmp_path}/len_env.py:TargetLength", "env.max_turns=1", "trainer.steps=1",
                "data.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6", f"run.dir={run}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1] and 0.0 <= recs[1]["reward/mean"] <= 1.0
    assert "eval/accuracy" in recs[0]  # held-out episodes, scored by the environment
    r = relayrl("train", "recipes/arith_grpo.yaml", "data.task=null", f"data.path={data}", "reward.model=/m",
                f"env.name={tmp_path}/len_env.py:TargetLength", f"run.dir={tmp_path / 'r2'}", *FAST)
    assert r.returncode != 0 and "reward.model would score nothing" in r.stderr


@pytest.mark.slow
def test_routing_replay_follows_multi_turn_episodes(tmp_path):
    """algorithm.routing_replay=rollout on three-turn episodes of a tiny mixture of experts: each turn prefills
    the whole episode again, so the last turn's routes cover the prompt, every turn and every observation; the
    trainer replays them where it computes the episode (float32 on both sides: they are its own, agreement 1 and
    the log-probs the generator's, which routes laid out a token off would break)."""
    (tmp_path / "turns_env.py").write_text(
        "from relayrl.environments.base import StepResult\n\n"
        "class ThreeTurns:\n"
        "    def reset(self, problem):\n"
        "        self.turn = 0\n"
        "        return 'go'\n\n"
        "    def step(self, action):\n"
        "        self.turn += 1\n"
        "        return StepResult(' more ' * (self.turn < 3), reward=sum(c.isdigit() for c in action) / 5.0,\n"
        "                          done=self.turn == 3)\n")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", "data.task=null", f"data.path={data}", "eval.size=4",
                f"env.name={tmp_path}/turns_env.py:ThreeTurns", "env.max_turns=3", "env.max_tokens=40",
                "trainer.steps=2", "data.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
                "rollout.temperature=2.0", "model.tiny.experts=4", "algorithm.routing_replay=rollout",
                f"run.dir={run}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x for x in records(run) if "actor/routing_agreement" in x]
    assert len(steps) == 2
    for x in steps:
        assert x["env/turns_mean"] > 2  # (an episode may end at env.max_tokens first)
        assert x["actor/routing_agreement"] == pytest.approx(1.0, abs=1e-6)
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-4)
