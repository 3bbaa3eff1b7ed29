"""Expert parallelism against FSDP2 alone for a mixture of experts' update, same ranks, same batch, same run.

Workload: a Qwen3-MoE-shaped model built locally with random weights (``--layers`` layers, ``--experts`` experts,
``--top-k`` per token, hidden 256, experts 128 wide: the experts hold most of the weights, as in Qwen3-30B-A3B),
saved to a temporary folder; a batch of ``--prompts`` x ``--n`` rows (prompts ~U(6, 12) tokens, responses
~U(4, ``--max-len``)), random advantages, PPO-clip loss. Two trainer groups of ``--ranks`` ranks (gloo on CPU,
NCCL on GPUs) load it: FSDP2 alone (every rank all-gathers each layer's experts in the forward and again in the
backward, and reduce-scatters their gradients) and ``engine.expert_parallel`` at each size of ``--groups``
(``e``: groups of e ranks, each rank keeping 1/e of the experts; the tokens travel by all-to-all inside a group,
and with several groups each expert shard's gradient is all-reduced over its ranks / e replicas once a step).
Their updates and log-prob passes alternate, one of each per round after a warm-up; the medians are printed with
the expert bytes a rank holds (its weights, from the shapes; and its Adam moments of every parameter, measured
with ``PolicyWorker.footprint``) and sends per update (counted from the model's shapes and the batch's tokens:
what the collectives carry, not measured on the wire).

On a CPU the ranks share its cores, so the time ratio is what the two layouts' collectives and bookkeeping cost
here, not a multi-GPU speed-up. Printed, not asserted. Last line::

    expert_parallel: update time ep/fsdp R_u, logprobs R_l; expert bytes sent per rank and update ep/fsdp B

(one such line per group size). Run it with ``.venv/bin/python benchmarks/expert_parallel.py`` (one group of 2
ranks: about 20 s on 2 cores); groups smaller than the trainer: ``--ranks 4 --groups 2,4`` (about 1 min).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.cluster.config import ClusterConfig
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.tiny import TinyModelConfig, build_tiny
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import PolicyWorker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel import make_batch, timed_round  # noqa: E402  (the data-parallel benchmark's batch and timing)


def save_model(where: Path, layers: int, experts: int, top_k: int, seed: int) -> AutoConfig:
    """The MoE model and the tiny default's tokenizer, saved under ``where``; its config."""
    tiny = build_tiny(TinyModelConfig(), verbose=False)
    vocab = AutoConfig.from_pretrained(tiny).vocab_size
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=128,
                               max_position_embeddings=512, norm_topk_prob=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(where)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny).save_pretrained(where)
    return cfg


def expert_bytes(cfg, tokens: int, ranks: int, group: int | None) -> tuple[float, float]:
    """Bytes of the experts (float32) one rank holds and sends in an update: FSDP2 (``group`` None) holds 1/ranks
    of them and sends each layer's shard to the ``ranks - 1`` others three times (two all-gathers, forward and
    backward, and the gradients' reduce-scatter). Expert parallelism in groups of ``group`` holds 1/group of them;
    each of a rank's ``tokens / ranks`` tokens' ``k`` pairs leaves with its hidden state and comes back (forward),
    and the same again for the gradients, the share bound for the group's other ranks ``(group - 1) / group`` (a
    uniform router); with ``r = ranks / group`` replicas, a ring all-reduce of the held experts' gradients sends
    ``2 (r - 1) / r`` of them."""
    experts = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    if group is None:
        return experts / ranks, 3 * experts / ranks * (ranks - 1)
    pairs = tokens / ranks * cfg.num_experts_per_tok
    sent = cfg.num_hidden_layers * 4 * pairs * cfg.hidden_size * 4 * (group - 1) / group
    replicas = ranks // group
    return experts / group, sent + experts / group * 2 * (replicas - 1) / replicas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--groups", default="", help="comma-separated engine.expert_parallel group sizes, each "
                    "dividing --ranks (default: one group of all of them, engine.expert_parallel=true)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(g) for g in args.groups.split(",") if g] or [args.ranks]
    if any(args.ranks % g or g < 2 for g in sizes):
        ap.error(f"--groups {args.groups}: each size must be >= 2 and divide --ranks {args.ranks}")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = save_model(Path(tmp), args.layers, args.experts, args.top_k, args.seed)
        batch = make_batch(args.prompts, args.n, args.max_len, cfg.vocab_size, args.seed)
        tokens = batch.num_tokens + sum(len(p) for p in batch.prompt_ids)
        print(f"workload: {args.layers} layers x {args.experts} experts ({args.top_k} per token), "
              f"{len(batch)} rows, {tokens} tokens; {args.ranks} ranks each way, median of {args.repeats}",
              flush=True)
        groups = {}
        for name, ep in (("fsdp", False), *((f"ep{g}", True if g == args.ranks else g) for g in sizes)):
            kw = dict(model_path=tmp, engine=TrainEngineConfig(expert_parallel=ep), total_steps=args.repeats + 2,
                      threads=1, seed=0)
            groups[name] = WorkerGroup(PolicyWorker, ResourcePool(name, devices=args.ranks), "actor",
                                       backend=ClusterConfig(backend="local", oversubscribe=True), init_kwargs=kw)
        loss = PolicyLoss(agg="token-mean")
        times = {(name, what): [] for name in groups for what in ("update", "logprobs")}
        try:
            for i in range(args.repeats + 1):
                for name, group in groups.items():
                    update_s, logprobs_s = timed_round(group, batch, loss, seed=i)
                    if i:  # the first round warms up
                        times[name, "update"].append(update_s)
                        times[name, "logprobs"].append(logprobs_s)
            adam = {name: max(f["optimizer/state_bytes"] for f in group.all(PolicyWorker.footprint))
                    for name, group in groups.items()}
        finally:
            for group in groups.values():
                group.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    held = {"fsdp": expert_bytes(cfg, tokens, args.ranks, None), **{f"ep{g}": expert_bytes(cfg, tokens, args.ranks, g)
                                                                     for g in sizes}}
    for name in groups:
        label = "FSDP2 alone" if name == "fsdp" else f"expert groups of {name[2:]}"
        print(f"{label:19s} update {med[name, 'update'] * 1e3:8.1f} ms | logprobs {med[name, 'logprobs'] * 1e3:8.1f} "
              f"ms | per rank: expert weights held {held[name][0] / 2**20:6.2f} MiB, Adam state (measured) "
              f"{adam[name] / 2**20:6.2f} MiB, expert bytes sent per update {held[name][1] / 2**20:7.1f} MiB")
    for g in sizes:
        ep = f"ep{g}"
        print(f"expert_parallel{'' if g == args.ranks else f'={g}'}: update time ep/fsdp "
              f"{med[ep, 'update'] / med['fsdp', 'update']:.2f}, logprobs {med[ep, 'logprobs'] / med['fsdp', 'logprobs']:.2f}; "
              f"expert bytes sent per rank and update ep/fsdp {held[ep][1] / held['fsdp'][1]:.3f}")

if __name__ == "__main__":
    main()
