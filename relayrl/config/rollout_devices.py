"""How many devices a rollout rank owns, and the rules a placement must meet for it.

A rollout rank normally drives one device. With ``rollout.engine=vllm`` and ``rollout.vllm.tensor_parallel_size``
N > 1 its vLLM engine spans N devices (one vLLM worker process per device, Megatron-style tensor parallelism:
each holds 1/N of every layer and they all-reduce inside each layer), so the rollout's pool is cut into ranks of
N consecutive devices and the rollout has ``pool devices / N`` data-parallel ranks. Colocated (the rollout on
``main``), the N devices are the trainer's: verl's hybrid engine does the same (its rollout's tensor-parallel
group is made of the trainer's GPUs), and as there the two take turns on them. These rules refuse, before
anything starts, a placement that cannot be cut so, naming the keys to change.
"""

from __future__ import annotations

from typing import Any

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports these rules)."""

__all__ = ["TP_KEY", "rollout_pool_devices", "pool_pack", "check_rollout_devices"]

TP_KEY = "rollout.vllm.tensor_parallel_size"


def rollout_pool_devices(cfg: Config) -> tuple[str, int]:
    """``(key, devices per node)`` of the pool the rollout runs on: ``cluster.devices`` for ``main``, else
    ``placement.pools.NAME`` (the pool an off-policy run adds has ``rollout.devices_per_rank`` devices: the
    plan's ``rollout`` pool)."""
    name, pools = _rollout_pool(cfg)
    if name == "main":
        return "cluster.devices", cfg.cluster.devices
    return f"placement.pools.{name}", pools[name]


def _rollout_pool(cfg: Config) -> tuple[str, dict[str, int]]:
    from relayrl.config.plan import rollout_pool

    return rollout_pool(cfg) if cfg.workflow == "grpo" else ("main", {})


def pool_pack(cfg: Config, pool: str) -> int:
    """The most devices one rank on the pool named ``pool`` owns (its ``ResourcePool.pack``): the rollout's
    ``rollout.vllm.tensor_parallel_size`` on the rollout's pool, else 1. The Ray backend places such a pool's
    devices in runs of that many on one node."""
    tp = cfg.rollout.devices_per_rank
    if tp == 1 or cfg.workflow == "rm":
        return 1
    return tp if pool == _rollout_pool(cfg)[0] else 1


def check_rollout_devices(cfg: Config) -> None:
    """Refuse a rollout whose ranks cannot own ``rollout.vllm.tensor_parallel_size`` devices each."""
    tp = cfg.rollout.devices_per_rank
    if tp == 1 or cfg.workflow == "rm":  # (workflow rm generates nothing)
        return
    key, n = rollout_pool_devices(cfg)
    if tp > n:
        raise ValueError(f"{TP_KEY}={tp}: a rollout rank's vLLM engine spans {tp} devices, more than the rollout's "
                         f"pool has ({key}={n}): set {key} >= {tp} (a multiple of {tp}), or lower {TP_KEY}")
    if n % tp:
        raise ValueError(f"{TP_KEY}={tp}: each rollout rank owns {tp} devices, and the rollout's pool ({key}={n}) "
                         f"cannot be cut into ranks of {tp}: set {key} to a multiple of {tp} (rollout ranks = "
                         f"{key} / {tp}), or {TP_KEY} to a divisor of {n}")
