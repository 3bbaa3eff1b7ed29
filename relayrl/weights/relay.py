"""`WeightRelay`: trainer weights -> generation engines in a few packed buckets.

Implements NeMo RL's refit (tensor packing, per-receiver messages, minimal
metadata; "14x overall") on relayrl's engines and worker groups:

    trainer.named_weights()       (or a WeightStream: names and shapes now, values one at a time)
        -> stream_full_state      (FSDP2: one bucketed all-gather at a time; no-op otherwise)
        -> pack / pack_stream     (cached BucketLayout built without reading data, reused flat buffers;
                                   each gathered tensor copied into its slot, then dropped)
        -> in-process engines:    update_weights(unpack(buffers))        push / apply
        -> worker group ranks:    method(BucketPayload(key, version,     push_to_group / apply_to_group
                                         buffers as uint8 numpy or Ray refs,
                                         layout only on a key's first push))

and AsyncFlow's and NeMo RL's delayed parameter update: `pack` packs a version into
host buffers (pinned when CUDA is available) while generation goes on with the
old weights, `apply` loads it between generations; `pack_from_group` has a
sender group's rank 0 pack it into a shared-memory slot instead, so the bytes
skip the driver and `apply_to_group` sends only the slot's file names.

The sender streams: the layout comes from names, shapes and dtypes (a DTensor's are the full
tensor's), then each gathered bucket is packed before the next is gathered, so the sender holds the
relay's buffers and about one gathered bucket, never a gathered model (verl's ``layered_summon``).

Departures: buckets cross processes as host memory rather than CUDA IPC
handles or NCCL broadcasts: local ranks get handles to ``/dev/shm`` buckets
(`relayrl.weights.shm`, the host-memory analogue of NeMo RL's IPC handles),
or the bytes pickled over their pipe when shared memory is short; Ray actors
get one ``ray.put`` per bucket, read zero-copy by every rank on the node.
Every rank receives every bucket (generation layouts are full, not
tensor-parallel). `pack` copies synchronously (AsyncFlow writes to host
memory asynchronously while generation runs; call it from a side thread for that).
"""
from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Literal, Sequence

import torch

from relayrl.weights.gather import WeightStream, stream_full_state
from relayrl.weights.layout import DEFAULT_BUCKET_MB, BucketLayout, layout_from_signature, weights_signature
from relayrl.weights.packing import allocate_buffers, pack, pack_stream, to_wire, unpack
from relayrl.weights.receive import BucketPayload, StaleVersionError, check_receiver, check_version
from relayrl.weights.shm import ShmBuckets, shm_available

__all__ = ["WeightRelay", "PackedWeights"]


@dataclass(frozen=True)
class PackedWeights:
    """A weight version packed into host buffers, waiting to be applied (`WeightRelay.pack`)."""

    layout: BucketLayout
    """Layout of ``buffers``."""
    buffers: tuple[torch.Tensor, ...]
    """One flat host tensor per bucket (pinned when CUDA is available)."""
    version: int
    """Weight version these buffers hold."""
    ticket: int
    """Identifies the host slot in its relay (released after `WeightRelay.apply`)."""

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


