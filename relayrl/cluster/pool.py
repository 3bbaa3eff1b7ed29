"""`ResourcePool`: a named set of devices that worker groups are placed on.

HybridFlow (§4) virtualises a set of GPUs as a ResourcePool:
models given the same pool are colocated on the same devices and run one after
another in call order; models on different pools run concurrently (split
placement). This module implements exactly that contract:

* A pool names `devices` per node (CPU slots or GPUs) on `nodes` nodes.
* Every call on a group takes a *turn* on its pool at call time (a ticket
  lock), so calls of colocated groups run strictly one at a time, in the order
  the driver issued them, even when issued non-blocking. Groups on different
  pools hold different turn queues and therefore overlap.
* `max_colocated` bounds how many groups share the pool; the Ray backend gives
  each rank actor `1/max_colocated` of its bundle so colocated groups fit.
* `pack` is the most devices one rank of a group on the pool owns (a vLLM engine
  with tensor parallelism): the Ray backend places the pool's devices in runs of
  `pack` on one node, so such a rank never spans two nodes.

Departures: pools are assumed disjoint (as in the paper); their sum is checked against the machine's cores
or GPUs when the config is read (local backend) and against the Ray cluster's before they are placed
(:mod:`relayrl.cluster.fit`), not for pools built by hand on the local backend; on the local backend
a CUDA pool without explicit `device_ids` takes the next free GPU indices.
"""
from __future__ import annotations

import threading
import weakref
from typing import Literal

from relayrl.cluster.errors import PlacementError

DeviceKind = Literal["cpu", "cuda"]
Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

_local_cuda_lock = threading.Lock()
# Local CUDA pools that hold GPU indices; a pool without device_ids takes the lowest indices none of the live
# ones holds (a pool that was dropped gives its GPUs back, e.g. a second run in one process).
_local_cuda_pools: "weakref.WeakSet[ResourcePool]" = weakref.WeakSet()


