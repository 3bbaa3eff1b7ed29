"""The streaming dataflow (workflows/dataflow.py): periodic == sync on the same samples, no sample bytes
through the driver, a dead rollout rank surfaces by name, and a run killed mid-period resumes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from relayrl.cluster.errors import WorkerError
from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.workflows.consume import Consume
from relayrl.workflows.pipeline import GRPOPipeline

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]


def config(run_dir, *over: str) -> Config:
    """No held-out evaluation before training (no test here reads it; with rollout.max_new_tokens=300 or 400
    it took ~5 s of a run), and a run's last one answers in 6 tokens whatever the rollout's length."""
    return load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=2", "eval.size=8", "eval.every=0", "eval.before_training=false",
        "eval.max_new_tokens=6", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0", "engine.optim.eps=1e-3",
        "run.save_every=0", *SPLIT, *over])


def one_step(cfg: Config, workflow=GRPOPipeline):
    wf = workflow(cfg)
    try:
        wf.begin()
        metrics = wf.step(1)
        weights = {k: v.detach().clone() for k, v in wf.actor.one("named_weights")}
    finally:
        wf.shutdown()
    return metrics, weights


@pytest.mark.parametrize("agg,dynamic,advantage,stream", [
    ("token-mean", False, "grpo", "group"), ("seq-mean-token-mean", False, "grpo", "group"),
    ("token-mean", True, "grpo", "group"), ("token-mean", True, "remax", "group"),
    ("token-mean", True, "grpo", "sample"), ("seq-mean-token-mean", False, "remax", "sample"),
    ("token-mean", True, "grpo-batch-std", "group"),  # (a batch-wide std: the update waits for every group)
    ("prompt-mean-token-mean", True, "grpo", "group"),  # (groups counted over the chunks, dropped ones not)
    ("prompt-mean-token-mean", False, "grpo-batch-std", "sample")])
def test_periodic_step_is_the_sync_step(tmp_path, agg, dynamic, advantage, stream):
    """Same seed, same samples: the periodic step (accumulate per arriving group, one optimizer step) leaves
    the same weights as the synchronous one (the whole batch at once), and no sample crosses the driver.
    ``dynamic``: DAPO's dynamic sampling drops the uniform groups and resamples prompts in later rounds; the
    dropped rows are retired from the dock and the step trains on the kept groups only. ``remax``: the rollout
    also generates a greedy response per kept prompt, scored as the baseline. ``stream=sample`` (the periodic
    run only; the synchronous one scores whole groups): each response is written and scored as it ends, and
    a group's rewards are written (or the group dropped) once all its rows are scored."""
    over = [f"algorithm.loss_agg={agg}", "trainer.stream_groups=1", "engine.token_budget=64",
            f"algorithm.advantage={advantage}"]
    if dynamic:
        over += ["algorithm.dynamic_sampling=true", "reward.user_fn=dataflow_rewards:half_uniform",
                 "algorithm.max_resample_rounds=4"]
    m_sync, w_sync = one_step(config(tmp_path / "sync", "trainer.mode=sync", *over))
    m_per, w_per = one_step(config(tmp_path / "periodic", "trainer.mode=periodic", f"reward.stream={stream}", *over))
    assert m_sync["reward/mean"] == m_per["reward/mean"] and m_sync["reward/std"] > 0  # the same samples
    assert m_per["actor/grad_norm"] > 0
    torch.testing.assert_close(m_per["actor/grad_norm"], m_sync["actor/grad_norm"], rtol=1e-4, atol=0)
    for k in w_sync:
        torch.testing.assert_close(w_per[k], w_sync[k], rtol=1e-5, atol=1e-6, msg=k)
    assert m_sync["dock/driver_bytes"] == 0 and m_per["dock/driver_bytes"] == 0
    torch.testing.assert_close(m_per["actor/pg_loss"], m_sync["actor/pg_loss"], rtol=1e-4, atol=1e-6)
    if dynamic:
        for m in (m_sync, m_per):
            assert m["dapo/dropped_groups"] > 0 and m["dapo/rounds"] >= 2 and m["dapo/missing_prompts"] == 0
            assert m["dapo/sampled_groups"] == 4 + m["dapo/dropped_groups"]
        assert m_sync["dapo/dropped_groups"] == m_per["dapo/dropped_groups"]
    if advantage == "remax":
        assert m_sync["remax/baseline_mean"] == m_per["remax/baseline_mean"]


