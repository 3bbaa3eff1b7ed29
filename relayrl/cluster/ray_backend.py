"""The `ray` backend: ranks are Ray actors placed by a placement group per pool.

HybridFlow maps a ResourcePool onto Ray placement groups and its
workers onto Ray actors; this module does the same with the small interface
the local backend has (`call`, `pids`, `shutdown`):

* Each pool gets one placement group, one bundle per device (`{"CPU": 1}` or
  `{"GPU": 1, "CPU": 1}`), PACK by default. Colocated groups share it: every
  rank actor asks for `1/max_colocated` of its bundle, so rank r of every
  group on the pool lands on bundle r. The placement group is removed when
  the last group on the pool shuts down.
* A pool whose ranks may own several devices (`pool.pack` N > 1: a vLLM engine
  with tensor parallelism) gets one placement group per run of N bundles,
  each STRICT_PACK, so a rank's devices never span two nodes (a cluster
  without a node of N devices is refused at once). A rank of N devices is
  an actor on its first bundle (the same `1/max_colocated` share); on CUDA it
  sees the GPUs of its whole run (`CUDA_VISIBLE_DEVICES`, probed once per
  bundle when the placement is made), and the worker processes its vLLM
  engine starts live on that node, children of the actor. Ray counts the
  actor's share on the first bundle only: the run's other bundles are held by
  the placement group, and colocated one-device ranks take their shares there.
* Pools that can never be placed together are refused at once (:mod:`relayrl.cluster.fit`: their devices
  summed against the cluster's GPUs and CPUs, per pinned node and in all): the run's pools before any is
  placed (:func:`check_fit`), and each pool when it is placed, beside the pools this process holds.
* Ranks form a gloo (CPU) or NCCL (CUDA) process group; MASTER_ADDR is rank
  0's node IP and MASTER_PORT a port free there.
* Methods raise inside a host actor that returns the formatted traceback; an
  actor that dies surfaces as `RayActorError`. Both become `WorkerError`.
  Actors that do not answer a call within `cluster.call_timeout_s` (start-up:
  `start_timeout_s`) raise `CallTimeout` once every actor of the group is killed.
* Each rank actor leads a process group of its own with a reaper in it (:mod:`relayrl.cluster.reaper`):
  whatever the actor started is SIGKILLed once the actor has ended, however it ended (`ray.kill`, SIGKILL, a
  lost raylet, `ray.shutdown`), whether or not Ray's own clean-up is on.
* A local Ray this process starts (no `cluster.ray_address`) has a reaper of its own, armed before `ray.init`,
  which SIGKILLs every process of that Ray session once the driver has ended: a driver killed outright, inside
  `ray.init` or after, leaves none of them behind (Ray's agents alone ran on a minute after one).

Departure: results come back through the driver with `ray.get` (no object-ref
passing between groups yet).
"""
from __future__ import annotations

import contextlib

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.cluster.config import ClusterConfig
from relayrl.cluster.errors import PlacementError, WorkerError
from relayrl.cluster.fit import fit_error
from relayrl.cluster.pool import ResourcePool
from relayrl.cluster.reaper import SessionReaper, lead_group_with_reaper
from relayrl.cluster.rank import START_CALL, RankRuntime, Replies, Reply, StartSpec, error_reply, free_port
from relayrl.cluster.worker import RankInfo

_pg_lock = threading.Lock()
_HELD: "weakref.WeakSet[ResourcePool]" = weakref.WeakSet()
"""Pools this process placed (their placement groups held until the last group on them shuts down)."""


