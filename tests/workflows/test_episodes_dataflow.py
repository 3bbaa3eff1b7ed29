"""Multi-turn episodes on the step: the rows a rollout writes for a group of episodes (``loss_mask``,
``env_rewards``, per-token versions) train the same in the colocated placement, the split synchronous step,
the periodic one (groups arriving in any order) and PPO's critic.

The episodes here are fixed (written by a stand-in sample stage with the rollout's own ``group_rows``), so
the three paths see the same samples; real episodes batch their turns by thread timing, which makes two
runs sample differently. The rollout side is covered end to end in ``test_episodes_e2e.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.environments.base import Episode, EpisodeEnd
from relayrl.workflows.pipeline import GRPOPipeline
from relayrl.workflows.rollout_stream import group_rows

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

P, N = 4, 4


def config(run_dir, *over: str) -> Config:
    return load_config(Config, "recipes/toolsum_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=1", "eval.every=0", "eval.size=4", f"data.prompts_per_step={P}",
        f"rollout.n={N}", "rollout.max_new_tokens=8", "env.max_tokens=32", "data.task_options.digits=3",
        "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
        "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0", "engine.optim.eps=1e-3", "run.save_every=0",
        "run.threads=1", "algorithm.dynamic_sampling=false", *over])  # (the stand-in writes every group once)


def fixed_episodes(seed: int = 0) -> list[list[Episode]]:
    """``P`` groups of ``N`` episodes: model turns and observations interleaved (some open with a reset
    text), rewards that vary within every group."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(P):
        eps = []
        for s in range(N):
            ep = Episode(p, s, [], end=EpisodeEnd.DONE, reward=float((p + s) % 2), turns=2, weight_version=0)
            for k, writer in enumerate(["env", "model", "env", "model"][int(torch.randint(0, 2, (1,), generator=g)):]):
                L = int(torch.randint(1, 5, (1,), generator=g))
                ep.token_ids += torch.randint(5, 60, (L,), generator=g).tolist()
                model = writer == "model"
                ep.logprobs += (-torch.rand(L, generator=g)).tolist() if model else [0.0] * L
                ep.loss_mask += [int(model)] * L
                ep.token_versions += [0] * L
            eps.append(ep)
        groups.append(eps)
    return groups


def fixed_step(cfg: Config, order: list[int]):
    """One step of the pipeline whose sample stage is a stand-in that writes the fixed episodes' groups (in
    ``order``) with the rollout's own ``group_rows``; its metrics and the actor's weights after it."""
    wf = GRPOPipeline(cfg)

    def write_fixed(f) -> None:
        st = f.state
        for grp in order:
            eps = fixed_episodes()[grp]
            sl = wf.dock.reserve(f.part, N)
            cols, record = group_rows(wf.s.encode(st.problems[grp]), grp,
                                      [e.completion(wf.s.tokenizer) for e in eps], eps)
            with st.cond:
                st.rows[grp] = sl.indexes
                st.records.append(record)
            wf.dock.publish(sl.write(cols))
        st.rounds = 1
        f.generated.set()

    wf.produce.sample = write_fixed
    try:
        wf.begin()
        metrics = wf.step(1)
        return metrics, {k: v.detach().clone() for k, v in wf.actor.one("named_weights")}
    finally:
        wf.shutdown()


