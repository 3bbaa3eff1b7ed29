"""A GRPO run's step metrics recomputed from what it wrote (samples.jsonl holds every sample of the step) and
checked against their definitions in docs/metrics.md."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from grpo_runs import run_grpo


MODES = {"colocated": ([], 1), "periodic": (["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen",
                                             "trainer.mini_batches=1"], 2),
         "off-policy": (["trainer.off_policy_steps=1", "trainer.mini_batches=1"], 2)}
"""Step modes: their overrides and the devices of the actor's and the rollout's pools."""


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_step_metrics_match_the_samples_the_run_wrote(tmp_path, tiny_dir, mode):
    from relayrl.models.load import load_tokenizer

    over, devices = MODES[mode]
    recs = run_grpo(tmp_path, tiny_dir, "telemetry.samples_per_step=8", "trainer.mini_batches=2",
                    "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length", *over)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    tok = load_tokenizer(tiny_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for m in recs:
        step = [r for r in rows if r["step"] == m["step"]]
        assert len(step) == 2 * 4  # every sample of the step (data.prompts_per_step=2, rollout.n=4)
        rewards, lengths = [r["reward"] for r in step], [r["length"] for r in step]
        assert m["reward/mean"] == pytest.approx(statistics.mean(rewards), abs=1e-6)
        assert m["reward/std"] == pytest.approx(statistics.stdev(rewards), abs=1e-6)
        assert m["train/accuracy"] == pytest.approx(np.mean([r["score"] >= 1 for r in step]))
        assert m["response/length_mean"] == pytest.approx(statistics.mean(lengths))
        assert m["response/length_max"] == max(lengths)
        assert m["response/length_p50"] == pytest.approx(float(np.quantile(lengths, 0.5)))
        assert m["response/clip_ratio"] <= np.mean([n == 8 for n in lengths])  # (cut ones have all 8 tokens)
        # throughput: each response with its prompt, per device of the actor's and the rollout's pools
        tokens = sum(len(tok(r["prompt"])["input_ids"]) + r["length"] for r in step)
        assert m["perf/tokens"] == tokens
        assert m["perf/tokens_per_s_per_device"] == pytest.approx(tokens / (devices * m["perf/step_time_s"]))
        # the update's passes (two mini-batches) took every response token and each prompt at least once
        # (engine.packing=shared_prompt packs a group's responses behind one copy); it reported one
        # mini-batch's share before
        prompts = {r["prompt"] for r in step}
        # (a streamed chunk's pack may leave out each response's last token, which no position is fed to predict)
        last = 0 if mode == "colocated" else len(lengths)
        assert m["actor/forward_tokens"] >= sum(lengths) - last + sum(len(tok(p)["input_ids"]) for p in prompts)
        if mode != "colocated":  # (stages overlap; off-policy, generation ran during the step before)
            assert m["timing/update_s"] <= m["perf/step_time_s"]
            continue
        # a synchronous colocated step: its stages run one after another, within the step's time
        stages = sum(v for k, v in m.items() if k.startswith("timing/") and k != "timing/eval_s")
        assert 0.5 * m["perf/step_time_s"] <= stages <= m["perf/step_time_s"] + 1e-3
