"""A GRPO run on two actor ranks (``cluster.devices=2``: FSDP2 actor and reference) logs the step metrics and
ends at the weights of the same run on one rank, seed for seed.

What legitimately differs, and how the test keeps it out: each rollout rank samples from its own generator,
seeded ``run.seed + 7919 x rank`` (``RolloutWorker``), and takes a contiguous slice of the prompts, so a
colocated run on ``cluster.devices=2`` (two rollout ranks) draws other responses than one on
``cluster.devices=1`` (measured: ``reward/mean`` 0.531 against 0.375 at step 1) and every later figure differs.
Both runs here put the rollout on a pool of its own with one rank (``placement.pools.gen=1``,
``placement.rollout=gen``), so they sample the same responses from the same weights and only the trainer's
ranks change. Not compared: timings, memory, throughput per device, the relay's and the dock's counts (two
ranks gather and pack differently) and ``forward_tokens`` (the padding of each rank's packing).

A step of one prompt group on two ranks skipped every update (``actor/skipped_update``: the driver asked for
``trainer.mini_batches`` rows on every rank, and rank 1 held none). Two bugs this run found before: the reference's first streamed pass failed on the rank the one-group chunk left
without rows, and with ``trainer.mini_batches=2`` the ranks' rows (groups dealt out in turn) were cut into
other mini-batches than one rank's (``actor/pg_loss`` 0.0108 against 0.0121 at step 1)."""

from __future__ import annotations

import pytest
import torch

from grpo_runs import run_grpo

SPLIT = ["placement.pools.gen=1", "placement.rollout=gen", "cluster.oversubscribe=true", "run.threads=1",
         "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length", "algorithm.kl_coef=0.05",
         "algorithm.entropy_coef=0.01", "rollout.temperature=1.0", "data.prompts_per_step=4"]

MODES = {
    "sync": ["trainer.mini_batches=2", "algorithm.loss_agg=prompt-mean-token-mean"],
    "periodic": ["trainer.mode=periodic", "algorithm.loss_agg=token-mean"],  # (one group's chunk: a rank idle)
    "ppo": ["algorithm.advantage=gae", "critic.warmup_steps=0", "trainer.mini_batches=2"],  # the critic on 2 too
    "one_group": ["data.prompts_per_step=1", "trainer.mini_batches=2"],  # rank 1 is given no rows
}
"""The update on the whole batch in mini-batches, accumulated per arriving group, PPO's critic, and a step of
fewer prompt groups than ranks (its mini-batches are cut from rank 0's rows; rank 1 joins every step)."""

EQUAL = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/kl",
         "actor/clip_frac_low", "actor/clip_frac_high", "reward/mean", "reward/std", "response/length_mean",
         "response/length_max", "rollout/logprob_error", "advantage/mean")
"""The step metrics that must be equal (to float tolerance) whatever the actor's ranks."""

SKIP = ("timing/", "memory/", "perf/", "relay/", "dock/", "params/", "optimizer/", "cluster/", "trace/")


def _compared(key: str, value) -> bool:
    """Whether a step metric must be the same on one actor rank and on two (not a time, a memory or padding
    figure)."""
    return (isinstance(value, (int, float)) and not key.startswith(SKIP) and not key.endswith(("_s", "forward_tokens"))
            and "time" not in key)


def _assert_same_run(tmp_path, one: list[dict], other: list[dict], name: str, want: tuple[str, ...]) -> None:
    """The runs ``one`` and ``other`` (run dirs ``tmp_path/one`` and ``tmp_path/name``) logged the same steps, each
    step's compared metrics equal to float tolerance (``want`` among them), and ended at the same weights."""
    from safetensors.torch import load_file

    assert [r["step"] for r in one] == [r["step"] for r in other] == [1, 2]
    for a, b in zip(one, other):
        assert set(want) <= set(a), sorted(set(want) - set(a))  # (the run logs what is compared)
        differ = [(k, v, b.get(k)) for k, v in a.items() if _compared(k, v)
                  and b.get(k) != pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True)]
        assert not differ, f"step {a['step']}: {differ}"
    w1, w2 = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("one", name))
    assert set(w1) == set(w2)
    for n, t in w1.items():
        torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)  # (Adam amplifies float noise)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", MODES)
def test_two_actor_ranks_run_the_one_rank_run(tmp_path, tiny_dir, mode):
    one = run_grpo(tmp_path / "one", tiny_dir, *SPLIT, *MODES[mode], "cluster.devices=1")
    two = run_grpo(tmp_path / "two", tiny_dir, *SPLIT, *MODES[mode], "cluster.devices=2")
    for a in one:
        assert a["actor/grad_norm"] > 0 and a["actor/entropy"] > 0 and a["reward/std"] > 0
    critic = ("critic/vf_loss", "critic/grad_norm", "critic/explained_variance") if mode == "ppo" else ()
    _assert_same_run(tmp_path, one, two, "two", EQUAL + critic)


def test_groups_are_dealt_to_data_parallel_replicas_then_to_their_sp_ranks():
    """Contiguous runs of about equal groups per replica, each spread over its SP ranks, in order; dealt to the
    ranks alone, 2 groups on 2 SP groups of 2 went both to the first (the second idle)."""
    from relayrl.workflows.consume import deal_groups

    assert deal_groups(["a", "b"], 4, 2) == [["a"], [], ["b"], []]
    assert deal_groups(["a", "b"], 4, 1) == [["a"], ["b"], [], []]
    assert deal_groups(list("abcdef"), 8, 4) == [["a"], ["b"], ["c"], [], ["d"], ["e"], ["f"], []]
    assert deal_groups(list("abcde"), 4, 2) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert sum(deal_groups(list("abcdefg"), 6, 3), []) == list("abcdefg")  # in order
    with pytest.raises(ValueError, match="engine.sequence_parallel=2 must divide the trainer group's 3 ranks"):
        deal_groups(["a"], 3, 2)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_sp_groups_of_two_run_the_one_rank_run(tmp_path, tiny_dir):
    """``cluster.devices=4`` with ``engine.sequence_parallel=2`` (the actor and the reference as 2 Ulysses groups
    of 2) logs the 1-rank run's step metrics and ends at its weights. Two prompt groups over 4 ranks: each SP
    group gets one (on its first rank; the second holds no rows), and ``trainer.mini_batches=2`` cuts the
    mini-batches from both groups' rows together; before, the driver dealt both groups to SP group 0 and
    skipped every update (it asked for rows on every rank)."""
    over = [*SPLIT, "data.prompts_per_step=2", "trainer.mini_batches=2", "algorithm.loss_agg=seq-mean-token-mean"]
    one = run_grpo(tmp_path / "one", tiny_dir, *over, "cluster.devices=1")
    sp = run_grpo(tmp_path / "sp", tiny_dir, *over, "cluster.devices=4", "engine.sequence_parallel=2")
    _assert_same_run(tmp_path, one, sp, "sp", EQUAL)
