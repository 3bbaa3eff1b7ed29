"""Nothing lost or repeated on resume, in every step mode (issue 35 item 2).

A run is killed in step 3 (after the checkpoint of step 2; off-policy, with later batches generated ahead and
in flight) and resumed with ``run.resume=auto``. Each prompt carries its data position (the prompt source's
count of prompts drawn before it); the test records the positions each step trained on (the steps whose
stages all returned) and checks that the steps the final model holds -- those up to the checkpoint in the first
run, and every step of the resumed one -- trained each data position exactly once, in order. With dynamic
sampling a position may be dropped instead (its group had equal rewards); then each position is trained or
dropped exactly once.

Off-policy, the batches generated ahead of the checkpoint are generated again on resume from the same data
positions (docs/step-modes.md, "Evaluation and checkpoints"); the positions themselves are neither skipped
nor repeated.
"""

from __future__ import annotations

import pytest

from killing import run_killed_in_step
from relayrl.workflows.pipeline import GRPOPipeline
from relayrl.workflows.session import PromptSource

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

STEPS, P = 4, 4
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
MODES = {
    "sync": [],
    "periodic": ["trainer.mode=periodic", *SPLIT],
    "offpolicy-k1-partial": ["trainer.off_policy_steps=1", "rollout.partial=true"],
    "offpolicy-k2": ["trainer.off_policy_steps=2"],
    "offpolicy-k1-dapo": ["trainer.off_policy_steps=1", "algorithm.dynamic_sampling=true",
                          "reward.user_fn=dataflow_rewards:half_uniform", "algorithm.max_resample_rounds=8"],
}


def config(run_dir, *over: str):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    return load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", f"trainer.steps={STEPS}", "eval.size=8", "eval.every=0", f"data.prompts_per_step={P}",
        "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
        "run.save_every=1", "run.threads=1", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256", *over])


@pytest.fixture
def record(monkeypatch):
    """``positions``: id(problem) -> (data position, problem) of every prompt drawn; ``steps``: per step whose
    stages all returned, ``(step, trained positions, dropped positions)``."""
    positions: dict[int, tuple[int, object]] = {}
    steps: list[tuple[int, list[int], list[int]]] = []
    take, run = PromptSource.take, GRPOPipeline._run

    def numbered_take(self, n):
        first = self.consumed
        out = take(self, n)
        for i, p in enumerate(out):
            positions[id(p)] = (first + i, p)
        return out

    def recorded_run(self, f, stages):
        run(self, f, stages)
        st = f.state
        pos = [positions[id(p)][0] for p in st.problems]
        steps.append((f.step, [pos[g] for g in range(len(pos)) if g not in st.dropped],
                      [pos[g] for g in sorted(st.dropped)]))

    monkeypatch.setattr(PromptSource, "take", numbered_take)
    monkeypatch.setattr(GRPOPipeline, "_run", recorded_run)
    return steps


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_run_trains_every_data_position_exactly_once_after_resume(tmp_path, monkeypatch, record, mode):
    run_killed_in_step(monkeypatch, config(tmp_path, *MODES[mode]), 3)
    first = list(record)
    record.clear()
    wf = GRPOPipeline(config(tmp_path, *MODES[mode], "run.resume=auto"))
    wf.run()
    assert wf.s.start_step == 2
    assert [s for s, _, _ in first] == [1, 2] and [s for s, _, _ in record] == [3, 4]
    kept = first[:2] + record  # the steps the final model holds
    trained = [p for _, t, _ in kept for p in t]
    dropped = [p for _, _, d in kept for p in d]
    assert len(trained) == len(set(trained)) == STEPS * P  # every step trained P positions, none twice
    assert not set(trained) & set(dropped)
    assert sorted(trained + dropped) == list(range(len(trained) + len(dropped)))  # none skipped, in order:
    assert [min(t + d) for _, t, d in kept] == sorted(min(t + d) for _, t, d in kept)
    if "dynamic_sampling" not in " ".join(MODES[mode]):
        assert not dropped and trained == list(range(STEPS * P))
