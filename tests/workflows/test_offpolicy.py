"""k-step off-policy on the streaming pipeline: per-token staleness, partial rollout (weights swapped into a
stream), the loss's importance weights, evaluation between batches, a dead rollout, resume."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from killing import run_killed_in_step
from relayrl.algorithms.correction import Correction
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.training.base import MicroBatch
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.step_metrics import staleness_metrics


def _mb(logprobs, old, gen, adv):
    mask = torch.ones_like(logprobs)
    fields = {"gen_logprobs": gen, "advantages": adv, **({} if old is None else {"old_logprobs": old})}
    return MicroBatch(logprobs, mask, fields, int(mask.sum()), logprobs.shape[0], None)


def test_truncated_importance_weights_scale_the_token_losses():
    torch.manual_seed(0)
    lp = torch.randn(2, 3).requires_grad_()
    old = lp.detach().clone()
    gen = old - torch.tensor([[0.0, 0.5, 2.0], [-0.3, 0.0, 0.1]])  # pi_old / mu = exp(old - gen)
    adv = torch.ones(2, 3)
    plain, _ = PolicyLoss(agg="token-mean")(_mb(lp, old, gen, adv))
    tis = Correction(level="token", mode="truncate", high=2.0)  # what algorithm.tis_cap=2.0 runs
    weighted, m = PolicyLoss(agg="token-mean", correction=tis)(_mb(lp, old, gen, adv))
    w = torch.exp(old - gen).clamp(max=2.0)
    assert torch.allclose(weighted, plain * w.mean(), atol=1e-6)  # ratio 1: each token's loss is -A * w
    assert m["correction/token_capped_frac"] == pytest.approx(1 / 6)
    # one update per batch: no old_logprobs column, pi_old is the update's own log-probs (the same numbers)
    no_old, m2 = PolicyLoss(agg="token-mean", correction=tis)(_mb(lp, None, gen, adv))
    torch.testing.assert_close(no_old, weighted)
    assert m2["correction/token_capped_frac"] == m["correction/token_capped_frac"]
    rollout_old, _ = PolicyLoss(agg="token-mean", old_key="gen_logprobs")(_mb(lp, old, gen, adv))
    assert not torch.allclose(rollout_old, plain)  # the ratio is taken against the rollout's log-probs


def test_staleness_is_a_token_distribution_and_the_bound_is_enforced():
    # step 5 trains with weights 4; k=2: versions 2, 3, 4 are allowed
    m = staleness_metrics([{4: 3}, {3: 2, 4: 2}, {2: 1}], step=5, k=2)
    assert m["async/tokens_stale_0"] == 5 and m["async/tokens_stale_1"] == 2 and m["async/tokens_stale_2"] == 1
    assert m["async/staleness_max"] == 2 and m["async/staleness_mean"] == pytest.approx((2 + 2) / 8)
    assert m["async/multi_version_frac"] == pytest.approx(1 / 3)
    with pytest.raises(RuntimeError, match="staleness bound k=1"):
        staleness_metrics([{2: 1}], step=5, k=1)


class _OneRank:
    """A one-rank in-process group around ``worker`` (what WeightRelay pushes to)."""

    backend, in_driver, world_size, name = "local", True, 1, "rollout"

    def __init__(self, worker) -> None:
        self.w = worker

    def all(self, method, *args, **kwargs):
        return [getattr(self.w, getattr(method, "__name__", method))(*args, **kwargs)]

    def one(self, method, *args, rank=0, **kwargs):
        return getattr(self.w, getattr(method, "__name__", method))(*args, **kwargs)


def _stream(worker, dock, prompts, params, partial):
    n = params.n
    dock.open_partition("p", rows=len(prompts) * n, group_size=n)
    slots = [dock.reserve("p", n) for _ in prompts]
    worker.start_stream(prompts, params, slots, list(range(len(prompts))), partial=partial)


def _drain(worker, dock):
    infos, done = [], False
    while not done:
        got, done = worker.poll_stream(0.2)
        for receipt, records in got:
            dock.publish(receipt)
            infos += records
    return infos


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_weights_sent_during_a_partial_stream_load_between_decode_steps(tiny_dir):
    """A partial stream takes new weights mid-generation: the relay call returns once they are in, the rows
    written to the dock carry per-token versions (old then new), and each row's earlier tokens keep the
    behaviour log-probs they were sampled with (the same as a stream that got no new weights)."""
    from relayrl.dock import Dock
    from relayrl.weights import WeightRelay
    from relayrl.workflows.rollout_worker import RolloutWorker as StreamingRollout

    torch.set_num_threads(1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]

    def rows(partial: bool, swap: bool):
        worker = StreamingRollout(str(tiny_dir), seed=3)
        dock = Dock()
        relay = WeightRelay()
        new = [(k, v + 0.05 * torch.randn_like(v)) for k, v in worker.engine.model.named_parameters()]
        decoding = threading.Event()  # the first token is sampled: the new weights must land mid-stream
        advance = worker.engine.advance
        worker.engine.advance = lambda *a, **k: (decoding.set(), advance(*a, **k))[1]
        _stream(worker, dock, prompts, params, partial)
        if swap:
            assert decoding.wait(60)
            relay.push_to_group(new, _OneRank(worker), version=1)  # waits for a decode-step boundary
        infos = _drain(worker, dock)
        got = dock.get("p", list(range(4)), ["response_ids", "gen_logprobs", "token_versions", "version"])
        dock.shutdown()
        return got, infos, worker

    plain, _, _ = rows(partial=True, swap=False)
    got, infos, worker = rows(partial=True, swap=True)
    assert worker.engine.weight_version == 1
    for i in range(4):
        v = got["token_versions"][i]
        cut = int((v == 0).sum())
        assert 0 < cut < len(v) and v[cut:].eq(1).all(), v  # old weights, then the new ones, never back
        assert int(got["version"][i]) == 0
        assert torch.equal(got["response_ids"][i][:cut], plain["response_ids"][i][:cut])
        torch.testing.assert_close(got["gen_logprobs"][i][:cut], plain["gen_logprobs"][i][:cut])
    assert all(len(r) == 2 for info in infos for r in info.versions)  # tokens per version, per row
    # without partial, weights sent mid-stream are refused: a batch must not mix weight versions
    worker = StreamingRollout(str(tiny_dir), seed=3)
    dock = Dock()
    _stream(worker, dock, prompts, params, partial=False)
    with pytest.raises(RuntimeError, match="must not mix weight versions"):
        WeightRelay().push_to_group(list(worker.engine.model.named_parameters()), _OneRank(worker), version=1)
    _drain(worker, dock)
    dock.shutdown()


# ------------------------------------------------------------------------------------ the workflow
def config(run_dir, *over: str):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    return load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=4", "eval.size=8", "eval.every=0", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=24", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
        "run.save_every=0", "trainer.init_from=null", "algorithm.tis_cap=2.0", *over])


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("partial", [False, True])
def test_off_policy_runs_on_the_dock_within_the_staleness_bound(tmp_path, partial):
    """k=2 with an evaluation after every step: every token is at most 2 versions stale, no sample crosses
    the driver, weights reach the rollout packed, the model learns something (weights move), and without
    partial rollout no batch mixes weight versions (an evaluation waits for the batch being generated)."""
    from relayrl.workflows.pipeline import GRPOPipeline

    out = GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=2", f"rollout.partial={str(partial).lower()}",
                               "eval.every=1")).run()
    assert (out / "config.json").is_file()
    recs = [r for r in records(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert 0 <= r["async/staleness_max"] <= 2 and r["dock/driver_bytes"] == 0
        tokens = sum(r[f"async/tokens_stale_{s}"] for s in range(3))
        assert tokens == pytest.approx(r["response/length_mean"] * 16)  # every response token, once
        assert "correction/weight_mean" in r and "eval/accuracy" in r
        # the trainer's wait, once (async/wait_rollout_s was a second figure for it that disagreed)
        assert r["timing/wait_rollout_s"] >= 0 and "async/wait_rollout_s" not in r
        if not partial:
            assert r["async/multi_version_frac"] == 0
    assert recs[0]["async/staleness_max"] == 0  # batch 1 was generated by the starting weights
    assert any(r.get("relay/buckets", 0) >= 1 for r in recs)
    assert any(r["actor/grad_norm"] > 0 for r in recs)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_dead_rollout_surfaces_by_name_and_nothing_hangs(tmp_path):
    """The rollout process is killed while it generates ahead: the trainer's step raises a WorkerError naming
    the rollout's rank within seconds (it does not wait for a batch that will never come)."""
    from relayrl.cluster.errors import WorkerError
    from relayrl.workflows.pipeline import GRPOPipeline

    wf = GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1", "rollout.partial=true",
                              "rollout.max_new_tokens=400", "data.prompts_per_step=8", "trainer.steps=20"))
    try:
        wf.begin()
        pid = wf.rollout._ranks.pids()[0]
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as info:
            for step in range(1, 21):
                wf.step(step)
        assert time.monotonic() - t0 < 90
        assert "rollout" in str(info.value) and "rank 0" in str(info.value)
    finally:
        wf._stop_ahead()
        wf.shutdown()


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_killed_off_policy_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """The trainer dies in step 3 (after the checkpoint of step 2, with batches 3 and 4 in flight): the resumed
    run starts from step 2's checkpoint, regenerates batch 3 from the data position saved for it, and ends."""
    from relayrl.workflows.pipeline import GRPOPipeline

    over = ["trainer.off_policy_steps=1", "rollout.partial=true", "run.save_every=1"]
    run_killed_in_step(monkeypatch, config(tmp_path, *over), 3)
    saved = json.loads((tmp_path / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    wf = GRPOPipeline(config(tmp_path, *over, "run.resume=auto"))
    out = wf.run()
    assert wf.s.start_step == 2 and (out / "config.json").is_file()
    steps = [r["step"] for r in records(tmp_path)]
    assert steps.count(3) == 1 and steps[-1] == 4
    assert saved["data"] != {} and "rollout_rng" in saved


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_rollout_thread_that_fails_surfaces_in_the_trainer(tmp_path, monkeypatch):
    """The driver's rollout thread raises while opening batch 3: the trainer's step 3 raises that error (it does
    not wait for a batch that will never come), and no step 3 is logged."""
    from relayrl.workflows.pipeline import GRPOPipeline

    real = GRPOPipeline.open_step

    def breaks_at_3(self, step):
        if step == 3:
            raise ValueError("the rollout thread broke at batch 3")
        return real(self, step)

    monkeypatch.setattr(GRPOPipeline, "open_step", breaks_at_3)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="broke at batch 3"):
        GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1")).run()
    assert time.monotonic() - t0 < 120
    assert [r["step"] for r in records(tmp_path)] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.ray
def test_off_policy_with_partial_rollout_runs_on_ray(tmp_path):
    """The same driver on Ray: the rollout a Ray actor that takes staged weights mid-stream, the dock's units
    Ray actors; no sample crosses the driver and the bound holds."""
    from relayrl.workflows.pipeline import GRPOPipeline

    out = GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1", "rollout.partial=true",
                               "cluster.backend=ray", "trainer.steps=3")).run()
    assert (out / "config.json").is_file()
    recs = [r for r in records(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["dock/driver_bytes"] == 0 and r["async/staleness_max"] <= 1 for r in recs)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("agg", ["token-mean", "prompt-mean-token-mean"])
def test_off_policy_with_dynamic_sampling_trains_on_kept_groups_only(tmp_path, agg):
    """DAPO's dynamic sampling on the off-policy pipeline: uniform groups are dropped and replaced by later
    rounds while the trainer works on an earlier batch; the staleness counts only the kept groups' tokens.
    ScaleRL's prompt-level aggregation too (each arriving group counted once, the dropped ones not)."""
    from relayrl.workflows.pipeline import GRPOPipeline

    GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1", "rollout.partial=true", "trainer.steps=3",
                         "algorithm.dynamic_sampling=true", "reward.user_fn=dataflow_rewards:half_uniform",
                         "algorithm.max_resample_rounds=8", f"algorithm.loss_agg={agg}")).run()
    recs = [r for r in records(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert sum(r["dapo/dropped_groups"] for r in recs) > 0 and all(r["dapo/missing_prompts"] == 0 for r in recs)
    for r in recs:
        tokens = sum(r[f"async/tokens_stale_{s}"] for s in range(2))
        assert tokens == pytest.approx(r["response/length_mean"] * 16)  # 4 kept groups of 4
        assert r["reward/std"] > 0 and r["async/staleness_max"] <= 1
        assert r["actor/grad_norm"] > 0 and r.get("actor/skipped_update", 0.0) == 0.0


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_producing_stage_that_fails_late_stops_the_trainers_step(tmp_path, monkeypatch):
    """Issue 31 item 10: the score stage of batch 2 fails after it wrote every reward (the trainer may already
    have consumed the batch): the trainer's step 2 raises that error instead of logging the step (the
    off-policy producer used to swallow errors raised after generation ended)."""
    from relayrl.workflows.pipeline import GRPOPipeline
    from relayrl.workflows.produce import Produce

    real = Produce.score

    def fails_late(self, f):
        real(self, f)
        if f.step == 2:
            raise RuntimeError("the verifier broke after batch 2")

    monkeypatch.setattr(Produce, "score", fails_late)
    with pytest.raises(RuntimeError, match="verifier broke after batch 2"):
        GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1", "trainer.steps=3")).run()
    assert [r["step"] for r in records(tmp_path)] == [0, 1]


@pytest.mark.parametrize("partial", [True, False])
def test_partial_rollout_polls_briefly_so_staged_weights_go_out_at_once(partial):
    """The driver hands weights staged during a partial stream to the ranks between two polls of it, so a
    poll waits at most ``PARTIAL_POLL_S`` for a finished group; without partial rollout it may wait longer."""
    from types import SimpleNamespace

    from relayrl.config.plan import PARTIAL_POLL_S
    from relayrl.workflows.produce import Produce

    waits, handed = [], []

    class Ranks:
        world_size = 1

        def one(self, method, *args, rank=0, **kwargs):
            if getattr(method, "__name__", method) == "poll_stream":  # (RolloutWorker.poll_stream)
                waits.append(args[0])
                return [], len(waits) == 3  # nothing finished twice, then the stream ends

    parts = SimpleNamespace(
        sampling=SimpleNamespace(n=2), greedy=None, rollout=Ranks(), episodes=None, interrupt=None,
        dock=SimpleNamespace(reserve=lambda part, n: SimpleNamespace(indexes=list(range(n)))),
        session=SimpleNamespace(encode=lambda problem: [1, 2]), plan=SimpleNamespace(sequential=False),
        cfg=SimpleNamespace(reward=SimpleNamespace(stream="group"), rollout=SimpleNamespace(on_error="raise")),
        between_polls=lambda: handed.append(True))
    f = SimpleNamespace(part="p", stop=threading.Event(),
                        state=SimpleNamespace(cond=threading.Condition(), problems=["q"], rows={}, records=[]))
    Produce(parts, partial=partial)._generate(f, [0])
    assert waits == [PARTIAL_POLL_S if partial else 0.2] * 3 and len(handed) == 3
    assert PARTIAL_POLL_S < 0.2


@pytest.mark.slow
@pytest.mark.multiproc
def test_off_policy_with_sharded_actor_stages_weights_without_the_driver(tmp_path):
    """cluster.devices=2 (two FSDP2 actor ranks; the rollout in a process of its own): the actor's rank 0 packs each version
    into shared memory and only file handles pass through the driver, so the driver's process moves far fewer
    bytes a step than one copy of the weights; the rollout still gets new versions."""
    from relayrl.workflows.pipeline import GRPOPipeline

    GRPOPipeline(config(tmp_path, "trainer.off_policy_steps=1", "cluster.devices=2", "cluster.oversubscribe=true",
                        "trainer.steps=3")).run()
    recs = [r for r in records(tmp_path) if r["step"] > 0]
    weights = max(r.get("relay/bytes", 0) for r in recs)
    assert weights > 1e6 and [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["dock/driver_call_bytes"] < weights / 4, (r["step"], r["dock/driver_call_bytes"], weights)
    assert max(r["async/rollout_version"] for r in recs) >= 1


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("k,partial", [(1, False), (2, True)])
def test_every_trained_token_is_within_the_bound_and_the_staleness_metrics_are_its(tmp_path, monkeypatch, k, partial):
    """Per sample, as the update reads it: the weight version that sampled each token (the dock's
    ``token_versions``) against the trainer's version at that update (the optimizer steps taken before it,
    counted here). No token is staler than ``k``; batch ``j`` starts no earlier than the delayed parameter
    update lets it (weights ``>= j-1-k``: AsyncFlow's bound, reached on the first batches); and the logged
    ``async/*`` figures are the ones recomputed from those rows."""
    from relayrl.workflows.consume import Consume
    from relayrl.workflows.pipeline import GRPOPipeline

    seen: dict[int, list[list[int]]] = {}  # step -> per trained sample, the version of each of its tokens
    trainer_at: dict[int, int] = {}  # step -> the trainer's optimizer steps before its update
    updates = [0]
    items, update = Consume._items, Consume.update

    def spying_items(self, f, indexes, cols, ranks):
        if "advantages" in cols and indexes:  # an update's chunk: the rows the loss reads
            got = self.p.dock.reader(f.part, list(indexes), ["token_versions"]).read()["token_versions"]
            seen.setdefault(f.step, []).extend([int(x) for x in v.reshape(-1).tolist()] for v in got)
            trainer_at[f.step] = updates[0]
        return items(self, f, indexes, cols, ranks)

    def counting_update(self, f):
        update(self, f)
        updates[0] += 1

    monkeypatch.setattr(Consume, "_items", spying_items)
    monkeypatch.setattr(Consume, "update", counting_update)
    GRPOPipeline(config(tmp_path, f"trainer.off_policy_steps={k}", f"rollout.partial={str(partial).lower()}",
                        "trainer.steps=5")).run()
    recs = {r["step"]: r for r in records(tmp_path) if r["step"] > 0}
    assert sorted(seen) == sorted(recs) == [1, 2, 3, 4, 5]
    for j, rows in seen.items():
        assert len(rows) == 16  # every sample of the batch (4 prompts x 4), read once by the update
        v_train = trainer_at[j]
        assert v_train == j - 1  # the trainer's weights at update j: one optimizer step per earlier batch
        stale = [v_train - v for row in rows for v in row]
        assert stale and 0 <= min(stale) and max(stale) <= k, (j, sorted(set(stale)))
        assert min(v for row in rows for v in row) >= max(0, j - 1 - k)  # the delayed parameter update's bound
        r = recs[j]
        assert r["async/staleness_max"] == max(stale)
        assert r["async/staleness_mean"] == pytest.approx(sum(stale) / len(stale))
        for s in range(k + 1):
            assert r[f"async/tokens_stale_{s}"] == stale.count(s)
        assert r["async/multi_version_frac"] == pytest.approx(sum(len(set(row)) > 1 for row in rows) / len(rows))
        if not partial:
            assert r["async/multi_version_frac"] == 0
    assert max(v for rows in seen.values() for row in rows for v in row) >= 1  # new weights did reach the rollout
