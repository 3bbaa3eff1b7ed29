"""`WorkerGroup`: the driver's handle on N ranks of one worker class on a pool.

HybridFlow's single controller calls methods of a worker group and
the group's registered transfer protocol decides whether the call is broadcast
(ONE_TO_ALL), split over data-parallel ranks and collected (DP_COMPUTE), or
sent to one rank. Here the call kind is spelled at the call site instead:

    group.all(W.m, x)              every rank, same arguments -> [result of rank 0, 1, ...]
    group.all_rank0(W.m, x)        every rank, same arguments -> rank 0's result
    group.split(W.m, items)        contiguous chunk per rank   -> gathered in rank order
    group.split_rank0(W.m, items)  contiguous chunk per rank   -> rank 0's result
    group.one(W.m, x, rank=0)      one rank                    -> its result

The ``_rank0`` kinds are for methods every rank must join (a collective: FSDP2 gathers the full weights, an
optimizer step all-reduces) where rank 0's answer stands for all (the global metrics every rank reports, the
full weights rank 0 holds); the others' results are dropped.

where ``W.m`` is the method referenced on the group's worker class ``W`` (or a
base of it), so go-to-definition and refactoring tools follow the call and the
call site shows which class it reaches; its name, ``"m"``, is accepted too.
Only the name travels to the ranks (the function is never pickled). Each has
an `*_async` twin returning a `concurrent.futures.Future`, so the driver can
overlap groups on different pools (HybridFlow's asynchronous dataflow
execution). Every call takes a turn on its pool at call time, so
colocated groups run one call at a time in driver order.

Every call counts the payload bytes (tensors and numpy arrays, see
`relayrl.dock.payload_bytes`) of its arguments and results in
`group.bytes_by_method`, on every backend: they are the sample data the
driver handled, which should be small once the dock is the data plane.

Departures: no `@register` decorators or metaprogrammed dispatch; data is
materialised through the driver (no data futures passed worker-to-worker).
"""
from __future__ import annotations

import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from relayrl.cluster.config import ClusterConfig, as_config
from relayrl.cluster.dispatch import gather_split, split_items
from relayrl.cluster.errors import PlacementError
from relayrl.cluster.interrupt import register, say_stopped, stop_calls_in_flight
from relayrl.cluster.pool import ResourcePool
from relayrl.cluster.worker import check_worker_class, method_name
from relayrl.dock.payload import payload_bytes


def _build_ranks(cfg: ClusterConfig, worker_cls: type, pool: ResourcePool, name: str, num_ranks: int,
                 init_kwargs: dict, distributed: bool, per_rank: int):
    if cfg.backend == "ray":
        from relayrl.cluster.ray_backend import RayRanks

        return RayRanks(name, worker_cls, init_kwargs, pool, num_ranks, distributed, cfg, per_rank)
    from relayrl.cluster.local import InProcessRanks, ProcessRanks

    devices = rank_devices(pool.local_devices(), per_rank)[:num_ranks]
    if num_ranks == 1 and cfg.in_process:
        return InProcessRanks(name, worker_cls, init_kwargs, devices[0], distributed, cfg)
    return ProcessRanks(name, worker_cls, init_kwargs, devices, distributed, cfg)


def rank_devices(devices: list[str], per_rank: int) -> list[tuple[str, ...]]:
    """``devices`` (a pool's, on one node) cut into consecutive runs of ``per_rank``: rank r owns the r-th."""
    if len(devices) % per_rank:
        raise PlacementError(f"{len(devices)} devices cannot be cut into ranks of {per_rank}")
    return [tuple(devices[i:i + per_rank]) for i in range(0, len(devices), per_rank)]


def _close(ranks, executor: ThreadPoolExecutor, pool: ResourcePool, name: str) -> None:
    executor.shutdown(wait=True, cancel_futures=True)
    try:
        ranks.shutdown()
    finally:
        pool.detach(name)


