"""Whether a run's resource pools can ever be placed on a Ray cluster together: pure functions of the pools and
the cluster's node resources, no Ray.

On Ray each pool holds one placement group (colocated groups share their pool's: :mod:`relayrl.cluster.pool`),
every bundle of it one CPU (a CUDA bundle a GPU and a CPU), for as long as a group is on the pool. Groups on
different pools therefore add up: an actor pool of 2 and a rollout pool of 2 (split placement, HybridFlow §4)
need 4 CPUs, and a 3-CPU cluster could never place the second one; Ray would wait for it forever (the driver
for ``cluster.start_timeout_s``). :func:`fit_error` finds that before anything is placed: the sum over the pools
per resource (GPUs, then CPUs), per node a pool is pinned to (``placement.nodes``) and over the whole cluster.

These are necessary conditions only, so nothing that Ray could place is refused: a cluster with room in total
may still fail to place a pool (bundles that do not pack onto its nodes), which Ray then reports after
``cluster.start_timeout_s``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from relayrl.cluster.pool import ResourcePool

__all__ = ["fit_error", "pool_key"]

_MORE_CPUS = ("give Ray more CPUs (cluster.num_cpus for a Ray the driver starts, `ray start --num-cpus` or more "
              "nodes for a cluster)")


def pool_key(pool: "ResourcePool") -> str:
    """The config key that sizes ``pool`` in a workflow: ``cluster.devices`` for ``main``, else its
    ``placement.pools`` entry."""
    if pool.name == "main":
        return "cluster.devices" + (" x cluster.nodes" if pool.nodes > 1 else "")
    return f"placement.pools.{pool.name}"


def _needs(pool: "ResourcePool", kind: str) -> int:
    """``kind`` ("CPU" or "GPU") the pool's placement holds: a CPU per bundle, a GPU per bundle of a CUDA pool."""
    if kind == "GPU":
        return pool.world_size if pool.device_kind == "cuda" else 0
    return pool.world_size


def _alone(pool: "ResourcePool", kind: str, have: float, where: str) -> str:
    """A single pool larger than ``where``."""
    if kind == "GPU":
        return (f"ResourcePool {pool.name!r} needs {pool.world_size} GPU(s) but {where} has {have:g}; set "
                f"model.device=cpu (a cuda pool comes from model.device=cuda, or auto with a GPU in the driver), "
                f"lower cluster.devices, or add GPU nodes")
    per = "CPU slot" if pool.device_kind == "cpu" else "GPU (each GPU's bundle holds a CPU too)"
    return (f"ResourcePool {pool.name!r} needs {pool.world_size} CPU(s), one per {per}, but {where} has {have:g}; "
            f"lower cluster.devices (the main pool) or that pool's placement.pools entry, or {_MORE_CPUS}")


def _together(pools: Sequence["ResourcePool"], kind: str, need: int, have: float, where: str) -> str:
    """Several pools, each small enough, larger than ``where`` together."""
    each = ", ".join(f"{p.name!r} {_needs(p, kind)} ({pool_key(p)})" for p in pools)
    keys = " or ".join(dict.fromkeys(pool_key(p) for p in pools))
    per = "" if kind == "GPU" else ", one per device's bundle (a GPU's bundle holds a CPU too)"
    more = "add GPU nodes, or set model.device=cpu" if kind == "GPU" else _MORE_CPUS
    return (f"ResourcePools {each} need {need} {kind}(s) together{per}, but {where} has {have:g}: each pool holds "
            f"its devices for the whole run (roles on one pool share them), so Ray could never place them all; "
            f"lower {keys}, put roles on one pool (e.g. placement.rollout=main colocates the rollout with the "
            f"actor), or {more}")


def _scope_error(pools: Sequence["ResourcePool"], kind: str, have: float, where: str) -> str | None:
    counted = [p for p in pools if _needs(p, kind) > 0]
    need = sum(_needs(p, kind) for p in counted)
    if need <= have:
        return None
    if len(counted) == 1:
        return _alone(counted[0], kind, have, where)
    return _together(counted, kind, need, have, where)


def _unique(pools: Iterable["ResourcePool"]) -> list["ResourcePool"]:
    """Each pool object once (colocated groups share one pool, and so one placement), in first-seen order."""
    seen: dict[int, "ResourcePool"] = {}
    for p in pools:
        seen.setdefault(id(p), p)
    return list(seen.values())


def fit_error(pools: Iterable["ResourcePool"], nodes: Sequence[Mapping[str, float]], whole: bool = True,
              kinds: tuple[str, ...] = ("GPU", "CPU")) -> str | None:
    """Why ``pools`` can never be placed on a Ray cluster of ``nodes`` together, or None when they may be.

    Args:
        pools: the pools that hold (or will hold) a placement group at once; a pool given twice counts once.
        nodes: each live node's total resources, as Ray reports them (``{"CPU": 4.0, "GPU": 1.0,
            "node:10.0.0.1": 1.0, ...}``).
        whole: False while the cluster may grow back (a lost node joining again): then only pools pinned to
            nodes present are measured, against those nodes.
        kinds: the resources to measure, in this order.

    A pool pinned (``pool.node``) to a node that is not in ``nodes`` is left out: the pin itself is refused,
    or waited for, when the pool is placed. Checked per resource (GPUs first), per pinned node, then over the
    cluster; the first shortfall is the answer.
    """
    pools = _unique(pools)
    by_node: dict[str, Mapping[str, float]] = {}
    for res in nodes:
        for key in res:
            if key.startswith("node:") and not key.startswith("node:__internal"):
                by_node[key[len("node:"):]] = res
    counted = [p for p in pools if p.node is None or p.node in by_node]
    for kind in kinds:
        for ip in dict.fromkeys(p.node for p in counted if p.node is not None):
            err = _scope_error([p for p in counted if p.node == ip], kind, by_node[ip].get(kind, 0), f"node {ip!r}")
            if err is not None:
                return err
        if whole:
            err = _scope_error(counted, kind, sum(r.get(kind, 0) for r in nodes), "the Ray cluster")
            if err is not None:
                return err
    return None