@pytest.mark.parametrize("mode,over", [
    ("periodic", ["algorithm.loss_agg=token-mean"]),
    ("periodic", ["algorithm.loss_agg=seq-mean-token-mean"]),
    ("sync", ["algorithm.advantage=gae", "critic.optim.lr=1e-3", "algorithm.loss_agg=token-mean"]),
], ids=["periodic-token-mean", "periodic-seq-mean", "sync-ppo"])
def test_episode_rows_train_the_same_colocated_and_split(tmp_path, mode, over):
    """The same episodes: the colocated step's update and the split one's (rollout on its own pool; periodic:
    accumulated per group in a shuffled arrival order) leave the same weights; the environment's tokens
    are out of the advantages and the loss on both (the loss mask travels through the dock)."""
    order = list(range(P))
    random.Random(3).shuffle(order)
    m_colo, w_colo = fixed_step(config(tmp_path / "colo", "placement.pools={}", "placement.rollout=main", *over),
                                list(range(P)))
    m_flow, w_flow = fixed_step(config(tmp_path / "flow", "placement.pools.gen=1", "placement.rollout=gen",
                                       f"trainer.mode={mode}", "trainer.stream_groups=1", *over), order)
    assert m_flow["actor/grad_norm"] > 0
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert m_flow[k] == pytest.approx(m_colo[k], rel=1e-4, abs=1e-7), k
    for k in w_colo:
        torch.testing.assert_close(w_flow[k], w_colo[k], rtol=1e-5, atol=1e-6, msg=k)
    eps = [e for grp in fixed_episodes() for e in grp]
    assert m_flow["dock/driver_bytes"] == 0
    assert m_flow["reward/mean"] == pytest.approx(sum(e.reward for e in eps) / len(eps))
    assert m_flow["env/model_tokens_mean"] == pytest.approx(sum(sum(e.loss_mask) for e in eps) / len(eps))
    assert m_flow["env/end_done"] == 1.0 and m_flow["env/errors"] == 0


def test_group_rows_of_episodes_count_model_tokens_for_staleness():
    """A group's rows carry the episodes' loss masks, rewards and per-token versions; the staleness record
    counts only the tokens the model sampled (an observation's tokens were not sampled by any version)."""
    ep = Episode(0, 0, [1, 2], token_ids=[7, 8, 9, 10, 11], logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
                 loss_mask=[1, 1, 0, 0, 1], reward=1.0, turns=2, end=EpisodeEnd.DONE, weight_version=4,
                 token_versions=[3, 3, 4, 4, 4])

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    cols, info = group_rows([1, 2], 5, [ep.completion(Tok())], [ep])
    assert cols["loss_mask"][0].tolist() == [1, 1, 0, 0, 1] and cols["env_rewards"] == [1.0]
    assert cols["token_versions"][0].tolist() == [3, 3, 4, 4, 4] and cols["version"] == [3]
    assert info.versions == [{3: 2, 4: 1}] and info.episodes[0].model_tokens == 3
    assert info.episodes[0].env_tokens == 2 and cols["group"] == [5]


def test_a_failed_write_of_an_episode_group_reaches_the_driver(tiny_dir):
    """A group the rollout cannot write into the dock is raised by ``poll_stream`` (the driver's call), not
    lost in the rollout's writer thread, where the stages would wait for its rows forever."""
    from relayrl.config.schema import EnvConfig, RewardConfig
    from relayrl.data.tasks import make_task
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.environments.config import EpisodeSpec
    from relayrl.workflows.rollout_worker import RolloutWorker as StreamingRollout

    import numpy as np

    from relayrl.dock import Slots

    class BrokenUnits:  # the data plane behind the slots: every write fails
        def write(self, *args):
            raise OSError("storage unit gone")

    def broken(first: int) -> Slots:
        return Slots("p", 0, 4, np.arange(first, first + 2), np.zeros(2, dtype=np.int64), BrokenUnits())

    rollout = StreamingRollout(str(tiny_dir), threads=1)
    problems = [make_task("toolsum", digits=3).sample(random.Random(i)) for i in range(2)]
    prompts = [rollout.tokenizer(p.prompt)["input_ids"] for p in problems]
    spec = EpisodeSpec(EnvConfig(name="tools", max_turns=2, max_tokens=16), RewardConfig(), "toolsum", {"digits": 3})
    rollout.start_stream(prompts, SamplingParams(n=2, max_new_tokens=4, stop_strings=("</tool>",)),
                         [broken(0), broken(2)], [0, 1], episodes=spec, problems=problems)
    with pytest.raises(OSError, match="storage unit gone"):
        for _ in range(300):
            rollout.poll_stream(0.2)
