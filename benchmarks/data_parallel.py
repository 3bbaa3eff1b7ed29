"""One GRPO update on one rank vs data parallel over ranks (FSDP2), same batch, same run.

Workload: the default tiny model (or ``--model DIR``); a batch of ``--prompts``
x ``--n`` rows, prompts ~U(6, 12) tokens, responses ~U(4, ``--max-len``) tokens,
grouped by prompt, with random advantages; PPO-clip loss, token-mean. Each
configuration runs ``--repeats`` updates after one warm-up and reports the
median wall time of ``update`` (forward + backward + optimizer step) and of
``logprobs`` (forward only), as called by the workflow: through a worker group,
``group.split`` over the ranks.

Configurations (``--threads`` torch threads in total, shared out over ranks):
* ``1 rank``: the embedded default, the rank in the driver process;
* ``N ranks``: ``cluster.devices=N``: N spawned processes, gloo on CPU (NCCL on
  GPU), the model sharded with FSDP2.

On a CPU machine the ranks share its cores, so data parallelism can only add
its communication and padding passes; the figure shows that overhead. On a
machine with one GPU per rank the same code divides the batch's compute.
A second part streams the same update as the periodic and off-policy trainers
do: ``--chunks`` chunks of whole groups accumulated on N ranks, one optimizer
step, with ``engine.dp_sync=pass`` (FSDP2 gathers the parameters and
reduce-scatters the gradients in every pass) and ``step`` (the default: the
parameters stay gathered and the gradients are reduced once per step).
Figures are printed, not asserted. Run:
``.venv/bin/python benchmarks/data_parallel.py [--ranks 2] [--repeats 5]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import PolicyWorker


def make_batch(prompts: int, n: int, max_len: int, vocab: int, seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    p_ids, r_ids, adv, groups = [], [], [], []
    for p in range(prompts):
        prompt = torch.randint(5, vocab, (int(torch.randint(6, 13, (1,), generator=g)),), generator=g)
        for _ in range(n):
            r = torch.randint(5, vocab, (int(torch.randint(4, max_len + 1, (1,), generator=g)),), generator=g)
            p_ids.append(prompt)
            r_ids.append(r)
            adv.append(torch.randn(len(r), generator=g))
            groups.append(p)
    return SequenceBatch(p_ids, r_ids, {"advantages": adv}, groups)


def measure(ranks: int, model: str, batch: SequenceBatch, threads: int, repeats: int) -> tuple[float, float]:
    kw = dict(model_path=model, engine=TrainEngineConfig(), total_steps=repeats + 1,
              threads=max(1, threads // ranks), seed=0)
    group = WorkerGroup(PolicyWorker, ResourcePool(f"dp{ranks}", devices=ranks), "actor", backend="local",
                        init_kwargs=kw)
    loss = PolicyLoss(agg="token-mean")
    upd, lp = [], []
    try:
        for i in range(repeats + 1):
            u, p = timed_round(group, batch, loss, seed=i)
            if i:  # the first round warms up
                upd.append(u)
                lp.append(p)
    finally:
        group.shutdown()
    return statistics.median(upd), statistics.median(lp)


def timed_round(group: WorkerGroup, batch: SequenceBatch, loss: PolicyLoss, seed: int) -> tuple[float, float]:
    """Seconds of one update and of one log-prob pass of ``batch`` split over ``group``'s ranks."""
    t = time.perf_counter()
    group.split(PolicyWorker.update, batch, loss, seed=seed)
    t1 = time.perf_counter()
    group.split(PolicyWorker.logprobs, batch)
    return t1 - t, time.perf_counter() - t1


def measure_streamed(ranks: int, model: str, batch: SequenceBatch, threads: int, repeats: int, chunks: int,
                     dp_sync: str) -> float:
    """Median seconds of one streamed update: ``chunks`` accumulate calls of whole groups, then the step."""
    kw = dict(model_path=model, engine=TrainEngineConfig(dp_sync=dp_sync), total_steps=repeats + 1,
              threads=max(1, threads // ranks), seed=0)
    group = WorkerGroup(PolicyWorker, ResourcePool(f"st{ranks}", devices=ranks), "actor", backend="local",
                        init_kwargs=kw)
    loss = PolicyLoss(agg="token-mean")
    ids = sorted(set(batch.groups))
    parts = [batch.select([i for i, g in enumerate(batch.groups) if g in ids[c::chunks]]) for c in range(chunks)]
    times = []
    try:
        for i in range(repeats + 1):
            t = time.perf_counter()
            for j, part in enumerate(parts):
                group.split(PolicyWorker.accumulate, part, loss, fresh=j == 0)
            group.all(PolicyWorker.optim_step)
            if i:
                times.append(time.perf_counter() - t)
    finally:
        group.shutdown()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local model directory (default: the tiny default model)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=8, help="streamed part: accumulate calls per update (0: skip)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from relayrl.models.tiny import build_tiny

        model = str(build_tiny(verbose=False))
    from transformers import AutoConfig

    batch = make_batch(args.prompts, args.n, args.max_len, AutoConfig.from_pretrained(model).vocab_size)
    print(f"workload: {len(batch)} rows ({args.prompts} prompts x {args.n}), {batch.num_tokens} response tokens, "
          f"{args.threads} torch threads in total, median of {args.repeats}")
    results = {}
    for ranks in (1, args.ranks):
        upd, lp = measure(ranks, model, batch, args.threads, args.repeats)
        results[ranks] = (upd, lp)
        label = "1 rank (in driver)" if ranks == 1 else f"{ranks} ranks (FSDP2)"
        print(f"{label:20s} update {upd * 1e3:8.1f} ms | logprobs {lp * 1e3:8.1f} ms", flush=True)
    (u1, l1), (un, ln) = results[1], results[args.ranks]
    line = f"data_parallel: {args.ranks}-rank/1-rank time ratio update {un / u1:.2f}, logprobs {ln / l1:.2f}"
    if args.chunks:
        st = {how: measure_streamed(args.ranks, model, batch, args.threads, args.repeats, args.chunks, how)
              for how in ("pass", "step")}
        for how, t in st.items():
            print(f"{args.ranks} ranks, {args.chunks} streamed chunks, dp_sync={how:4s} update {t * 1e3:8.1f} ms",
                  flush=True)
        line += f"; streamed update dp_sync pass/step {st['pass'] / st['step']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
