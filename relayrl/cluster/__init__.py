"""relayrl.cluster: the single controller's view of devices and workers.

Maps HybridFlow's hybrid programming model (§4) to code:

| HybridFlow                                   | here                                      |
|----------------------------------------------|-------------------------------------------|
| single controller (one driver process)       | the workflow calling `WorkerGroup`s       |
| multi-controller ParallelWorker (SPMD)       | `Worker` ranks in one torch.distributed group |
| ResourcePool; same pool = colocated          | `ResourcePool` + a per-pool FIFO turn queue |
| ONE_TO_ALL / DP_COMPUTE / one-rank protocols | `group.all` / `group.split` / `group.one`  |
| asynchronous dataflow on disjoint pools      | a driver thread per stage making blocking calls |
| Ray actors + placement groups                | `backend="ray"` (or the embedded `local`) |

The GRPO family's stages (:mod:`relayrl.workflows.flow`) each run on a thread of the driver: calls on different
pools run at once, calls on one pool take turns. A group's `*_async` calls (one executor per group) return
futures instead, for a caller without threads of its own.

Departures: the call kind is explicit at the call site (no `@register`
decorator metaprogramming); a call's arguments and results go through the
driver (no data futures between groups), so the GRPO family's samples do not
ride on calls: they travel worker -> dock -> worker (`relayrl.dock`) and the
calls carry row indexes; only the contiguous split/concat protocol is built in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl._lazy import lazy_getattr
from relayrl.cluster.config import ClusterConfig

if TYPE_CHECKING:
    from relayrl.cluster.dispatch import chunk_sizes, gather_split, split_items
    from relayrl.cluster.errors import CallTimeout, PlacementError, WorkerError
    from relayrl.cluster.group import WorkerGroup, check_fit, make_group
    from relayrl.cluster.pool import ResourcePool
    from relayrl.cluster.worker import RankInfo, Worker

# Imported when first asked for: the config (``relayrl.cluster.config``, torch-free) is read while a recipe is
# validated, before torch is imported.
_LAZY = {"chunk_sizes": "dispatch", "gather_split": "dispatch", "split_items": "dispatch",
         "CallTimeout": "errors", "PlacementError": "errors", "WorkerError": "errors",
         "WorkerGroup": "group", "make_group": "group", "check_fit": "group",
         "ResourcePool": "pool", "RankInfo": "worker", "Worker": "worker"}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "CallTimeout",
    "ClusterConfig",
    "RankInfo",
    "ResourcePool",
    "Worker",
    "PlacementError",
    "WorkerError",
    "WorkerGroup",
    "check_fit",
    "chunk_sizes",
    "gather_split",
    "make_group",
    "split_items",
]