@pytest.mark.parametrize("advantage", ["grpo", "grpo-batch-std"])
def test_gdpos_advantages_are_the_same_in_the_periodic_step(tmp_path, advantage):
    """Several reward functions normalised one by one (GDPO, reward.user_aggregation=normalize_then_sum): the
    periodic step, scoring each response as it ends, trains to the same weights as the synchronous one (the
    advantage stage combines each group's function scores in both), and its reward is the weighted sum."""
    over = ["trainer.stream_groups=1", f"algorithm.advantage={advantage}", "reward.user_weights=[1.0,0.2]",
            "reward.user_fn=[dataflow_rewards:by_length,dataflow_rewards:parity]",
            "reward.user_aggregation=normalize_then_sum"]
    m_sync, w_sync = one_step(config(tmp_path / "sync", "trainer.mode=sync", *over))
    m_per, w_per = one_step(config(tmp_path / "periodic", "trainer.mode=periodic", "reward.stream=sample", *over))
    assert m_sync["reward/mean"] == m_per["reward/mean"] and m_per["actor/grad_norm"] > 0
    assert m_sync["reward/verifier_mean"] == pytest.approx(m_sync["reward/mean"])  # (the weighted sum alone)
    torch.testing.assert_close(m_per["actor/grad_norm"], m_sync["actor/grad_norm"], rtol=1e-4, atol=0)
    for k in w_sync:
        torch.testing.assert_close(w_per[k], w_sync[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_dead_rollout_rank_is_named_and_nothing_is_half_trained(tmp_path):
    """The rollout process is killed mid-generation: the step raises a WorkerError naming the rollout's rank
    within seconds, and the actor's weights are those from before the step (no partial period applied)."""
    cfg = config(tmp_path, "trainer.mode=periodic", "rollout.max_new_tokens=400", "data.prompts_per_step=8",
                 "trainer.init_from=null")
    wf = GRPOPipeline(cfg)
    try:
        wf.begin()
        before = {k: v.detach().clone() for k, v in wf.actor.one("named_weights")}
        pid = wf.rollout._ranks.pids()[0]
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as info:
            wf.step(1)
        assert time.monotonic() - t0 < 60
        assert "rollout" in str(info.value) and "rank 0" in str(info.value)
        after = dict(wf.actor.one("named_weights"))
        for k, v in before.items():
            assert torch.equal(after[k], v), k
    finally:
        wf.shutdown()


def test_a_run_killed_mid_period_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    cfg = config(tmp_path, "trainer.mode=periodic", "trainer.steps=3", "run.save_every=1")
    real = Consume.update

    def dies_at_step_3(self, f):
        if f.step == 3:
            raise RuntimeError("killed mid-period")
        return real(self, f)

    monkeypatch.setattr(Consume, "update", dies_at_step_3)
    with pytest.raises(RuntimeError, match="killed mid-period"):
        GRPOPipeline(cfg).run()
    monkeypatch.setattr(Consume, "update", real)
    wf = GRPOPipeline(config(tmp_path, "trainer.mode=periodic", "trainer.steps=3", "run.save_every=1",
                             "run.resume=auto"))
    out = wf.run()
    assert wf.s.start_step == 2  # the last checkpoint; step 3's partition was regenerated
    assert (out / "config.json").is_file()
    import json

    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps.count(3) == 1 and 2 in steps


@pytest.mark.ray
def test_the_same_dataflow_runs_on_ray(tmp_path):
    """The driver program is the same on Ray: rollout and trainer are Ray actors, the dock's units Ray actors
    (chosen for a split placement), and no sample crosses the driver."""
    import json

    out = GRPOPipeline(config(tmp_path, "trainer.mode=periodic", "cluster.backend=ray")).run()
    assert (out / "config.json").is_file()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["dock/driver_bytes"] == 0 and last["actor/grad_norm"] > 0


@pytest.mark.ray
def test_on_ray_split_pools_that_cannot_fit_together_are_refused_before_any_is_placed(tmp_path):
    """An actor pool of 2 and a rollout pool of 2 on a Ray of 3 CPUs: each fits alone, not together. The run is
    refused before any group is built (no placement group made, no model loaded), naming both pools, instead
    of starting the actor and waiting ``cluster.start_timeout_s`` for the rollout's placement."""
    import ray
    from ray.util.placement_group import placement_group_table

    from relayrl.cluster import PlacementError

    if ray.is_initialized():
        ray.shutdown()
    cfg = config(tmp_path, "cluster.backend=ray", "cluster.num_cpus=3", "cluster.devices=2", "placement.pools.gen=2",
                 "cluster.start_timeout_s=12")
    try:
        with pytest.raises(PlacementError, match=r"ResourcePools 'main' 2 \(cluster.devices\), 'gen' 2 "
                                                 r"\(placement.pools.gen\) need 4 CPU\(s\) together, one per "
                                                 r"device's bundle .*but the Ray cluster has 3"):
            GRPOPipeline(cfg)
        assert placement_group_table() == {}
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_on_ray_the_scorer_on_a_pool_of_its_own_scores_as_the_driver_does(tmp_path):
    """``placement.reward=rm`` on Ray: the scorer is an actor on that pool, built from the pickled reward engine
    (its user function loaded again from its file) and the run's reward shaping (DAPO's overlong penalty), reading
    the rollout's rows from the dock's Ray units. The step's rewards are those the driver's scorer gives."""
    import json

    def rewards(run_dir, *over):
        GRPOPipeline(config(run_dir, "cluster.backend=ray", "placement.pools={}", "placement.rollout=main",
                            "trainer.steps=1",
                            "algorithm.overlong_shaping=true", "algorithm.overlong_cache=4",
                            f"reward.user_fn={Path(__file__).parent / 'dataflow_rewards.py'}:by_length", *over)).run()
        return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])

    pooled = rewards(tmp_path / "pool", "placement.pools.rm=1", "placement.reward=rm")  # (2 pools: 2 cores)
    driver = rewards(tmp_path / "driver")
    for key in ("reward/mean", "reward/verifier_mean", "actor/grad_norm"):
        assert pooled[key] == pytest.approx(driver[key], rel=1e-6), key
    assert pooled["reward/mean"] != pooled["reward/verifier_mean"]  # (the overlong penalty shaped the rewards)