class _TurnQueue:
    """A FIFO ticket lock: `take()` reserves a place at call time, `wait(t)`
    blocks until that place comes up, `done(t)` hands the turn on.

    Tickets of cancelled calls are `abandon`ed so the queue never stalls.
    A thread that already holds a turn on this queue and waits for another
    would deadlock; that wait gives its ticket up and raises a RuntimeError.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._next = 0
        self._serving = 0
        self._abandoned: set[int] = set()
        self._holder: int | None = None  # thread ident holding the turn

    def take(self) -> int:
        with self._cv:
            t = self._next
            self._next += 1
            return t

    def wait(self, ticket: int) -> None:
        with self._cv:
            if self._holder == threading.get_ident():
                self._abandoned.add(ticket)  # give the place up so later calls are not stuck behind it
                raise RuntimeError(
                    f"ResourcePool {self._name!r}: a call on this pool was made while this thread already runs a call "
                    "on it (e.g. from inside a worker method); it would deadlock"
                )
            while self._serving != ticket:
                self._cv.wait()
            self._holder = threading.get_ident()

    def done(self, ticket: int) -> None:
        with self._cv:
            if self._serving != ticket:
                raise RuntimeError(f"ResourcePool {self._name!r}: turn {ticket} released out of order")
            self._holder = None
            self._advance()

    def abandon(self, ticket: int) -> None:
        with self._cv:
            if ticket == self._serving:
                self._advance()
            elif ticket > self._serving:
                self._abandoned.add(ticket)

    def _advance(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cv.notify_all()


class ResourcePool:
    """A named set of devices hosting one or more colocated worker groups.

    Args:
        name: pool name, used in messages and Ray placement-group names.
        devices: devices per node (CPU slots for `"cpu"`, GPUs for `"cuda"`), >= 1.
        device_kind: `"cpu"` or `"cuda"`.
        nodes: number of nodes (> 1 needs the Ray backend).
        max_colocated: how many groups may share this pool (Ray: each rank actor
            asks for `1/max_colocated` of its bundle).
        strategy: Ray placement strategy for the pool's bundles.
        device_ids: local backend, CUDA only: the GPU indices to use (length
            `devices`); default takes the next unused indices.
        node: Ray backend: the IP address of the node every bundle is pinned to
            (through Ray's ``node:<ip>`` resource); None lets ``strategy`` choose.
        pack: the most devices one rank of a group on this pool owns (``devices_per_rank``), a divisor of
            ``devices``. Ray backend: with ``pack`` > 1 every run of ``pack`` consecutive devices is a
            placement group of its own, STRICT_PACK (on one node); ``strategy`` then has no say.
    """

    def __init__(
        self,
        name: str,
        devices: int = 1,
        device_kind: DeviceKind = "cpu",
        nodes: int = 1,
        max_colocated: int = 4,
        strategy: Strategy = "PACK",
        device_ids: tuple[int, ...] | list[int] | None = None,
        node: str | None = None,
        pack: int = 1,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"ResourcePool name={name!r} must be a non-empty string")
        for key, val in (("devices", devices), ("nodes", nodes), ("max_colocated", max_colocated), ("pack", pack)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"ResourcePool {name!r}: {key}={val!r} must be an integer >= 1")
        if device_kind not in ("cpu", "cuda"):
            raise ValueError(f"ResourcePool {name!r}: device_kind={device_kind!r} must be 'cpu' or 'cuda'")
        if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"ResourcePool {name!r}: strategy={strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
        if devices % pack:
            raise ValueError(f"ResourcePool {name!r}: pack={pack} must divide devices={devices} (a rank's devices "
                             f"are consecutive devices of one node)")
        if device_ids is not None:
            device_ids = tuple(int(i) for i in device_ids)
            if device_kind != "cuda" or len(device_ids) != devices or len(set(device_ids)) != devices:
                raise ValueError(
                    f"ResourcePool {name!r}: device_ids={device_ids} must be {devices} distinct GPU indices of a cuda pool"
                )
        self.name = name
        self.devices = devices
        self.device_kind: DeviceKind = device_kind
        self.nodes = nodes
        self.max_colocated = max_colocated
        self.strategy: Strategy = strategy
        if node is not None and (not isinstance(node, str) or not node.strip()):
            raise ValueError(f"ResourcePool {name!r}: node={node!r} must be a node's IP address")
        self.node = node
        self.pack = pack
        self._device_ids: tuple[int, ...] | None = device_ids
        self._turns = _TurnQueue(name)
        self._state_lock = threading.Lock()
        self._groups: set[str] = set()
        self.ray_placement = None  # set by the Ray backend: a ray_backend.Placement

    @property
    def world_size(self) -> int:
        """Total devices: `devices * nodes`."""
        return self.devices * self.nodes

    def __repr__(self) -> str:
        return (f"ResourcePool(name={self.name!r}, devices={self.devices}, device_kind={self.device_kind!r}, "
                f"nodes={self.nodes}{'' if self.node is None else f', node={self.node!r}'}"
                f"{'' if self.pack == 1 else f', pack={self.pack}'})")

    # -- colocation bookkeeping ---------------------------------------------------------
    def attach(self, group: str) -> None:
        """Register a group on this pool; refuse duplicates and over-colocation."""
        with self._state_lock:
            if group in self._groups:
                raise ValueError(f"ResourcePool {self.name!r} already hosts a group named {group!r}")
            if len(self._groups) >= self.max_colocated:
                raise ValueError(
                    f"ResourcePool {self.name!r} already hosts {sorted(self._groups)}; raise max_colocated "
                    f"(now {self.max_colocated}) to colocate {group!r} too"
                )
            self._groups.add(group)

    def detach(self, group: str) -> None:
        with self._state_lock:
            self._groups.discard(group)

    @property
    def groups(self) -> tuple[str, ...]:
        """Names of the groups currently placed on this pool."""
        with self._state_lock:
            return tuple(sorted(self._groups))

    # -- local device assignment -----------------------------------------------------------
    def local_devices(self) -> list[str]:
        """Device strings of this pool's slots on the local backend (length `devices`)."""
        if self.nodes != 1:
            raise ValueError(f"ResourcePool {self.name!r} has nodes={self.nodes}: the local backend runs on one machine; use backend='ray'")
        if self.node is not None:
            raise ValueError(f"ResourcePool {self.name!r} is pinned to node {self.node!r}: the local backend runs on "
                             f"this machine only; use backend='ray'")
        if self.device_kind == "cpu":
            return ["cpu"] * self.devices
        import torch

        have = torch.cuda.device_count()
        with self._state_lock, _local_cuda_lock:
            if self._device_ids is None:
                held = {i for p in list(_local_cuda_pools) if p is not self for i in (p._device_ids or ())}
                free = [i for i in range(max(have, len(held) + self.devices)) if i not in held]
                self._device_ids = tuple(free[: self.devices])
                _local_cuda_pools.add(self)
        if max(self._device_ids) >= have:
            raise PlacementError(
                f"ResourcePool {self.name!r} needs GPUs {list(self._device_ids)} but this machine has {have}; "
                "lower cluster.devices, or set model.device=cpu"
            )
        return [f"cuda:{i}" for i in self._device_ids]