def _ref(obj: Any):
    """A per-object record that does not keep ``obj`` alive when it can be weakly referenced."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return id(obj)


class WeightRelay:
    """Packs named weights into cached-layout buckets and delivers them.

    Args:
        bucket_mb: target bucket size in MiB (tensors grouped by dtype; a larger tensor gets its own bucket).
        pin_memory: pin host buffers (packed versions, worker-group pushes); default: when CUDA is available.
        transport: how buckets reach the ranks of a local multi-process group: ``"shm"`` packs
            into ``/dev/shm`` files and sends handles (`relayrl.weights.shm`), ``"pickle"`` sends
            the bytes over the pipe, ``"auto"`` uses shm when ``/dev/shm`` has room. Ray groups
            always use the object store; a one-rank in-process group gets numpy views.

    One relay serves one sender (one set of weight names); if the sender's
    names, shapes or dtypes change, the layout is rebuilt and resent.
    Threads: one thread may pack (`pack`, `pack_from_group`, `discard`) while another applies
    (`apply`, `apply_to_group`): neither waits for the other's packing or sending, only for the
    host slots' bookkeeping. Every other use is from one thread at a time.
    """

    def __init__(self, bucket_mb: float = DEFAULT_BUCKET_MB, pin_memory: bool | None = None,
                 transport: Literal["auto", "shm", "pickle"] = "auto") -> None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of MiB (e.g. 256)")
        if transport not in ("auto", "shm", "pickle"):
            raise ValueError(f"transport={transport!r} must be 'auto', 'shm' or 'pickle'")
        self.transport = transport
        self._shm: ShmBuckets | None = None
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._layout: BucketLayout | None = None
        self._buffers: dict[tuple[str, torch.device], list[torch.Tensor]] = {}
        self._checked: dict[Any, str] = {}  # receiver ref -> layout key whose shapes it passed
        self._group_keys: dict[Any, set[str]] = {}  # group ref -> layout keys its ranks hold
        self._group_version: dict[Any, int] = {}
        self._sender_sigs: dict[Any, Any] = {}  # sender group ref -> signature of its weights (push_from_group)
        self._free_host: list[list[torch.Tensor]] = []
        self._free_shm: list[ShmBuckets] = []  # shared-memory host slots (pack_from_group)
        self._live: dict[int, list[torch.Tensor] | ShmBuckets] = {}  # ticket -> a packed version's buffers
        self._tickets = itertools.count()
        self._warned_shm = False  # said once that /dev/shm has no room (_shm_room)
        self._mu = threading.RLock()  # the layout and the host slots (_free_*, _live), shared by two threads

    # -- layout and buffers --------------------------------------------------------------------
    def layout_for(self, named_weights: Sequence[tuple[str, torch.Tensor]]) -> BucketLayout:
        """The cached layout, rebuilt only when names, shapes or dtypes change."""
        return self._layout_of(weights_signature(named_weights))

    def _layout_of(self, sig) -> BucketLayout:
        with self._mu:
            if self._layout is None or self._layout.signature != sig:
                self._layout = layout_from_signature(sig, self.bucket_bytes)
                self._buffers.clear()
                self._free_host.clear()
                for shm in self._free_shm:
                    shm.close()
                self._free_shm.clear()
            return self._layout

    def buffers(self, layout: BucketLayout, device: str | torch.device) -> list[torch.Tensor]:
        """The relay's reusable pack buffers for ``layout`` on ``device`` (allocated on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        bufs = self._buffers.get((layout.key, device))
        if bufs is None:
            bufs = allocate_buffers(layout, device, pin_memory=self.pin_memory and device.type == "cpu")
            self._buffers[(layout.key, device)] = bufs
        return bufs

    def _prepare(self, named_weights: Iterable[tuple[str, torch.Tensor]] | WeightStream
                 ) -> tuple[WeightStream, BucketLayout]:
        """The weights as a stream (DTensors gathered one bucket at a time as it is read) and their layout,
        built from names, shapes and dtypes without reading any data."""
        if isinstance(named_weights, WeightStream):
            return named_weights, self.layout_for(named_weights.held)
        held = list(named_weights)
        layout = self.layout_for(held)  # (checks every entry is a named tensor)
        if not any(_is_dtensor(t) for _, t in held):
            return WeightStream(held), layout  # (full already: `_pack` packs the list itself)
        return WeightStream(held, stream_full_state(held)), layout

    @staticmethod
    def _pack(weights: WeightStream, layout: BucketLayout, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Fill ``out`` from ``weights``: each tensor is copied into its slot as the stream yields it, so the
        sender holds the buffers and one gathered bucket, never a gathered model (full tensors in a list:
        `pack`, one ``torch.cat`` per bucket)."""
        if weights.values is None:
            return pack(weights.held, layout, out=out)
        return pack_stream(weights.values, layout, out=out)

    # -- in-process receivers -------------------------------------------------------------------
    def _check_receivers(self, receivers: Sequence[Any], layout: BucketLayout, version: int) -> None:
        if isinstance(receivers, (str, bytes)) or not isinstance(receivers, Sequence):
            raise TypeError("receivers must be a list of engines with update_weights(named_tensors, version)")
        for i, r in enumerate(receivers):
            if not callable(getattr(r, "update_weights", None)):
                raise TypeError(f"receivers[{i}] ({type(r).__name__}) has no update_weights(named_tensors, version)")
            check_version(r, version, who=f"receivers[{i}]")
            ref = _ref(r)
            if self._checked.get(ref) != layout.key:
                check_receiver(r, layout, who=f"receivers[{i}]")
                self._checked[ref] = layout.key

    def _deliver(self, buffers: list[torch.Tensor], layout: BucketLayout, receivers: Sequence[Any],
                 version: int) -> None:
        for r in receivers:
            dev = getattr(r, "device", None)
            bufs = buffers
            if dev is not None and buffers and buffers[0].device != torch.device(dev):
                bufs = self.buffers(layout, dev)  # one copy per bucket to the receiver's device
                for dst, src in zip(bufs, buffers):
                    dst.copy_(src, non_blocking=True)
            r.update_weights(unpack(bufs, layout), version)

    @torch.no_grad()
    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]] | WeightStream, receivers: Sequence[Any],
             version: int) -> dict[str, float]:
        """Pack ``named_weights`` once and load them into every in-process receiver.

        Every receiver is checked (version not lower than its own, names and
        shapes equal to the layout) before any weight is copied.
        Returns ``relay/bytes`` (packed bytes), ``relay/buckets``, ``relay/tensors``,
        ``relay/receivers``, ``relay/pack_s``, ``relay/time_s`` (whole push).
        """
        t0 = time.perf_counter()
        named, layout = self._prepare(named_weights)
        self._check_receivers(receivers, layout, version)
        device = named.held[0][1].device if named.held else torch.device("cpu")
        t1 = time.perf_counter()
        buffers = self._pack(named, layout, self.buffers(layout, device))
        t2 = time.perf_counter()
        self._deliver(buffers, layout, receivers, version)
        return self._metrics(layout, len(receivers), t2 - t1, time.perf_counter() - t0)

    # -- worker groups --------------------------------------------------------------------------
    def push_to_group(self, named_weights: Iterable[tuple[str, torch.Tensor]] | WeightStream, group: Any,
                      method: Callable | str = "receive_weights", *, version: int) -> dict[str, float]:
        """Pack into host buffers and call ``group.all(method, BucketPayload)`` once per rank.

        Each rank's ``method`` (a method of the group's worker class, e.g.
        `WeightReceiverMixin.receive_weights`, or its name) must return what
        `receive_buckets` returns. The layout travels only on
        a key's first push to the group, or to a rank that answers
        ``need_layout`` (e.g. a restarted rank). Returns the `push` metrics plus
        ``relay/layout_sent`` (ranks that got the layout this time).
        """
        t0 = time.perf_counter()
        _check_group(group)
        named, layout = self._prepare(named_weights)
        kind = self._transport_for(group, layout)
        t1 = time.perf_counter()
        target = self._shm_for(layout).tensors if kind == "shm" else self.buffers(layout, "cpu")
        buffers = self._pack(named, layout, target)
        pack_s = time.perf_counter() - t1
        return self._send_group(self._wire(kind, buffers), layout, group, method, version, pack_s, t0)

    def push_from_group(self, sender: Any, sender_method: Callable | str, group: Any,
                        method: Callable | str = "receive_weights", *, version: int) -> dict[str, float] | None:
        """Relay from a multi-process local group to another without the weights passing through the driver:
        every rank of ``sender`` runs ``sender_method(handles, key, bucket_bytes)`` (a collective: FSDP2's
        ranks gather the full tensors), whose rank 0 packs them straight into this relay's shared-memory
        buckets and returns what :func:`relayrl.weights.shm.pack_into_shared` returns; then only the handles
        go to ``group``, as in :meth:`push_to_group`. The first call (or one after the weights' signature
        changed) learns the layout from the sender and asks again. Returns the `push_to_group` metrics, or
        None where host memory cannot be shared (Ray, an in-process group, ``transport='pickle'``, no room in
        ``/dev/shm``): use :meth:`push_to_group` then."""
        t0 = time.perf_counter()
        _check_group(group)
        if not _local_processes(group):
            return None

        def buckets(layout: BucketLayout) -> ShmBuckets | None:
            if self._shm is not None and self._shm.layout.key == layout.key or self._shm_room(layout.nbytes):
                return self._shm_for(layout)
            return None

        packed = self._pack_in_sender(sender, sender_method, buckets)
        if packed is None:
            return None
        shm, pack_s = packed
        return self._send_group(shm.handles, shm.layout, group, method, version, pack_s, t0)

    def _pack_in_sender(self, sender: Any, sender_method: Callable | str, buckets) -> tuple[ShmBuckets, float] | None:
        """Have ``sender``'s rank 0 pack its weights into ``buckets(layout)`` (shared-memory buckets, or None
        when there is no room: then None), learning the layout from the sender first where it is unknown or
        changed. Returns the buckets written and the sender's pack seconds, or None where host memory cannot
        be shared with ``sender``."""
        _check_group(sender)
        if not _local_processes(sender) or self.transport == "pickle":
            return None
        sref = _ref(sender)
        for _ in range(2):
            sig = self._sender_sigs.get(sref)
            layout = None if sig is None else self._layout_of(sig)
            shm = None if layout is None else buckets(layout)
            if layout is not None and shm is None:
                return None
            # every rank joins (a collective: FSDP2 gathers the full tensors); rank 0 packs and answers
            res = sender.all_rank0(sender_method, None if shm is None else shm.handles,
                                   None if layout is None else layout.key, self.bucket_bytes)
            if not isinstance(res, dict) or res.get("status") not in ("ok", "layout"):
                raise TypeError(f"{_name(sender_method)!r} on rank 0 returned {res!r}; it must return what "
                                "relayrl.weights.shm.pack_into_shared returns")
            if res["status"] == "ok":
                return shm, float(res["pack_s"])
            self._sender_sigs[sref] = res["signature"]
        raise RuntimeError(f"{_name(sender_method)!r} asked for a new layout twice in a row: the sender's weights "
                           "changed their names, shapes or dtypes between two calls")

    def _transport_for(self, group: Any, layout: BucketLayout) -> str:
        if getattr(group, "backend", "local") == "ray":
            return "ray"
        if self.transport == "pickle" or getattr(group, "in_driver", getattr(group, "world_size", 1) == 1):
            return "pickle"  # one in-process rank: numpy views, nothing is pickled
        if self._shm is not None and self._shm.layout.key == layout.key:
            return "shm"
        if self.transport == "shm" and not shm_available(layout.nbytes):
            raise RuntimeError(f"transport='shm': /dev/shm is missing or has less than {layout.nbytes} bytes free; "
                               "use transport='auto' or 'pickle'")
        return "shm" if self.transport == "shm" or self._shm_room(layout.nbytes) else "pickle"

    def _shm_room(self, nbytes: int) -> bool:
        """Whether ``/dev/shm`` has room for ``nbytes`` more; the first time it has not, say so (the weights
        then pass through the driver, a copy more per relay)."""
        if shm_available(nbytes):
            return True
        if not self._warned_shm:
            self._warned_shm = True
            warnings.warn(f"relayrl: /dev/shm is missing or has less than {nbytes / 2**20:.0f} MiB free for the "
                          "weight relay's buckets; the weights pass through the driver's process instead (a "
                          "copy more per relay). Give /dev/shm more room (docker run --shm-size) to avoid it.",
                          RuntimeWarning, stacklevel=3)
        return False

    def _shm_for(self, layout: BucketLayout) -> ShmBuckets:
        if self._shm is None or self._shm.layout.key != layout.key:
            if self._shm is not None:
                self._shm.close()
            self._shm = ShmBuckets(layout)
        return self._shm

    def _wire(self, kind: str, buffers: Sequence[torch.Tensor]) -> tuple:
        if kind == "shm":
            return self._shm.handles
        wire = tuple(to_wire(b) for b in buffers)
        if kind == "ray":
            import ray

            wire = tuple(ray.put(a) for a in wire)  # one copy into the object store, read zero-copy by each rank
        return wire

    def close(self) -> None:
        """Free shared-memory buckets, host slots included (also done when the relay is garbage-collected)."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        with self._mu:
            for shm in [*self._free_shm, *(b for b in self._live.values() if isinstance(b, ShmBuckets))]:
                shm.close()
            self._free_shm.clear()

    def _send_group(self, wire: tuple, layout: BucketLayout, group: Any, method: Callable | str,
                    version: int, pack_s: float, t0: float) -> dict[str, float]:
        gref = _ref(group)
        last = self._group_version.get(gref)
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version={version!r} must be an int")
        if last is not None and version < last:
            raise StaleVersionError(f"group {getattr(group, 'name', group)!r} holds weight version {last}; "
                                    f"refusing to go back to version {version}")
        sent = self._group_keys.setdefault(gref, set())
        first = layout.key not in sent
        payload = BucketPayload(layout.key, version, wire, layout if first else None)
        results = group.all(method, payload)
        need = [r for r, res in enumerate(results) if _status(res, method, r) == "need_layout"]
        for r in need:
            res = group.one(method, replace(payload, layout=layout), rank=r)
            if _status(res, method, r) != "ok":
                raise RuntimeError(f"rank {r} did not load weights version {version} even with the layout: {res!r}")
        sent.add(layout.key)
        self._group_version[gref] = version
        m = self._metrics(layout, len(results), pack_s, time.perf_counter() - t0)
        m["relay/layout_sent"] = float(len(results) if first else len(need))
        return m

    # -- delayed parameter update ----------------------------------------------------------------
    def pack(self, named_weights: Iterable[tuple[str, torch.Tensor]] | WeightStream, version: int) -> PackedWeights:
        """Pack a version into host buffers to load later with `apply` / `apply_to_group`.

        Host buffers are reused from packed versions already applied; a
        version packed but not yet applied keeps its own buffers.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version={version!r} must be an int")
        named, layout = self._prepare(named_weights)
        with self._mu:
            bufs = self._free_host.pop() if self._free_host else None
        if bufs is None:
            bufs = allocate_buffers(layout, "cpu", self.pin_memory)
        self._pack(named, layout, bufs)  # no lock held: an apply may run meanwhile
        return self._register(bufs, layout, version)

    def _register(self, bufs: list[torch.Tensor] | ShmBuckets, layout: BucketLayout, version: int) -> PackedWeights:
        with self._mu:
            ticket = next(self._tickets)
            self._live[ticket] = bufs
        return PackedWeights(layout, tuple(bufs.tensors if isinstance(bufs, ShmBuckets) else bufs), version, ticket)

    def pack_from_group(self, sender: Any, sender_method: Callable | str, version: int) -> PackedWeights | None:
        """`pack` from a multi-process local group without the weights passing through the driver: the
        sender's rank 0 packs them straight into a shared-memory host slot (as in `push_from_group`), and
        `apply_to_group` later hands the slot's files to the receiving ranks without another copy. Returns
        None where host memory cannot be shared (Ray, an in-process sender, ``transport='pickle'``, no room
        in ``/dev/shm``): use `pack` then."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version={version!r} must be an int")

        taken: list[ShmBuckets] = []  # slots reserved for this pack (a second one if the layout changes)

        def slot(layout: BucketLayout) -> ShmBuckets | None:
            with self._mu:
                shm = next((s for s in self._free_shm if s.layout.key == layout.key), None)
                if shm is not None:
                    self._free_shm.remove(shm)
            if shm is None and self._shm_room(layout.nbytes):
                shm = ShmBuckets(layout)
            if shm is not None:
                taken.append(shm)
            return shm

        packed = None
        try:  # the sender packs with no lock held: an apply may run meanwhile
            packed = self._pack_in_sender(sender, sender_method, slot)
        finally:
            for shm in taken:
                if packed is None or shm is not packed[0]:
                    self._give_back(shm, shm.layout)
        return None if packed is None else self._register(packed[0], packed[0].layout, version)

    def _take(self, packed: PackedWeights) -> list[torch.Tensor] | ShmBuckets:
        """The buffers of ``packed``, checked to be live."""
        if not isinstance(packed, PackedWeights):
            raise TypeError(f"packed must be a PackedWeights from WeightRelay.pack, got {type(packed).__name__}")
        with self._mu:
            bufs = self._live.get(packed.ticket)
        if bufs is None:
            raise RuntimeError(f"packed weights version {packed.version} were already applied and released "
                               "(or come from another relay); pack them again")
        return bufs

    def discard(self, packed: PackedWeights) -> None:
        """Drop packed weights that will not be applied (a newer version replaced them); their host buffers
        serve the next `pack`."""
        self._take(packed)
        self._release(packed)

    def _release(self, packed: PackedWeights) -> None:
        with self._mu:
            self._give_back(self._live.pop(packed.ticket), packed.layout)

    def _give_back(self, bufs: list[torch.Tensor] | ShmBuckets, layout: BucketLayout) -> None:
        """A host slot of ``layout`` that no version holds: kept for the next pack while ``layout`` is
        current, else freed."""
        with self._mu:
            current = self._layout is not None and layout.key == self._layout.key
            if isinstance(bufs, ShmBuckets) and not current:
                bufs.close()
            elif isinstance(bufs, ShmBuckets):
                self._free_shm.append(bufs)
            elif current:
                self._free_host.append(bufs)

    @torch.no_grad()
    def apply(self, packed: PackedWeights, receivers: Sequence[Any], release: bool = True) -> dict[str, float]:
        """Load packed weights into in-process receivers (host -> device one copy per bucket).

        ``release=False`` keeps the packed buffers valid for another `apply`.
        """
        t0 = time.perf_counter()
        self._take(packed)
        self._check_receivers(receivers, packed.layout, packed.version)
        self._deliver(list(packed.buffers), packed.layout, receivers, packed.version)
        if release:
            self._release(packed)
        return self._metrics(packed.layout, len(receivers), 0.0, time.perf_counter() - t0)

    def apply_to_group(self, packed: PackedWeights, group: Any, method: Callable | str = "receive_weights",
                       release: bool = True) -> dict[str, float]:
        """`push_to_group` of packed buffers (nothing is packed again)."""
        t0 = time.perf_counter()
        slot = self._take(packed)
        _check_group(group)
        kind = self._transport_for(group, packed.layout)
        if kind == "shm" and isinstance(slot, ShmBuckets):  # packed in shared memory: send its files as they are
            wire = slot.handles
        elif kind == "shm":
            for dst, src in zip(self._shm_for(packed.layout).tensors, packed.buffers):
                dst.copy_(src)
            wire = self._shm.handles
        else:
            wire = self._wire(kind, list(packed.buffers))
        m = self._send_group(wire, packed.layout, group, method, packed.version, 0.0, t0)
        if release:
            self._release(packed)
        return m

    # -- metrics --------------------------------------------------------------------------------
    @staticmethod
    def _metrics(layout: BucketLayout, receivers: int, pack_s: float, total_s: float) -> dict[str, float]:
        return {"relay/bytes": float(layout.nbytes), "relay/buckets": float(len(layout.buckets)),
                "relay/tensors": float(layout.num_tensors), "relay/receivers": float(receivers),
                "relay/pack_s": pack_s, "relay/time_s": total_s}


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_processes(group: Any) -> bool:
    """Whether ``group`` runs in local processes of its own (it can map the driver's shared memory)."""
    return getattr(group, "backend", "local") == "local" and not getattr(group, "in_driver", True)


def _check_group(group: Any) -> None:
    if not callable(getattr(group, "all", None)) or not callable(getattr(group, "one", None)):
        raise TypeError(f"group must be a relayrl.cluster.WorkerGroup, got {type(group).__name__}")


def _name(method: Callable | str) -> str:
    """A worker-group method's name, given by reference (``RolloutWorker.receive_weights``) or by name."""
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def _status(result: Any, method: Callable | str, rank: int) -> str:
    if not isinstance(result, dict) or result.get("status") not in ("ok", "need_layout"):
        raise TypeError(f"rank {rank}: {_name(method)!r} returned {result!r}; it must return what receive_buckets "
                        "returns")
    return result["status"]