def test_prompt_level_periodic_step_with_the_overlong_filter_is_the_sync_step(tmp_path):
    """ScaleRL's prompt-level aggregation with DAPO's overlong filter (rows cut at max_new_tokens leave the
    update, so their groups' token counts and the group count shrink): the periodic step, streamed one group a
    chunk, leaves the weights of the synchronous one."""
    over = ["algorithm.loss_agg=prompt-mean-token-mean", "algorithm.overlong_filter=true", "trainer.stream_groups=1",
            "engine.token_budget=256", "rollout.max_new_tokens=20", 'rollout.stop_strings=["7"]',
            "trainer.init_from=null"]
    m_sync, w_sync = one_step(config(tmp_path / "sync", "trainer.mode=sync", *over))
    m_per, w_per = one_step(config(tmp_path / "periodic", "trainer.mode=periodic", *over))
    assert 0 < m_sync["actor/overlong_filtered"] < 16 and m_sync["actor/grad_norm"] > 0
    assert m_per["actor/overlong_filtered"] == m_sync["actor/overlong_filtered"]
    torch.testing.assert_close(m_per["actor/pg_loss"], m_sync["actor/pg_loss"], rtol=1e-4, atol=1e-6)
    for k in w_sync:
        torch.testing.assert_close(w_per[k], w_sync[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_a_batch_the_overlong_filter_empties_is_skipped_not_crashed(tmp_path, mode):
    """Every response is cut at max_new_tokens=2 and DAPO's overlong filter drops them all: the step says so
    and takes no optimizer step (before, the periodic finish raised on an update with no rows)."""
    cfg = config(tmp_path, f"trainer.mode={mode}", "rollout.max_new_tokens=2", "algorithm.overlong_filter=true",
                 "trainer.init_from=null", "trainer.steps=1")
    wf = GRPOPipeline(cfg)
    try:
        wf.begin()
        before = {k: v.detach().clone() for k, v in wf.actor.one("named_weights")}
        metrics = wf.step(1)
        assert metrics["actor/skipped_update"] == 1.0 and metrics["actor/overlong_filtered"] == 16
        for k, v in wf.actor.one("named_weights"):
            assert torch.equal(v, before[k]), k
    finally:
        wf.shutdown()


def test_stages_start_on_finished_groups_while_later_ones_generate(tmp_path):
    """Streaming: with response lengths that differ (a stop string cuts random-model answers anywhere), the
    periodic trainer updates on early groups while the rollout still generates the rest; the synchronous
    split step scores early groups as they land, but its update waits for the whole batch."""
    import json

    def spans(mode: str) -> list[dict]:
        run = tmp_path / mode
        GRPOPipeline(config(run, f"trainer.mode={mode}", "trainer.init_from=null", "rollout.max_new_tokens=300",
                            "rollout.stop_strings=[\"7\"]", "data.prompts_per_step=8", "trainer.steps=1")).run()
        return [json.loads(x) for x in (run / "spans.jsonl").read_text().splitlines() if x.strip()]

    for mode, updates_during_generation in (("periodic", True), ("sync", False)):
        s = [x for x in spans(mode) if x.get("step") == 1]
        gen_end = next(x["end"] for x in s if x["name"] == "generate")
        early = [x for x in s if x["start"] < gen_end]
        assert any(x["name"] == "reward" for x in early), mode
        assert any(x["name"] == "update" for x in early) == updates_during_generation, mode


def test_the_streaming_step_equals_the_colocated_loop_with_dapo_and_remax(tmp_path):
    """The dataflow (split placement, stages per group, dropped groups retired from the dock, ReMax's greedy
    baselines streamed into the groups' rows) and the colocated synchronous loop of grpo.py, same seed: the
    same samples, the same DAPO rounds and baselines, the same weights after the step."""
    from relayrl.workflows.pipeline import GRPOPipeline

    over = ["algorithm.loss_agg=token-mean", "algorithm.dynamic_sampling=true", "algorithm.advantage=remax",
            "reward.user_fn=dataflow_rewards:half_uniform", "algorithm.max_resample_rounds=4"]
    m_flow, w_flow = one_step(config(tmp_path / "flow", *over))
    m_colo, w_colo = one_step(config(tmp_path / "colo", *over, "placement.pools={}", "placement.rollout=main"),
                              GRPOPipeline)
    for k in ("reward/mean", "reward/std", "dapo/dropped_groups", "dapo/rounds", "remax/baseline_mean",
              "actor/pg_loss", "actor/grad_norm"):
        assert m_flow[k] == pytest.approx(m_colo[k], rel=1e-5, abs=1e-7), k
    assert m_flow["dapo/dropped_groups"] > 0 and m_flow["actor/grad_norm"] > 0
    for k in w_colo:
        torch.testing.assert_close(w_flow[k], w_colo[k], rtol=1e-5, atol=1e-6, msg=k)


TIMES = ("timing/", "perf/step_time_s", "perf/tokens_per_s", "memory/", "relay/", "dock/driver_call_bytes",
         "dock/driver_unit_bytes")
"""Metrics of the machine, not of the samples and the update (times, peaks, the relay's schedule)."""


@pytest.mark.parametrize("mode", [["trainer.mode=periodic"], ["trainer.off_policy_steps=1"]])
def test_every_sample_and_update_metric_of_a_streamed_step_is_the_sync_steps(tmp_path, mode):
    """Telemetry under every step mode: step 1 of a periodic run, and of an off-policy run (its first batch is
    sampled by the starting weights, as the synchronous step's), logs every reward, length, KL, entropy, clip,
    ratio, logprob-error and token-count figure the synchronous step logs, with the same value (to float
    rounding: the per-group chunks sum in another order; measured 6e-8 in the weights), and nothing else
    but the off-policy ``async/*`` figures. A figure taken from one chunk, or averaged over chunks instead of
    tokens, would differ here."""
    over = ["trainer.stream_groups=1", "engine.token_budget=64", "algorithm.kl_coef=0.05",
            "algorithm.entropy_coef=0.01"]
    m_sync, w_sync = one_step(config(tmp_path / "sync", "trainer.mode=sync", *over))
    m_str, w_str = one_step(config(tmp_path / "streamed", *over, *mode))
    data = lambda m: {k: v for k, v in m.items() if not k.startswith(TIMES) and not k.endswith("_time_s")}  # noqa: E731
    a, b = data(m_sync), data(m_str)
    assert {k for k in b if not k.startswith("async/")} == set(a)
    for k in sorted(a):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    assert a["actor/entropy"] > 0 and a["rollout/logprob_error"] >= 1 and a["actor/kl_loss"] >= 0
    assert a["perf/tokens"] > 0 and b["perf/tokens"] == a["perf/tokens"]
    for k in w_sync:
        torch.testing.assert_close(w_str[k], w_sync[k], rtol=1e-5, atol=1e-6, msg=k)
    if "async/staleness_max" in b:
        assert b["async/staleness_max"] == 0 and b["async/tokens_stale_0"] == b["response/length_mean"] * 16
