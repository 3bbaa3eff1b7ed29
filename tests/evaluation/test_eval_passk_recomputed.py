"""``relayrl eval --k`` against Chen et al. 2021's unbiased pass@k recomputed from its own
``eval_samples.jsonl``: per prompt, c correct of n samples, pass@k = 1 - C(n - c, k) / C(n, k) (with
``math.comb``), for k = 1, 2, 4 and n = 5 (the powers of two below n, and n); avg@n the mean reward of the
samples."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from e2e_cli import relayrl

REWARD = '''
def odd_length(prompts, responses, answers, **fields):
    return [float(len(r) % 2) for r in responses]
'''


@pytest.mark.slow
def test_eval_pass_at_k_is_the_unbiased_estimate_of_its_samples(tiny_dir, tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(12)))
    n = 5
    r = relayrl("eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "user", "--user-fn",
                f"{tmp_path / 'reward.py'}:odd_length", "--k", str(n), "--temperature", "1.0", "--max-new-tokens",
                "6", "--out", str(tmp_path / "eval"))
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "eval.json").read_text())["metrics"]
    samples = [json.loads(x) for x in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    by_prompt = defaultdict(list)
    for s in samples:
        if s["mode"] == f"sample@{n}":
            by_prompt[s["prompt"]].append(s["reward"])
    assert len(by_prompt) == 12 and all(len(v) == n for v in by_prompt.values())
    correct = [sum(x >= 1.0 for x in v) for v in by_prompt.values()]
    assert 0 < sum(correct) < 12 * n and any(0 < c < n for c in correct)  # (a test that tells estimators apart)
    assert sorted(int(m.split("@")[1]) for m in metrics if m.startswith("eval/pass@")) == [1, 2, 4, n]
    for k in (1, 2, 4, n):
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in correct) / len(correct)
        assert metrics[f"eval/pass@{k}"] == pytest.approx(want, rel=1e-12), k
    assert metrics[f"eval/avg@{n}"] == pytest.approx(sum(map(sum, by_prompt.values())) / (12 * n), rel=1e-12)
