"""Rules on how the training engine's ranks are laid out: ``engine.sequence_parallel`` against the pools its
roles run on and the model's attention, ``engine.expert_parallel`` against the ranks and LoRA.
:class:`~relayrl.config.schema.Config` applies them when a config is validated, before any worker starts; what
needs the loaded model (its head counts, its experts) the engine checks when it loads it
(:mod:`relayrl.engines.training.ulysses`, :mod:`relayrl.engines.training.expert_parallel`)."""

from __future__ import annotations

from typing import Any

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports these rules)."""

__all__ = ["check_sequence_parallel", "check_expert_parallel"]

_ENGINE_ROLES = ("reference", "critic", "teacher")
"""Roles besides the actor (pool main) that run on the training engine and so take its sequence parallelism."""


def check_sequence_parallel(cfg: Config) -> None:
    """``engine.sequence_parallel`` groups consecutive ranks of every pool running the training engine (the
    actor's main pool, and the reference's, critic's or teacher's pool when placed elsewhere); each must hold a
    multiple of it, and the model must use SDPA or FlexAttention."""
    sp = cfg.engine.sequence_parallel
    if sp == 1:
        return
    if cfg.model.attn_implementation not in ("sdpa", "flex_attention"):
        raise ValueError(f"engine.sequence_parallel={sp} runs attention through PyTorch SDPA over the packed mask "
                         f"or FlexAttention over its tiles; model.attn_implementation={cfg.model.attn_implementation}: "
                         f"set it to sdpa or flex_attention (or engine.sequence_parallel=1)")
    sizes = {"main": (cfg.cluster.devices * cfg.cluster.nodes, "cluster.devices x cluster.nodes")}
    for role in _ENGINE_ROLES:
        pool = getattr(cfg.placement, role)
        if pool != "main" and pool in cfg.placement.pools:
            sizes.setdefault(pool, (cfg.placement.pools[pool], f"placement.pools.{pool} (placement.{role})"))
    for pool, (ranks, key) in sizes.items():
        if ranks % sp:
            raise ValueError(f"engine.sequence_parallel={sp} splits each sequence over {sp} ranks of a trainer "
                             f"group, but pool {pool} has {ranks} ({key}={ranks}): make it a multiple of {sp}, "
                             f"or lower engine.sequence_parallel")


def check_expert_parallel(cfg: Config) -> None:
    """``engine.expert_parallel`` splits the experts over groups of the trainer's ranks: it needs more than one
    rank, a group size that divides them, and the experts' own tensors whole (peft's adapters on them,
    ``model.lora.target_parameters``, wrap them). The group against the model's expert count is the engine's
    check (:func:`relayrl.engines.training.expert_parallel.shard_experts`)."""
    ep = cfg.engine.expert_parallel
    if not cfg.engine.expert_parallel_on:
        return
    ranks = cfg.cluster.devices * cfg.cluster.nodes
    if ranks == 1:
        raise ValueError(f"engine.expert_parallel={str(ep).lower()} splits each layer's experts over the trainer's "
                         f"ranks, and cluster.devices x cluster.nodes = 1: train on several devices or set "
                         f"engine.expert_parallel=false")
    if ranks % cfg.engine.expert_group(ranks):
        fits = [d for d in range(2, ranks + 1) if ranks % d == 0]
        raise ValueError(f"engine.expert_parallel={ep} puts the trainer's ranks in groups of {ep}, and cluster.devices x "
                         f"cluster.nodes = {ranks} is not a multiple of it: set engine.expert_parallel to one of "
                         f"{', '.join(map(str, fits))} (or true: all {ranks} ranks in one group)")
    if cfg.model.lora.enabled and cfg.model.lora.target_parameters:
        raise ValueError("engine.expert_parallel keeps each expert whole on one rank, and "
                         "model.lora.target_parameters wraps the expert tensors in adapters: drop one of them "
                         "(LoRA on the attention, model.lora.target_modules, works with it)")
