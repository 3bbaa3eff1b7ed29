"""The memory model of the planner: the peak memory of one device of each pool for a workload on a placement
(trainer state, activations of one micro-batch, the rollout's weights and KV cache). The KV cache's peak comes
from the time model (:func:`relayrl.planner.simulate.generate_rank`'s rows in flight), which calls
:func:`memory_gib` for each :class:`~relayrl.planner.placement.Prediction`.
"""

from __future__ import annotations

from relayrl.planner.placement import Placement
from relayrl.planner.workload import Workload

__all__ = ["GIB", "memory_gib"]

GIB = 2**30


def memory_gib(w: Workload, p: Placement, kv_peak_tokens: float, gpu: bool = False) -> dict[str, float]:
    """Peak memory of one device per pool: trainer state (master weights, fp32 gradients, Adam's two
    moments) sharded over ``main`` ranks, activations of one micro-batch (about 18 values per hidden unit
    per token per layer, Korthikanti et al.'s count without recomputation; with gradient checkpointing each
    layer's input and one layer's 18; plus one chunk of output logits), and on the rollout's devices its weights in the compute dtype and the KV cache of its rows
    in flight. Colocated: the trainer's state plus the larger of the KV cache and the activations; with
    offload, the larger of the two phases (training: trainer state and activations; generation: the rollout's
    weights and KV cache). LoRA: the frozen base in the compute dtype, gradients and moments of the adapters.
    ``gpu`` with ``w.decode_fused``: the rollout's fused copy of its q/k/v and gate/up weights too (kept between
    phases unless offloaded); with ``w.expand_kv``: each kept layer's keys and values at the query heads' width
    (taken as the hidden size). ``w.head_stored``: the output logits of a micro-batch's every token.
    ``w.sequence_parallel``: a micro-batch's activations (and stored logits) spread over that many ranks.
    ``w.expert_parallel``: the experts' state is split over an expert group's ranks (1/e each, replicated over
    the groups), the rest over ``main``; with ``dp_sync=step`` the gathered weights and unreduced gradients leave
    out the experts.
    Not modelled: sequence parallelism's two all-to-alls per layer (time), the [L, L] mask each SP rank keeps.
    ``w.rollout_tp`` N: the rollout's weights are split over the N devices of a rank (vLLM's tensor
    parallelism); its KV cache is taken as simulated (the rows in flight of one device's rank: a rank of N
    devices keeps about N times the rows, each device 1/N of their heads)."""
    m = w.model
    state = (m.params * m.train_bytes + m.trained_params * (4 + 8)) / p.main
    group = w.experts_over(p.main)
    if group > 1:  # (expert parallelism: the experts' weights, gradients and moments over a group, not main)
        experts = m.routed * (m.train_bytes + (0 if m.trainable else 4 + 8))
        state += experts / group - experts / p.main
    if p.main > 1 and w.dp_sync == "step":  # during a step: the gathered weights and unreduced fp32 gradients
        gathered, reduced = w.fsdp_params  # (expert parallelism: the experts are neither)
        state += (gathered * m.compute_bytes + reduced * 4) * (p.main - 1) / p.main
    per_token = (m.layers + 18) if w.checkpointing else m.layers * 18  # values per hidden unit kept per token
    tokens = w.token_budget / w.sequence_parallel  # a micro-batch's tokens on one rank (Ulysses: 1/sp of them)
    acts = tokens * m.hidden * per_token * m.compute_bytes + 1024 * m.vocab * 4 * 2
    if w.head_stored:  # engine.head_grad=stored: the pass's logits kept for the backward
        acts += tokens * m.vocab * m.compute_bytes
    if gpu and w.expand_kv:  # keys and values repeated to the query heads (about hidden wide), in every kept layer
        kept = 1 if w.checkpointing else m.layers
        acts += w.token_budget * 2 * max(0, m.hidden - m.kv_dim) * kept * m.compute_bytes
    kv = kv_peak_tokens * (m.kv_layers or m.layers) * 2 * m.kv_dim * m.compute_bytes  # (a hybrid's attention layers)
    rollout_weights = m.params * m.compute_bytes / w.rollout_tp
    fused = m.fused * m.compute_bytes if gpu and w.decode_fused else 0.0
    if p.gen == 0 and w.offload:
        return {"main": max(state + acts, rollout_weights + fused + kv) / GIB}
    if p.gen == 0:
        extra = rollout_weights if m.compute_bytes != m.train_bytes or m.trainable else 0.0
        return {"main": (state + extra + fused + max(kv, acts)) / GIB}
    return {"main": (state + acts) / GIB, "gen": (rollout_weights + fused + kv) / GIB}