class WorkerGroup:
    """N ranks of `worker_cls` placed on `pool`.

    Args:
        worker_cls: a `Worker` subclass; built on each rank with `**init_kwargs`.
        pool: the `ResourcePool` to place the ranks on.
        name: group name (unique on its pool), used in errors; default the class name.
        num_ranks: ranks to start, 1..pool.world_size / devices_per_rank; default all of them.
        backend: `"local"`, `"ray"` or a `ClusterConfig`.
        init_kwargs: keyword arguments for `worker_cls.__init__`.
        distributed: join the ranks into a torch.distributed process group
            before constructing the workers.
        devices_per_rank: devices each rank owns (consecutive devices of one node; the first is the
            rank's ``device``, all of them its ``devices``): a rank that drives several devices itself,
            e.g. a vLLM engine with tensor parallelism. The pool's devices per node must be a multiple; on Ray
            its ``pack`` too (the Ray backend places its devices in runs of ``pack`` on one node).

    Every call kind takes the method to run as its first argument, either

    * a reference to a public function defined on `worker_cls` or one of its
      bases, taken from the class: ``group.all(PolicyWorker.save_pretrained, path)``
      (a method of another class is refused, naming both classes), or
    * its name: ``group.all("save_pretrained", path)``.

    Keyword names `rank` (of `one`) and `method`/`items` cannot be passed
    through to worker methods.
    """

    def __init__(self, worker_cls: type, pool: ResourcePool, name: str | None = None, num_ranks: int | None = None,
                 backend: str | ClusterConfig = "local", init_kwargs: dict | None = None,
                 distributed: bool = True, devices_per_rank: int = 1) -> None:
        self.worker_cls = check_worker_class(worker_cls)
        if not isinstance(pool, ResourcePool):
            raise TypeError(f"pool={pool!r} must be a ResourcePool")
        self.name = name or worker_cls.__name__
        self.pool = pool
        self.config = as_config(backend)
        k = devices_per_rank
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or pool.devices % k:
            raise PlacementError(f"group {self.name!r}: devices_per_rank={k!r} must be a whole divisor of the "
                                 f"{pool.devices} devices per node of pool {pool.name!r}")
        most = pool.world_size // k
        n = most if num_ranks is None else num_ranks
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= most:
            raise ValueError(f"group {self.name!r}: num_ranks={num_ranks!r} must be between 1 and the pool's "
                             f"{pool.world_size} devices" + (f" / {k} devices per rank" if k > 1 else ""))
        self.devices_per_rank = k
        self.world_size = n
        init_kwargs = dict(init_kwargs or {})
        pool.attach(self.name)
        try:
            self._ranks = _build_ranks(self.config, worker_cls, pool, self.name, n, init_kwargs, distributed, k)
        except BaseException:
            pool.detach(self.name)
            raise
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relayrl-{self.name}")
        self._closed = False
        self._bytes: dict[str, int] = {}
        self._bytes_lock = threading.Lock()
        self._in_flight: dict[object, str] = {}  # a token per call running on the ranks -> its method
        self._waiting = 0  # calls started but not on the ranks yet (waiting for the pool's turn)
        self._interrupted = False  # `stop_calls` ran: no further call starts
        self._finalizer = weakref.finalize(self, _close, self._ranks, self._executor, pool, self.name)
        register(self)

    @property
    def backend(self) -> str:
        """`"local"` or `"ray"`."""
        return self.config.backend

    def pids(self) -> list[int]:
        """Process id of each rank (the driver's own pid for an in-process rank)."""
        return self._ranks.pids()

    def nodes(self) -> list[str]:
        """The IP address of each rank's node (Ray), or ``"local"`` for every rank of the local backend."""
        nodes = getattr(self._ranks, "nodes", None)
        return nodes() if nodes is not None else ["local"] * len(self._ranks.pids())

    @property
    def in_driver(self) -> bool:
        """True when the group's one rank runs inside the driver process (no serialization on calls)."""
        from relayrl.cluster.local import InProcessRanks

        return isinstance(self._ranks, InProcessRanks)

    @property
    def bytes_by_method(self) -> dict[str, int]:
        """Payload bytes of the arguments and results of the calls since the last `reset_bytes`, by method.

        Arguments count once per rank they go to (an `all` call's tensors
        count `world_size` times); results once per rank that returned them.
        """
        with self._bytes_lock:
            return dict(self._bytes)

    def reset_bytes(self) -> dict[str, int]:
        """Start counting afresh; returns the counts up to now."""
        with self._bytes_lock:
            counts, self._bytes = self._bytes, {}
        return counts

    def _count(self, method: str, n: int) -> None:
        with self._bytes_lock:
            self._bytes[method] = self._bytes.get(method, 0) + n

    # -- call kinds ------------------------------------------------------------------------------
    def all(self, method: Callable | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method(*args, **kwargs)` on every rank; results in rank order.

        `method`: a method of the worker class (``Worker.m``) or its name (see the class docstring)."""
        return self._run(method, *self._all_payloads(args, kwargs), list, blocking=True)

    def split(self, method: Callable | str, items: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `method(chunk, *args, **kwargs)` with rank r getting the r-th
        contiguous chunk of `items`; gather results in rank order (see
        `dispatch.gather_split`). `method`: as for `all`."""
        return self._run(method, *self._split_payloads(items, args, kwargs), gather_split, blocking=True)

    def all_rank0(self, method: Callable | str, *args: Any, **kwargs: Any) -> Any:
        """`all`, returning rank 0's result only: for a collective that every rank joins and rank 0 answers.
        `method`: as for `all`."""
        return self._run(method, *self._all_payloads(args, kwargs), _first, blocking=True)

    def split_rank0(self, method: Callable | str, items: Any, *args: Any, **kwargs: Any) -> Any:
        """`split`, returning rank 0's result only (not gathered): for a method whose every rank reports the
        same global figures. `method`: as for `all`."""
        return self._run(method, *self._split_payloads(items, args, kwargs), _first, blocking=True)

    def one(self, method: Callable | str, *args: Any, rank: int = 0, **kwargs: Any) -> Any:
        """Run `method(*args, **kwargs)` on `rank` only; return its result. `method`: as for `all`."""
        return self._run(method, *self._one_payloads(rank, args, kwargs), _first, blocking=True)

    def all_async(self, method: Callable | str, *args: Any, **kwargs: Any) -> Future:
        """Non-blocking `all`: a Future of the list of per-rank results."""
        return self._run(method, *self._all_payloads(args, kwargs), list, blocking=False)

    def split_async(self, method: Callable | str, items: Any, *args: Any, **kwargs: Any) -> Future:
        """Non-blocking `split`: a Future of the gathered result."""
        return self._run(method, *self._split_payloads(items, args, kwargs), gather_split, blocking=False)

    def all_rank0_async(self, method: Callable | str, *args: Any, **kwargs: Any) -> Future:
        """Non-blocking `all_rank0`: a Future of rank 0's result."""
        return self._run(method, *self._all_payloads(args, kwargs), _first, blocking=False)

    def split_rank0_async(self, method: Callable | str, items: Any, *args: Any, **kwargs: Any) -> Future:
        """Non-blocking `split_rank0`: a Future of rank 0's result."""
        return self._run(method, *self._split_payloads(items, args, kwargs), _first, blocking=False)

    def one_async(self, method: Callable | str, *args: Any, rank: int = 0, **kwargs: Any) -> Future:
        """Non-blocking `one`: a Future of that rank's result."""
        return self._run(method, *self._one_payloads(rank, args, kwargs), _first, blocking=False)

    # -- payloads ----------------------------------------------------------------------------------
    def _all_payloads(self, args: tuple, kwargs: dict):
        ranks = list(range(self.world_size))
        return ranks, [(args, kwargs)] * self.world_size

    def _split_payloads(self, items: Any, args: tuple, kwargs: dict):
        chunks = split_items(items, self.world_size)
        return list(range(self.world_size)), [((chunk, *args), kwargs) for chunk in chunks]

    def _one_payloads(self, rank: int, args: tuple, kwargs: dict):
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"group {self.name!r}: rank={rank!r} must be in 0..{self.world_size - 1}")
        return [rank], [(args, kwargs)]

    # -- execution ---------------------------------------------------------------------------------
    def _run(self, method: Callable | str, ranks: list[int], payloads: list, post: Callable[[list], Any],
             blocking: bool):
        if self._closed:
            raise RuntimeError(f"worker group {self.name!r} is shut down")
        method = method_name(self.worker_cls, self.name, method)  # only the name goes to the ranks
        turns = self.pool._turns
        ticket = turns.take()

        def job() -> Any:
            with self._bytes_lock:
                self._waiting += 1
            try:
                turns.wait(ticket)
            finally:
                with self._bytes_lock:
                    self._waiting -= 1
            token = object()
            try:
                sizes: dict[int, int] = {}  # an `all` call repeats one payload object: walk it once
                self._count(method, sum(sizes.setdefault(id(p), payload_bytes(p)) for p in payloads))
                with self._bytes_lock:
                    if self._interrupted:  # (queued behind a call that Ctrl-C stopped)
                        raise RuntimeError(f"worker group {self.name!r}: {method!r} did not start, the run was "
                                           f"interrupted")
                    self._in_flight[token] = method
                results = self._ranks.call(method, ranks, payloads)
                self._count(method, payload_bytes(results))
                return post(results)
            finally:
                with self._bytes_lock:
                    self._in_flight.pop(token, None)
                turns.done(ticket)

        if blocking:
            return job()
        try:
            fut = self._executor.submit(job)
        except RuntimeError:
            turns.abandon(ticket)
            raise
        fut.add_done_callback(lambda f: turns.abandon(ticket) if f.cancelled() else None)
        return fut

    # -- lifetime ----------------------------------------------------------------------------------
    def stop_calls(self) -> tuple[list[str], bool]:
        """Ctrl-C: stop the ranks of the calls in flight now, without waiting for them, and let no further
        call start (`relayrl.cluster.interrupt`): SIGTERM, ``cluster.error_grace_s`` to exit, then SIGKILL of
        each rank's process group (Ray: the actors are killed). Whoever waits for such a call gets a lost-worker
        `WorkerError`; the group is broken (shut it down). Returns the methods that were running and whether
        their ranks were stopped (False for a rank in the driver, which cannot be)."""
        with self._bytes_lock:
            if self._in_flight or self._waiting:
                self._interrupted = True  # (a group with nothing running or queued stays usable)
            methods = sorted(set(self._in_flight.values()))
        if not methods or self._closed:
            return [], False
        return methods, self._ranks.stop_now(self.config.error_grace_s)

    def shutdown(self) -> None:
        """Finish the running call, cancel queued ones, stop the ranks, free the pool slot (after Ctrl-C,
        `stop_calls` first, so that nothing is waited for)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            say_stopped(stop_calls_in_flight([self]))
        self.shutdown()

    def __repr__(self) -> str:
        return (f"WorkerGroup(name={self.name!r}, worker={self.worker_cls.__name__}, pool={self.pool.name!r}, "
                f"ranks={self.world_size}, backend={self.backend!r})")


def _first(results: list[Any]) -> Any:
    """The first of the per-rank results: `one`'s only one, rank 0's of the `_rank0` kinds."""
    return results[0]


def check_fit(cfg: ClusterConfig, pools: list[ResourcePool]) -> None:
    """Before any group is built: on Ray, refuse at once ``pools`` (every pool the run will place, once each;
    colocated roles share one) that the cluster can never place together, naming them all
    (:mod:`relayrl.cluster.fit`); each pool is measured again when it is placed. The local backend's pools are
    measured against this machine when the config is read (``relayrl.config.schema``)."""
    if cfg.backend == "ray":
        from relayrl.cluster.ray_backend import check_fit as check_ray_fit

        check_ray_fit(cfg, pools)


def make_group(cfg: ClusterConfig, worker_cls: type, pool: ResourcePool, name: str, **kwargs: Any) -> WorkerGroup:
    """Build a group on the backend `cfg` names (so workflows never fork on backend)."""
    if not isinstance(cfg, ClusterConfig):
        raise TypeError(f"cfg={cfg!r} must be a ClusterConfig")
    return WorkerGroup(worker_cls, pool, name=name, backend=cfg, **kwargs)
