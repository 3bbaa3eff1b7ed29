"""A GRPO run's ``advantage/*`` metrics against GRPO's advantages recomputed by hand from the run's own
``samples.jsonl`` (every response's group, reward and length); groups of equal rewards of 0.7 among them."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from e2e_cli import FAST, records, relayrl

REWARD = '''
def odd_length(prompts, responses, answers, **fields):  # half the prompts: 0.7 for every response
    return [0.7 if sum(map(ord, p)) % 2 else 0.7 * (len(r) % 2) for p, r in zip(prompts, responses)]
'''


@pytest.mark.slow
def test_grpo_run_logs_the_advantages_of_its_samples(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", "trainer.steps=2", f"run.dir={run}", "reward.verifier=user",
                f"reward.user_fn={tmp_path / 'reward.py'}:odd_length", "data.prompts_per_step=8", "rollout.n=4",
                "telemetry.samples_per_step=1000", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    saw_equal = False
    for m in records(run)[1:]:
        groups = defaultdict(list)
        for s in samples:
            if s["step"] == m["step"]:
                groups[s["group"]].append(s)
        assert sum(map(len, groups.values())) == 32
        tokens, zero = [], 0  # (advantage, response tokens) per response
        for rows in groups.values():
            rewards = [s["reward"] for s in rows]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
            equal = len(set(rewards)) == 1
            saw_equal |= equal and abs(rewards[0] - 0.7) < 1e-6
            zero += len(rows) if equal else 0
            tokens += [(0.0 if equal else (s["reward"] - mean) / (std + 1e-6), s["length"]) for s in rows]
        n = sum(w for _, w in tokens)
        want_mean = sum(a * w for a, w in tokens) / n
        want_std = math.sqrt(sum((a - want_mean) ** 2 * w for a, w in tokens) / (n - 1))
        assert m["advantage/mean"] == pytest.approx(want_mean, abs=1e-5)
        assert m["advantage/std"] == pytest.approx(want_std, rel=1e-5)
        assert m["advantage/max"] == pytest.approx(max(a for a, _ in tokens), rel=1e-5)
        assert m["advantage/min"] == pytest.approx(min(a for a, _ in tokens), rel=1e-5)
        assert m["advantage/zero_frac"] == zero / 32
    assert saw_equal  # (a group of rewards 0.7, which GRPO gave 0.056 each: not 0)
