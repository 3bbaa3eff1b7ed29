"""A packed GRPO update with and without each response's last token in the input, side by side.

A response's last token predicts nothing inside its pack, so the training engine leaves it out of the input
(``PackUnit.feed_last=False``) unless routing replay or a load-balancing loss needs every token's hidden
state. This benchmark runs the same update both ways on the embedded default model, alternating A and B in
one process so that both see the same machine load, and reports the ratio of the medians. Two batch shapes:

* ``demo``: the demo's GRPO stage (8 prompts x 8 responses, prompts of ~10 tokens, answers of 2-5 tokens),
  where one token of each response is a large share of the pack;
* ``long``: 8 x 8 responses of 32-256 tokens after a 64-token prompt, where it is not.

It also times :func:`relayrl.models.packing.build_packed_batch` for each shape (the host work per
micro-batch before the forward).

Run it::

    .venv/bin/python benchmarks/packed_update.py            # ~3 min here
    .venv/bin/python benchmarks/packed_update.py --rounds 20

Last line: ``packed_update: demo Xx, long Yx faster without the last token`` (median fed / median dropped).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"demo": dict(prompt=(8, 12), response=(2, 5)), "long": dict(prompt=(64, 64), response=(32, 256))}


def make_batch(shape: str, vocab: int, groups: int = 8, n: int = 8, seed: int = 0):
    """``groups`` prompts with ``n`` responses each, lengths drawn from ``SHAPES[shape]``, random advantages."""
    from relayrl.engines.training.base import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    (p_lo, p_hi), (r_lo, r_hi) = SHAPES[shape]["prompt"], SHAPES[shape]["response"]
    prompts, responses, ids = [], [], []
    for gi in range(groups):
        p = torch.randint(1, vocab, (int(torch.randint(p_lo, p_hi + 1, (1,), generator=g)),), generator=g)
        for _ in range(n):
            lr = int(torch.randint(r_lo, r_hi + 1, (1,), generator=g))
            prompts.append(p.clone())
            responses.append(torch.randint(1, vocab, (lr,), generator=g))
            ids.append(gi)
    fields = {"advantages": [torch.randn(len(r), generator=g) for r in responses],
              "old_logprobs": [-torch.rand(len(r), generator=g) for r in responses]}
    return SequenceBatch(prompts, responses, fields, ids)


def engines(model_dir: Path):
    """Two engines on copies of the same weights: A feeds the last token, B (the default) leaves it out."""
    from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
    from relayrl.models.load import load_model

    class FeedsLast(TorchTrainingEngine):
        _feed_last = True

    model = load_model(model_dir)
    cfg = TrainEngineConfig(token_budget=8192)
    return (FeedsLast(copy.deepcopy(model), cfg, total_steps=10_000),
            TorchTrainingEngine(copy.deepcopy(model), cfg, total_steps=10_000))


def bench_update(model_dir: Path, shape: str, rounds: int) -> tuple[float, float, int, int]:
    """Median update seconds (fed, dropped) and the tokens each feeds per update."""
    from relayrl.workflows.losses import PolicyLoss

    fed, dropped = engines(model_dir)
    batch = make_batch(shape, fed.model.config.vocab_size)
    loss = PolicyLoss()
    times: dict[str, list[float]] = {"fed": [], "dropped": []}
    tokens = {}
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        for name, eng in (("fed", fed), ("dropped", dropped)) if r % 2 else (("dropped", dropped), ("fed", fed)):
            t0 = time.perf_counter()
            eng.train_step(batch, loss)
            if r:
                times[name].append(time.perf_counter() - t0)
            plan = eng._plan(batch)
            tokens[name] = sum(u.length for mb in plan for row in mb for u in row)
    return statistics.median(times["fed"]), statistics.median(times["dropped"]), tokens["fed"], tokens["dropped"]


def bench_build(model_dir: Path, shape: str, repeats: int = 200) -> float:
    """Milliseconds per :func:`build_packed_batch` of the whole batch as the default engine plans it."""
    from relayrl.models.packing import build_packed_batch

    _, eng = engines(model_dir)
    batch = make_batch(shape, eng.model.config.vocab_size)
    plan = eng._plan(batch)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for mb in plan:
            build_packed_batch(batch.prompt_ids, batch.response_ids, mb)
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="timed updates per engine and shape")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from relayrl.models.tiny import build_tiny

    model_dir = build_tiny()
    ratios = {}
    for shape in SHAPES:
        t_fed, t_drop, n_fed, n_drop = bench_update(model_dir, shape, args.rounds)
        ratios[shape] = t_fed / t_drop
        print(f"packed_update: {shape}: fed {t_fed * 1e3:.1f} ms ({n_fed} tokens), dropped {t_drop * 1e3:.1f} ms "
              f"({n_drop} tokens): {ratios[shape]:.2f}x; build_packed_batch {bench_build(model_dir, shape):.2f} ms",
              flush=True)
    print(f"packed_update: demo {ratios['demo']:.2f}x, long {ratios['long']:.2f}x faster without the last token")


if __name__ == "__main__":
    main()
