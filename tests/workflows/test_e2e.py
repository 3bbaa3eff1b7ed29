"""End-to-end runs of the CLI on the tiny model (slow: each run is a few seconds to a minute)."""

from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import time

import pytest

from e2e_cli import FAST, ROOT, records, relayrl


@pytest.mark.slow
def test_sft_model_loads_with_transformers(sft_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_model)
    assert model.config.model_type == "qwen2"


@pytest.mark.slow
def test_grpo_writes_every_step_metric(sft_model, tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "algorithm.kl_coef=0.01", "eval.k=4", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert 0 <= last["eval/pass@1"] <= last["eval/pass@4"] <= 1 and "eval/avg@4" in last  # eval.k sampled answers
    report = [json.loads(x) for x in (tmp_path / "eval" / "eval-step000002_samples.jsonl").read_text().splitlines()]
    modes = [x["mode"] for x in report]
    assert modes.count("sample@4") == 4 * modes.count("greedy") > 0
    for key in ["reward/mean", "reward/std", "train/accuracy", "response/length_mean", "response/length_max",
                "response/clip_ratio", "actor/kl", "actor/entropy", "actor/clip_frac_low", "actor/clip_frac_high",
                "actor/grad_norm", "actor/lr", "rollout/logprob_error", "perf/step_time_s",
                "perf/tokens_per_s_per_device", "timing/generate_s", "timing/update_s", "timing/relay_s",
                "dapo/dropped_groups", "eval/accuracy"]:
        assert key in last, key
    # the first update is on-policy: the trainer recomputes the generator's log-probs (fp32 CPU: ~exactly)
    assert last["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)
    assert "relayrl: warning: step" not in r.stdout + r.stderr  # (no mismatch warning when they match)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model" / "config.json").exists()
    assert (tmp_path / "trace.json").exists()


@pytest.mark.slow
def test_dapo_recipe_runs(sft_model, tmp_path):
    r = relayrl("train", "recipes/arith_dapo.yaml", "trainer.steps=2", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert last["dapo/sampled_groups"] >= 8 and "dapo/dropped_groups" in last


@pytest.mark.slow
def test_reinforce_pp_with_kl_in_reward(sft_model, tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=1", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "algorithm.advantage=reinforce++", "algorithm.kl_coef=0.05",
                "algorithm.kl_in_reward=true", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert "actor/kl_loss" not in last  # the KL is in the rewards, not the loss
    assert any(k.startswith("actor/") and "kl" in k for k in last)
    assert "actor/kl" in last  # issue 11 item 7: logged in both KL modes (failed before)


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_bad_config_is_refused_before_work(tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.stepz=3", f"run.dir={tmp_path}")
    assert r.returncode == 2
    assert "trainer.stepz: unknown key; did you mean trainer.steps?" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


VOLATILE = ("timing/", "memory/", "perf/tokens_per_s_per_device",
            "relay/layout_sent",  # (a resumed run's first relay sends the weight layout to its new rollout again)
            "dock/driver_call_bytes",  # (streaming stages poll rank processes as often as timing lets them)
            "params/", "optimizer/state_bytes")  # (logged with the first step each process trains)


def _stable(rec: dict) -> dict:
    """A record without the metrics that measure time or memory (durations end in ``_s``) or the process."""
    return {k: v for k, v in rec.items() if not (k.startswith(VOLATILE) or k.endswith("_s"))}


PERIODIC = ["placement.pools.gen=1", "placement.rollout=gen", "trainer.mode=periodic"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, extra", [("arith_grpo", []), ("arith_sft", []), ("arith_grpo", PERIODIC)],
                         ids=["grpo", "sft", "grpo-periodic"])
def test_killed_run_resumes_exactly(sft_model, tmp_path, recipe, extra):
    """Kill a run after its step-2 checkpoint; resume=auto must reproduce the uninterrupted run's metrics
    (periodic asynchrony too: ``benchmarks/async_flow.py --rounds`` relies on it)."""
    steps = 6
    common = [f"trainer.steps={steps}", "run.save_every=2", "eval.every=3", *FAST, *extra]
    if recipe == "arith_grpo":
        common.append(f"trainer.init_from={sft_model}")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = relayrl("train", f"recipes/{recipe}.yaml", f"run.dir={ref}", *common)
    assert r.returncode == 0, r.stderr[-3000:]

    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli.main", "train", f"recipes/{recipe}.yaml",
                             f"run.dir={cut}", *common], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = cut / "checkpoints" / "step-000002" / "manifest.json"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "model").exists(), "the run finished before it could be killed"

    r = relayrl("train", f"recipes/{recipe}.yaml", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    assert not glob.glob(f"/dev/shm/relayrl-{proc.pid}-*"), "the killed run's weight buckets outlived the resume"
    a, b = records(ref), records(cut)
    assert [x["step"] for x in b] == [x["step"] for x in a] == list(range(steps + 1))
    for x, y in zip(a, b):
        assert _stable(x) == _stable(y), f"step {x['step']} differs"


@pytest.mark.slow
def test_resume_refuses_a_corrupted_checkpoint(sft_model, tmp_path):
    common = ["trainer.steps=2", "run.save_every=1", *FAST]
    assert relayrl("train", "recipes/arith_sft.yaml", f"run.dir={tmp_path}", *common).returncode == 0
    weights = tmp_path / "checkpoints" / "step-000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    r = relayrl("train", "recipes/arith_sft.yaml", f"run.dir={tmp_path}", "run.resume=auto", "trainer.steps=3", *FAST)
    assert r.returncode != 0
    assert "model.safetensors" in r.stderr


@pytest.mark.slow
def test_eval_and_plot_commands(sft_model, tmp_path):
    out = tmp_path / "eval"
    r = relayrl("eval", "--model", str(sft_model), "--task", "arith", "--size", "8", "--k", "3",
                "--max-new-tokens", "6", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    for key in ("eval/accuracy", "eval/pass@1", "eval/pass@3", "eval/avg@3"):
        assert 0.0 <= report["metrics"][key] <= 1.0
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 + 8 * 3 and {"prompt", "response", "reward"} <= set(samples[0])
    r = relayrl("plot", str(sft_model.parent))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (sft_model.parent / "plots" / "timeline.png").exists()


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_eval_by_recipe_is_the_runs_own_evaluation(sft_model, tmp_path):
    """``relayrl eval --recipe`` with the run's recipe and overrides on its exported model gives the run's last
    evaluation answer for answer (the same code, the same held-out set); ``--task`` with the options the recipe
    gives the task, the held-out set's size and the answer length agrees with both."""
    run = sft_model.parent  # (arith_sft.yaml trainer.steps=4 *FAST; its last evaluation is step 4's)
    r = relayrl("eval", "--model", str(sft_model), "--recipe", "recipes/arith_sft.yaml", *FAST,
                "--out", str(tmp_path / "recipe"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"relayrl eval: {sft_model} on 16 held-out problems: greedy answers" in r.stdout
    report = json.loads((tmp_path / "recipe" / "eval.json").read_text())
    trained = records(run)[-1]
    assert report["metrics"] == {k: trained[k] for k in ("eval/accuracy", "eval/reward_mean")}
    assert report["recipe"] == "recipes/arith_sft.yaml" and report["task"] == "arith"
    samples = _lines(tmp_path / "recipe" / "eval_samples.jsonl")
    assert samples == _lines(run / "eval" / "eval-step000004_samples.jsonl") and len(samples) == 16
    options = '{"min_digits": 2, "max_digits": 2, "forget_carry": 0.7, "carries": "inner"}'  # (task_options + eval's)
    r = relayrl("eval", "--model", str(sft_model), "--task", "arith", "--task-options", options, "--size", "16",
                "--max-new-tokens", "5", "--out", str(tmp_path / "task"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "task" / "eval.json").read_text())["metrics"] == report["metrics"]
    assert _lines(tmp_path / "task" / "eval_samples.jsonl") == samples


@pytest.mark.slow
def test_a_runs_saved_config_evaluates_and_runs_again(sft_model, tmp_path):
    """``RUN/config.json`` lists every key at the value the run used, defaults included, and is a recipe:
    ``relayrl eval --recipe`` on it gives the run's last evaluation, and ``relayrl train`` on it (in another
    run.dir) runs the same steps again and saves the same config but for run.dir."""
    run = sft_model.parent
    saved = run / "config.json"
    r = relayrl("eval", "--model", str(sft_model), "--recipe", str(saved), "--out", str(tmp_path / "eval"))
    assert r.returncode == 0, r.stderr[-3000:]
    trained = records(run)
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["metrics"] == {k: trained[-1][k] for k in ("eval/accuracy", "eval/reward_mean")}
    again = tmp_path / "again"
    r = relayrl("train", str(saved), f"run.dir={again}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x.get("sft/loss") for x in records(again)] == pytest.approx([x.get("sft/loss") for x in trained], abs=1e-6)
    first, second = json.loads(saved.read_text()), json.loads((again / "config.json").read_text())
    assert second["run"].pop("dir") == str(again) and first["run"].pop("dir") == str(run) and second == first


@pytest.mark.slow
def test_nonfinite_update_stops_with_a_checkpoint(sft_model, tmp_path):
    # an absurd learning rate drives the weights to inf within a few steps
    common = ["trainer.steps=6", "engine.optim.lr=1e30", "engine.optim.max_grad_norm=null", *FAST]
    r = relayrl("train", "recipes/arith_sft.yaml", f"run.dir={tmp_path}", *common)
    assert r.returncode != 0
    assert "is nan" in r.stderr or "is inf" in r.stderr
    assert "in the actor's update" in r.stderr and "The actor's update was not applied" in r.stderr
    assert any((tmp_path / "checkpoints").glob("step-*/manifest.json"))
    skip = tmp_path / "skip"
    r = relayrl("train", "recipes/arith_sft.yaml", f"run.dir={skip}", "run.on_nonfinite=skip", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not applied (run.on_nonfinite=skip; 1 skipped so far)" in r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_same_driver_runs_on_ray(sft_model, tmp_path):
    """The backend is a config value: the GRPO driver runs its worker groups as Ray actors (two data-parallel
    ranks each, FSDP2 over gloo), weights as packed buckets, and the samples through a dock of two Ray
    storage units."""
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path}",
                f"trainer.init_from={sft_model}", "cluster.backend=ray", "cluster.num_cpus=4", "dock.backend=ray",
                "cluster.devices=2",
                "dock.units=2", "algorithm.kl_coef=0.01", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert last["relay/buckets"] >= 1 and last["relay/bytes"] > 1e6
    assert "reward/mean" in last and (tmp_path / "model" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["arith_base", "arith_grpo"])
def test_eval_stop_at_ends_the_run_early(tmp_path, sft_model, recipe):
    init = [f"trainer.init_from={sft_model}"] if recipe == "arith_grpo" else []
    r = relayrl("train", f"recipes/{recipe}.yaml", "trainer.steps=6", "eval.every=2", "eval.stop_at=0.0",
                f"run.dir={tmp_path}", *init, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in records(tmp_path)] == [0, 1, 2]
    assert "stopping early" in r.stdout + r.stderr
    assert (tmp_path / "model" / "config.json").exists()
    assert (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_resume_after_an_early_stop_trains_only_if_the_target_was_raised(tmp_path):
    args = ["recipes/arith_base.yaml", "trainer.steps=6", "eval.every=2", f"run.dir={tmp_path}", "run.resume=auto", *FAST]
    assert relayrl("train", *args, "eval.stop_at=0.0").returncode == 0
    r = relayrl("train", *args, "eval.stop_at=0.0")  # same target: the run is complete
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing left to train" in r.stdout + r.stderr
    assert [x["step"] for x in records(tmp_path)] == [0, 1, 2]
    r = relayrl("train", *args, "eval.stop_at=1.0")  # a target the tiny model does not reach: train on
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training on" in r.stdout + r.stderr
    assert [x["step"] for x in records(tmp_path)][-1] == 6


@pytest.mark.slow
def test_off_policy_grpo_respects_the_staleness_bound_and_resumes(sft_model, tmp_path):
    args = ["recipes/arith_grpo.yaml", "trainer.steps=4", f"run.dir={tmp_path}", f"trainer.init_from={sft_model}",
            "trainer.off_policy_steps=1", "rollout.partial=true", "algorithm.tis_cap=2.0", "run.save_every=2", *FAST]
    r = relayrl("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)[1:]
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    assert recs[0]["async/staleness_max"] == 0 and all(0 <= x["async/staleness_max"] <= 1 for x in recs)
    assert all("correction/weight_mean" in x and x["dock/driver_bytes"] == 0 for x in recs)
    assert any(x.get("relay/buckets", 0) >= 1 for x in recs)  # weights reached the rollout process packed
    assert (tmp_path / "model" / "config.json").exists()
    # Resume from step 2: the batches in flight are regenerated; the run ends at step 4 again.
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step-000004")
    r = relayrl("train", *args, "run.resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in records(tmp_path)][-2:] == [3, 4]


@pytest.mark.slow
@pytest.mark.multiproc
def test_data_parallel_grpo_and_sft_resume_on_another_world_size(sft_model, tmp_path):
    """cluster.devices=2: two actor ranks (FSDP2), two reference and two rollout ranks; the checkpoint holds
    full state by parameter name, so the run resumes on one rank."""
    dp = ["cluster.devices=2", "run.save_every=1", *FAST]
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path / 'g'}",
                f"trainer.init_from={sft_model}", "algorithm.kl_coef=0.01", *dp)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "returned a view tensor" not in r.stderr  # FSDP2's warning of a root output it cannot hook safely
    last = records(tmp_path / "g")[-1]
    assert last["relay/bytes"] > 1e6 and last["actor/grad_norm"] >= 0 and "actor/kl" in last
    # the rollout ranks sampled with the actor's weights of the step (relayed by actor rank 0 through shared
    # memory): the generator's log-probs are the trainer's to float32 rounding
    assert all(x["rollout/logprob_error_max"] < 1.001 for x in records(tmp_path / "g")[1:])
    assert (tmp_path / "g" / "model" / "model.safetensors").exists()
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=3", f"run.dir={tmp_path / 'g'}",
                f"trainer.init_from={sft_model}", "algorithm.kl_coef=0.01", "run.resume=auto", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "sampler state of 2 rollout rank(s)" in r.stdout
    assert [x["step"] for x in records(tmp_path / "g")] == [0, 1, 2, 3]

    r = relayrl("train", "recipes/arith_sft.yaml", "trainer.steps=2", f"run.dir={tmp_path / 's'}", *dp)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path / "s")
    assert recs[-1]["sft/loss"] > 0 and recs[-1]["sft/tokens"] > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_sequence_parallel_grpo_runs_on_two_ranks(tmp_path):
    """engine.sequence_parallel=2 on cluster.devices=2: the actor and the reference are one SP group each (dp=1),
    every packed sequence split over their two ranks. The first update is on-policy, so the trainer's log-probs
    (gathered back from both ranks) are the generator's to float32 rounding."""
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path}", "cluster.devices=2",
                "engine.sequence_parallel=2", "algorithm.kl_coef=0.01", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    assert [x["step"] for x in recs][-2:] == [1, 2]
    first = recs[-2]
    assert first["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)
    assert first["rollout/logprob_error_max"] < 1.001 and "actor/kl" in first and first["actor/grad_norm"] >= 0


@pytest.mark.slow
def test_dpo_recipe_runs_resumes_and_reads_a_pair_dataset(sft_model, tmp_path):
    common = ["trainer.steps=3", "trainer.batch_size=8", "eval.every=3", "run.save_every=1",
              f"trainer.init_from={sft_model}", *FAST]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = relayrl("train", "recipes/arith_dpo.yaml", f"run.dir={ref}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(ref)
    assert [x["step"] for x in recs] == [0, 1, 2, 3] and "eval/accuracy" in recs[-1]
    assert recs[1]["dpo/loss"] > 0 and 0 <= recs[-1]["dpo/reward_accuracy"] <= 1 and "timing/ref_logprob_s" in recs[1]
    # the same run cut after step 1 and resumed reproduces it
    r = relayrl("train", "recipes/arith_dpo.yaml", f"run.dir={cut}", *common[1:], "trainer.steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_dpo.yaml", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [_stable(x)["dpo/loss"] for x in records(cut)[1:] if "dpo/loss" in x] == pytest.approx(
        [x["dpo/loss"] for x in recs[1:]], rel=1e-5)

    data = tmp_path / "pairs.jsonl"  # TRL's implicit-prompt preference rows: two conversations, no prompt field

    def said(a, b, reply):
        return [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": reply}]

    data.write_text("".join(json.dumps({"chosen": said(a, b, str(a + b)), "rejected": said(a, b, str(a + b + 1))})
                            + "\n" for a in range(10, 30) for b in range(10, 14)))
    r = relayrl("train", "recipes/arith_dpo.yaml", f"run.dir={tmp_path / 'ds'}", "data.task=null",
                f"data.path={data}", "data.answer_key=chosen", "reward.verifier=exact", "cluster.devices=2",
                "eval.size=8", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert records(tmp_path / "ds")[-1]["dpo/loss"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    r = relayrl("train", "recipes/arith_dpo.yaml", f"run.dir={tmp_path / 'bad'}", "data.task=null",
                f"data.path={bad}", "reward.verifier=exact", *FAST)
    assert r.returncode != 0 and "bad.jsonl row 1: field 'rejected' (the rejected answer) is missing" in r.stderr


@pytest.mark.slow
def test_ppo_with_a_critic_runs_and_resumes_exactly(sft_model, tmp_path):
    common = ["trainer.steps=3", "run.save_every=1", "eval.every=3", "algorithm.kl_coef=0.01",
              "algorithm.kl_in_reward=true", f"trainer.init_from={sft_model}", *FAST]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = relayrl("train", "recipes/arith_ppo.yaml", f"run.dir={ref}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(ref)
    for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "actor/grad_norm", "timing/values_s",
                "actor/reward_kl"):
        assert key in recs[-1], key
    r = relayrl("train", "recipes/arith_ppo.yaml", f"run.dir={cut}", *common[1:], "trainer.steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_ppo.yaml", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    for x, y in zip(recs[2:], records(cut)[2:]):  # steps 2 and 3 need the critic's saved state to match
        assert (y["critic/vf_loss"], y["actor/loss"]) == pytest.approx((x["critic/vf_loss"], x["actor/loss"]), rel=1e-5)
    # a GRPO checkpoint has no critic: resuming it as PPO is refused with the reason
    g = tmp_path / "grpo"
    assert relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={g}", "trainer.steps=1",
                   f"trainer.init_from={sft_model}", *FAST).returncode == 0
    r = relayrl("train", "recipes/arith_ppo.yaml", f"run.dir={g}", "trainer.steps=2", "run.resume=auto",
                f"trainer.init_from={sft_model}", *FAST)
    assert r.returncode != 0 and "algorithm.advantage: checkpoint 'grpo', now 'gae'" in r.stderr
    r = relayrl("train", "recipes/arith_ppo.yaml", f"run.dir={g}", "trainer.steps=2", "run.resume=auto",
                "run.resume_check=false", f"trainer.init_from={sft_model}", *FAST)
    assert r.returncode != 0 and "holds no critic state" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_remax_uses_the_greedy_response_as_baseline(sft_model, tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={tmp_path}", "rollout.n=2",
                f"trainer.init_from={sft_model}", "algorithm.advantage=remax", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert "remax/baseline_mean" in last and "timing/greedy_baseline_s" in last and "actor/grad_norm" in last