def ensure_ray(cfg: ClusterConfig) -> None:
    """Connect to `cfg.ray_address` (else to the cluster ``RAY_ADDRESS`` names, as a Ray job's driver has it),
    or start a local Ray, unless already connected. A local Ray started here goes with this process however it
    ends, SIGKILL included (inside ``ray.init`` too), and its reaper with it or with its ``ray.shutdown()``
    (:class:`relayrl.cluster.reaper.SessionReaper`); a cluster connected to stays (Ray ends this driver's
    actors with it)."""
    if ray.is_initialized():
        return
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or "local"  # (Ray ignores an empty RAY_ADDRESS)
    if address != "local":
        ray.init(address=address, ignore_reinit_error=True)
        return
    # "local" always starts a new Ray (ray.init's documented contract), so this driver knows it started it
    # without asking Ray's private state; None would join a `ray start` cluster of this machine if there is one.
    reaper = SessionReaper.arm()  # (before ray.init: a driver killed inside it leaves none of its Ray either)
    session = None
    try:
        session = ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False).address_info["session_dir"]
    finally:
        reaper.started(session)


class _RankHost:
    """The Ray actor hosting one rank (wrapped with `ray.remote` at placement)."""

    def __init__(self) -> None:
        self.runtime: RankRuntime | None = None
        self.reaper = lead_group_with_reaper()  # (what the rank starts goes with the actor, however it ends)

    def where(self) -> tuple[str, int, int, str]:
        """(node IP, a free port on that node, pid, node id)."""
        return ray.util.get_node_ip_address(), free_port(), os.getpid(), ray.get_runtime_context().get_node_id()

    def start(self, spec: StartSpec, env: dict[str, str]) -> Reply:
        """Set ``env`` (before anything touches CUDA: a rank of several GPUs sees them all) and start the rank."""
        os.environ.update(env)
        try:
            self.runtime = RankRuntime(spec)
        except Exception as exc:
            return error_reply(START_CALL, exc)
        return Reply(START_CALL, True)

    def call(self, call_id: int, method: str, args: tuple, kwargs: dict) -> Reply:
        return self.runtime.invoke(call_id, method, args, kwargs)

    def call_shared(self, call_id: int, method: str, payload: tuple[tuple, dict]) -> Reply:
        """`call` with (args, kwargs) given as one object (Ray resolves the shared reference)."""
        return self.runtime.invoke(call_id, method, *payload)

    def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def runs(world_size: int, pack: int) -> list[int]:
    """Bundles in each placement group of a pool of ``world_size`` devices whose ranks own up to ``pack``: one
    group of them all when ``pack`` is 1, else one of ``pack`` per run (each placed STRICT_PACK: one node)."""
    if pack < 1 or world_size % pack:
        raise PlacementError(f"{world_size} devices cannot be cut into runs of {pack}")
    return [world_size] if pack == 1 else [pack] * (world_size // pack)


@dataclass
class Placement:
    """A pool's placement on Ray (``pool.ray_placement``): its placement groups, in device order, and where
    device i's bundle landed."""

    groups: list
    """The placement groups: one of every bundle, or one per run of ``pool.pack`` bundles."""
    run: int
    """Bundles per placement group."""
    nodes: tuple[str, ...]
    """Node id of each device's bundle."""
    gpus: tuple[str, ...] | None
    """A CUDA pool with ``pack`` > 1: the GPU each device's bundle holds (its id on its node), else None."""
    refs: int = 1
    """Groups placed on it; the placement groups go when the last one shuts down."""

    def bundle(self, device: int) -> tuple[Any, int]:
        """(placement group, bundle index) of the pool's device ``device``."""
        return self.groups[device // self.run], device % self.run


def _bundle_gpus() -> list[str]:
    """Runs on one bundle: the GPU ids Ray gave it."""
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def _check_run_fits(pool: ResourcePool, resources: list[dict[str, float]]) -> None:
    """A run of ``pool.pack`` devices is placed on one node: refuse at once a cluster none of whose nodes has
    that many (``resources``: each live node's total resources)."""
    kind = "GPU" if pool.device_kind == "cuda" else "CPU"
    most = max((r.get(kind, 0) for r in resources), default=0)
    if pool.pack > most:
        raise PlacementError(
            f"ResourcePool {pool.name!r}: a rank owns {pool.pack} devices (rollout.vllm.tensor_parallel_size), which "
            f"must sit on one node, but the Ray cluster's largest node has {most:g} {kind}(s): set "
            f"rollout.vllm.tensor_parallel_size <= {most:g} (and the rollout's pool to a multiple), or add nodes "
            f"with {pool.pack} {kind}s"
        )


def _live_nodes() -> list[dict[str, float]]:
    """Each live node's total resources."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def _held_pools() -> list[ResourcePool]:
    """The pools whose placement groups this process holds in the connected cluster now (call under
    ``_pg_lock``): a pool whose groups went with an earlier Ray (shut down, started again) holds nothing."""
    held = [p for p in _HELD if p.ray_placement is not None]
    if not held:
        return []
    live = {k for k, v in placement_group_table().items() if v.get("state") != "REMOVED"}
    return [p for p in held if all(pg.id.hex() in live for pg in p.ray_placement.groups)]


def _refuse_unfit(pools: list[ResourcePool], kinds: tuple[str, ...] = ("GPU", "CPU")) -> None:
    """Refuse at once ``pools`` that, beside the pools this process already holds, the cluster can never place
    (:func:`relayrl.cluster.fit.fit_error`): Ray would wait for them forever (the driver waited
    ``cluster.start_timeout_s``). Call under ``_pg_lock``."""
    nodes = _live_nodes()
    alive = {k[len("node:"):] for r in nodes for k in r if k.startswith("node:")}
    whole = not (_LOST_IPS - alive)  # a node this process saw die may join again: then only pinned nodes
    err = fit_error([*_held_pools(), *pools], nodes, whole=whole, kinds=kinds)
    if err is not None:
        raise PlacementError(err)


def check_fit(cfg: ClusterConfig, pools: list[ResourcePool]) -> None:
    """Refuse at once a run's ``pools`` (every one that will hold a placement group) that cannot be placed
    together, before any of them is: the driver checks them all up front, so that the refusal names them all
    and comes before any model loads."""
    ensure_ray(cfg)
    with _pg_lock:
        _refuse_unfit([p for p in pools if p.ray_placement is None])


def _acquire_placement(pool: ResourcePool, cfg: ClusterConfig) -> Placement:
    with _pg_lock:
        if pool.ray_placement is not None:
            pool.ray_placement.refs += 1
            return pool.ray_placement
        bundle = {"GPU": 1, "CPU": 1} if pool.device_kind == "cuda" else {"CPU": 1}
        resources = ray.cluster_resources()
        if pool.node is not None:  # pinned: every bundle asks for a sliver of the node's own resource
            wait = cfg.start_timeout_s if pool.node in _LOST_IPS else 0.0  # a lost node may be joining again
            bundle[_node_resource(pool, resources, wait)] = 1e-3
        _refuse_unfit([pool], kinds=("GPU",))
        if pool.pack > 1:  # (before the CPUs: a rank's run on one node is the narrower limit)
            _check_run_fits(pool, _live_nodes())
        _refuse_unfit([pool], kinds=("CPU",))
        sizes = runs(pool.world_size, pool.pack)
        strategy = pool.strategy if pool.pack == 1 else "STRICT_PACK"
        groups = [placement_group([dict(bundle) for _ in range(n)], strategy=strategy,
                                  name=f"relayrl-pool-{pool.name}-{os.getpid()}" + (f"-{i}" if len(sizes) > 1 else ""))
                  for i, n in enumerate(sizes)]
        try:
            ray.get([pg.ready() for pg in groups], timeout=cfg.start_timeout_s)
            nodes = tuple(n for pg in groups
                          for _, n in sorted(placement_group_table(pg)["bundles_to_node_id"].items()))
            gpus = None
            if pool.device_kind == "cuda" and pool.pack > 1:  # each bundle's GPU, asked before any rank sits there
                probe = ray.remote(_bundle_gpus).options(num_cpus=0, num_gpus=1e-3)
                got = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=b)).remote() for pg in groups for b in range(pg.bundle_count)],
                    timeout=cfg.start_timeout_s)
                gpus = tuple(g[0] for g in got)
        except ray.exceptions.GetTimeoutError:
            for pg in groups:
                remove_placement_group(pg)
            how = strategy if len(groups) == 1 else f"{len(groups)} placement groups of {pool.pack}, each STRICT_PACK"
            raise PlacementError(
                f"ResourcePool {pool.name!r} needs {pool.world_size} bundles of {bundle} ({how}) but the Ray "
                f"cluster could not place them within {cfg.start_timeout_s} s; available: {ray.available_resources()}"
            ) from None
        except BaseException:
            for pg in groups:
                remove_placement_group(pg)
            raise
        pool.ray_placement = Placement(groups, sizes[0], nodes, gpus)
        _HELD.add(pool)
        return pool.ray_placement


def unsendable(message: str, payloads: Any = None) -> str:
    """The cause in Ray's report of an argument that does not serialize (its first failure, and the path of the
    object it blames), for one line instead of Ray's page of it; where the report names none, the error of
    pickling ``payloads`` again (only on this failure: a call pickles its arguments once)."""
    lines = [x.strip() for x in message.splitlines()]
    cause = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("!!! FAIL serialization:")), None)
    path = next((x.split("path=", 1)[1].split(",", 1)[0] for x in lines if "FailTuple(" in x and "path=" in x), None)
    if cause is None and payloads is not None:
        from ray import cloudpickle

        try:
            cloudpickle.dumps(payloads)
        except Exception as e:  # (whatever pickling raises is the cause to name)
            cause = f"{type(e).__name__}: {e}" if not isinstance(e, TypeError) else str(e)
    if cause is None:
        return lines[0] if lines else message
    return cause + (f" (at .{path})" if path else "")


def rank_devices(pool: ResourcePool, per_rank: int) -> tuple[str, tuple[str, ...]]:
    """(device, devices) of a rank owning ``per_rank`` devices of ``pool``, in its own numbering: Ray gives a
    CUDA actor its own ``CUDA_VISIBLE_DEVICES`` (:func:`rank_env` for a rank of several), so its GPUs are
    ``cuda:0``..; a CPU device is a share of the node's cores."""
    kind = "cpu" if pool.device_kind == "cpu" else "cuda"
    devices = tuple("cpu" if kind == "cpu" else f"cuda:{i}" for i in range(per_rank))
    return devices[0], devices if per_rank > 1 else ()


def rank_env(placement: Placement, rank: int, per_rank: int) -> dict[str, str]:
    """What the actor of ``rank`` sets before it starts: a rank of several GPUs sees the GPUs of its run's
    bundles, its first bundle's (the one Ray gave the actor) first; nothing otherwise (Ray's own setting)."""
    if per_rank == 1 or placement.gpus is None:
        return {}
    first = rank * per_rank
    if len(set(placement.nodes[first:first + per_rank])) != 1:  # (STRICT_PACK runs: cannot happen)
        raise PlacementError(f"rank {rank}'s {per_rank} devices are on different nodes")
    return {"CUDA_VISIBLE_DEVICES": ",".join(placement.gpus[first:first + per_rank])}


def _node_resource(pool: ResourcePool, resources: dict[str, float], wait_s: float = 0.0) -> str:
    """Ray's ``node:<ip>`` resource of the node ``pool`` is pinned to. A node the cluster lacks is waited for up
    to ``wait_s`` (a lost node joining again after a restart), then refused."""
    key = f"node:{pool.node}"
    deadline = time.monotonic() + wait_s
    if key not in resources and wait_s > 0:
        print(f"relayrl: ResourcePool {pool.name!r} is pinned to node {pool.node!r}, not in the Ray cluster now; "
              f"waiting up to {wait_s:g} s (cluster.start_timeout_s) for it to join", flush=True)
    while key not in resources and time.monotonic() < deadline:
        time.sleep(0.5)
        resources = ray.cluster_resources()
    if key not in resources:
        raise PlacementError(f"ResourcePool {pool.name!r} is pinned to node {pool.node!r} (placement.nodes), which "
                             f"is not in the Ray cluster{f' (waited {wait_s:g} s)' if wait_s else ''}; its nodes: "
                             f"{', '.join(node_ips()) or 'none'}")
    if pool.world_size > 1000:
        raise PlacementError(f"ResourcePool {pool.name!r}: a pinned pool holds at most 1000 devices")
    return key


_LOST_IPS: set[str] = set()
"""Addresses of nodes this process saw die (:func:`wait_node_dead`): a pool pinned to one waits for it to join
again when the groups are placed after a restart; a pool pinned to an unknown address is refused at once."""


def wait_node_dead(node_id: str, timeout_s: float = 90.0) -> bool:
    """Until Ray's control store reports the node ``node_id`` dead (it notices a lost node by missed health
    checks, some seconds after its actors' connections break); False if it still looks alive at the
    deadline. Scheduling before that may place new actors on the node that is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = ray.nodes()
        _LOST_IPS.update(n.get("NodeManagerAddress") for n in nodes if n["NodeID"] == node_id)
        if not any(n["NodeID"] == node_id and n.get("Alive") for n in nodes):
            return True
        time.sleep(0.5)
    return False


def node_ips() -> list[str]:
    """The IP address of every live node of the connected Ray cluster."""
    return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive"))


def _release_placement(pool: ResourcePool) -> None:
    with _pg_lock:
        placement = pool.ray_placement
        if placement is None:
            return
        placement.refs -= 1
        if placement.refs > 0:
            return
        pool.ray_placement = None
        _HELD.discard(pool)
    for pg in placement.groups:
        remove_placement_group(pg)


class RayRanks:
    """N ranks as Ray actors on the pool's placement groups; each owns ``per_rank`` consecutive devices of the
    pool (a run of bundles on one node: see :class:`Placement`)."""

    def __init__(self, group: str, worker_cls: type, init_kwargs: dict, pool: ResourcePool, num_ranks: int,
                 distributed: bool, cfg: ClusterConfig, per_rank: int = 1) -> None:
        if pool.pack % per_rank:
            raise PlacementError(f"group {group!r}: devices_per_rank={per_rank} on the Ray backend needs a pool "
                                 f"whose devices are placed in runs of a multiple of {per_rank} on one node; pool "
                                 f"{pool.name!r} has pack={pool.pack}: make it with pack={per_rank}")
        ensure_ray(cfg)
        self.group, self.cfg, self.pool = group, cfg, pool
        self.world_size = num_ranks
        self.broken: str | None = None
        self._next_id = 0
        self._killed = False
        self.actors: list = []
        self._ips: list[str] = []
        self._node_ids: list[str] = []
        self._released = True
        placement = _acquire_placement(pool, cfg)
        self._released = False
        try:
            share = 1.0 / pool.max_colocated
            host = ray.remote(_RankHost)
            for r in range(num_ranks):  # (a rank of several devices sits on its first device's bundle)
                pg, index = placement.bundle(r * per_rank)
                on_bundle = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
                opts = dict(num_cpus=share, max_restarts=0, name=None, scheduling_strategy=on_bundle)
                if pool.device_kind == "cuda":
                    opts["num_gpus"] = share
                self.actors.append(host.options(**opts).remote())
            where = self._gather([a.where.remote() for a in self.actors], "__init__", cfg.start_timeout_s,
                                 "cluster.start_timeout_s", raw=True)
            ips = [w[0] for w in where]
            self._pids, self._ips, self._node_ids = [w[2] for w in where], ips, [w[3] for w in where]
            device, owned = rank_devices(pool, per_rank)
            specs = [
                StartSpec(info=RankInfo(group, r, num_ranks, ips[:r].count(ips[r]), device, distributed, owned),
                          worker_cls=worker_cls, init_kwargs=init_kwargs, master_addr=ips[0], master_port=where[0][1],
                          timeout_s=cfg.collective_timeout_s,
                          num_threads=per_rank if per_rank > 1 and pool.device_kind == "cpu" else None)
                for r in range(num_ranks)
            ]
            envs = [rank_env(placement, r, per_rank) for r in range(num_ranks)]
            with self._sending("__init__", init_kwargs):
                refs = [a.start.remote(s, e) for a, s, e in zip(self.actors, specs, envs)]
            self._gather(refs, "__init__", cfg.start_timeout_s, "cluster.start_timeout_s")
        except BaseException:
            self.shutdown()
            raise

    def pids(self) -> list[int]:
        return list(self._pids)

    def nodes(self) -> list[str]:
        return list(self._ips)

    def call(self, method: str, ranks: list[int], payloads: list[tuple[tuple, dict]]) -> list[Any]:
        if self.broken is not None:
            raise RuntimeError(f"worker group {self.group!r} is broken ({self.broken}); shut it down and create it again")
        call_id, self._next_id = self._next_id, self._next_id + 1
        with self._sending(method, payloads):
            if len(payloads) > 1 and all(p is payloads[0] for p in payloads):
                # An `all` call: store the arguments once in the object store; every rank reads the same object.
                shared = ray.put(payloads[0])
                refs = [self.actors[r].call_shared.remote(call_id, method, shared) for r in ranks]
            else:
                refs = [self.actors[r].call.remote(call_id, method, a, k) for r, (a, k) in zip(ranks, payloads)]
        return self._gather(refs, method, self.cfg.call_timeout_s, "cluster.call_timeout_s", ranks=ranks)

    @contextlib.contextmanager
    def _sending(self, method: str, payloads: Any):
        """Ray's refusal of an argument it cannot serialize (a page of text) as one line naming the cause."""
        try:
            yield
        except TypeError as exc:
            if "serializ" not in str(exc):
                raise
            raise TypeError(f"group {self.group!r}: the arguments of {method!r} cannot be pickled for the Ray "
                            f"workers: {unsendable(str(exc), payloads)}") from None

    def _gather(self, refs: list, method: str, limit_s: float | None, key: str, ranks: list[int] | None = None,
                raw: bool = False) -> list[Any]:
        """Wait for all refs, up to ``limit_s`` (the value of ``key``); the first error or dead actor raises
        WorkerError; after an error the others get `error_grace_s`; ranks that did not answer in time raise
        `CallTimeout`, once the group's actors are killed."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        replies = Replies(self.group, method, ranks, limit_s, key, self.cfg.error_grace_s)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=replies.timeout())
            if not ready:
                break
            r = rank_of[ready[0]]
            try:
                value = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self.broken = f"rank {r} died in {method!r}"
                known = r < len(self._ips)  # (not yet during start-up)
                node = self._ips[r] if known else "an unknown node"
                raise WorkerError(self.group, r, method, f"rank actor died (node {node}): {exc}", lost=True,
                                  node_id=self._node_ids[r] if known else None) from None
            except ray.exceptions.RayError as exc:  # the host's own method failed (e.g. unpicklable argument)
                value = Reply(START_CALL, False, traceback=str(exc))
            replies.add(r, Reply(START_CALL, True, value) if raw and not isinstance(value, Reply) else value)
        try:
            return replies.outcome()
        finally:
            self.broken = replies.broken or self.broken
            if replies.timed_out:
                self._kill()

    def _kill(self) -> None:
        """Kill every actor of the group at once, hung or not (a hung rank runs no ``stop``, and the others
        share its process group); `shutdown` then only frees the placement."""
        self._killed = True
        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(a, no_restart=True)

    def stop_now(self, grace_s: float) -> bool:
        """Ctrl-C while a call runs (`WorkerGroup.stop_calls`): kill the group's actors now, not after the call
        (Ray kills at once: no grace); the call's waiter gets a lost-worker `WorkerError`. True."""
        self.broken = self.broken or "its actors were killed while a call ran (interrupted)"
        self._kill()
        return True

    def shutdown(self) -> None:
        if self._released:
            return
        self._released = True
        actors, self.actors = self.actors, []
        if not ray.is_initialized():  # Ray already went down (e.g. at interpreter exit): nothing left to free
            self.pool.ray_placement = None
            _HELD.discard(self.pool)
            return
        if actors and not self._killed:
            with contextlib.suppress(Exception):  # dead or stuck ranks are killed below
                ray.get([a.stop.remote() for a in actors], timeout=5.0)
            for a in actors:
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(a, no_restart=True)
        _release_placement(self.pool)
