"""Host shared-memory buckets: the CPU stand-in for NeMo RL's CUDA IPC handles.

NeMo-RL's refit sends a *handle* to a packed GPU buffer and lets the receiver
map the same memory, instead of shipping the bytes. For ranks on the same host
relayrl does the same with host memory: the sender packs each bucket straight
into a file in ``/dev/shm`` (a tmpfs, so RAM), and a refit message carries only
``SharedBucket(path, nbytes)``; each rank maps the file read-only once (cached)
and copies from it into its engine. No bucket bytes go through pickling or a
pipe. The sender owns the files and unlinks them when its `ShmBuckets` is
closed or garbage-collected.

Departures: host memory instead of device memory (so one device->host copy on
the sender under CUDA); same-host ranks only (Ray actors use the object store,
which does the same thing natively); the sender must not repack until every
rank has returned (the relay's blocking ``group.all`` guarantees that).
"""
from __future__ import annotations

from collections import deque

import contextlib
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Iterable, MutableMapping, Sequence

import numpy as np
import torch

from relayrl.checkpoint.atomic import pid_alive
from relayrl.weights.layout import BucketLayout, layout_from_signature, weights_signature
from relayrl.weights.packing import from_wire, pack, pack_stream

__all__ = ["SharedBucket", "ShmBuckets", "shm_available", "open_shared", "pack_into_shared", "sweep_stale"]

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SharedBucket:
    """A handle to one packed bucket in host shared memory."""

    path: str
    """File under ``/dev/shm`` holding the bucket's bytes."""
    nbytes: int
    """Bytes of the bucket (the file may be one byte longer for an empty bucket)."""


def shm_available(nbytes: int) -> bool:
    """Whether ``/dev/shm`` exists, is writable and has ``nbytes`` free (with 10% headroom)."""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return False
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize > 1.1 * nbytes


def _unlink(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _pid_namespace() -> str:
    """This process's pid namespace as a tag for bucket file names (the namespace's inode number), or ``"0"``
    where the system does not say (not Linux)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def sweep_stale(directory: str = SHM_DIR, min_age_s: float = 3600.0) -> list[str]:
    """Unlink the bucket files of senders that no longer run: a sender killed outright (SIGKILL, a crash)
    cannot unlink its own. A file is named ``relayrl-<pid>-<pid namespace>-...``; one of this pid namespace
    whose pid is gone is removed at once. One of another namespace that shares ``/dev/shm`` (a container, a
    Ray worker's sandbox), or of an older name without the namespace, may belong to a live sender whose pid
    means nothing here: it is removed only when its pid looks dead and it was untouched for ``min_age_s``.
    Returns the paths removed."""
    removed = []
    now = time.time()
    ours = _pid_namespace()
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "relayrl" or not parts[1].isdigit() or pid_alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        here = ours != "0" and parts[2] == ours
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if here or now - os.stat(path).st_mtime >= min_age_s:
                os.unlink(path)
                removed.append(path)
    return removed


class ShmBuckets:
    """Sender side: one shared-memory file per bucket of ``layout``, exposed as flat tensors. Creating one
    first removes the files that dead senders left (:func:`sweep_stale`)."""

    def __init__(self, layout: BucketLayout) -> None:
        sweep_stale()
        tag = f"relayrl-{os.getpid()}-{_pid_namespace()}-{layout.key}-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.paths = [os.path.join(SHM_DIR, f"{tag}-{i}") for i in range(len(layout.buckets))]
        self._finalizer = weakref.finalize(self, _unlink, list(self.paths))
        self.tensors: list[torch.Tensor] = []
        try:
            for path, b in zip(self.paths, layout.buckets):
                mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(1, b.nbytes),))
                self.tensors.append(torch.from_numpy(mm[: b.nbytes]).view(b.dtype))
        except BaseException:
            self.close()
            raise
        self.handles = tuple(SharedBucket(p, b.nbytes) for p, b in zip(self.paths, layout.buckets))

    def close(self) -> None:
        """Unlink the files (ranks that mapped them keep their mappings until they drop them)."""
        self.tensors = []
        self._finalizer()


def open_shared(handle: SharedBucket, cache: MutableMapping, writable: bool = False) -> np.ndarray:
    """The bucket's bytes as a ``uint8`` array, mapped once per path: read-only on a receiver, ``writable``
    on a rank that packs into the sender's buckets (:func:`pack_into_shared`)."""
    key = ("shm", handle.path)
    arr = cache.get(key)
    if arr is None:
        try:
            arr = np.memmap(handle.path, dtype=np.uint8, mode="r+" if writable else "r")[: handle.nbytes]
        except FileNotFoundError:
            raise FileNotFoundError(f"shared bucket {handle.path} is gone: the sender closed its relay or runs "
                                    "on another host (use the pickle transport across hosts)") from None
        for old in [k for k in cache if isinstance(k, tuple) and k[0] == "shm"]:
            if os.path.basename(old[1]).rsplit("-", 1)[0] != os.path.basename(handle.path).rsplit("-", 1)[0]:
                del cache[old]  # buckets of an older layout or sender: drop the mapping
        cache[key] = arr
    return arr


def pack_into_shared(named_weights: Sequence[tuple[str, torch.Tensor]], handles: Sequence[SharedBucket] | None,
                     key: str | None, bucket_bytes: int, cache: MutableMapping, *,
                     values: Iterable[tuple[str, torch.Tensor]] | None = None, write: bool = True) -> dict:
    """A training rank's half of a relay that skips the driver: pack the weights straight into the driver's
    shared buckets (``handles`` of the layout ``key``, from
    :meth:`relayrl.weights.WeightRelay.push_from_group`). Returns ``{"status": "ok", "pack_s"}``, or
    ``{"status": "layout", "signature"}`` without writing (and without reading ``values``) when ``key`` is not
    the layout of these weights (the driver's first relay, or the weights' names, shapes or dtypes changed):
    the driver builds that layout's buckets and asks again.

    ``named_weights`` gives the names, shapes and dtypes (its tensors' data is not read when ``values`` is
    given: FSDP2's DTensor shards, which carry the full shapes, serve). ``values``: the tensors to pack, a
    one-pass stream in any order (`relayrl.weights.gather.stream_full_state`), each copied into its slot and
    dropped, so the rank holds one gathered bucket at a time; default ``named_weights`` itself.
    ``write=False``: a rank that only takes part in the stream's collectives (every rank of a sharded sender
    must run it when the layout matches: the decision depends only on ``key`` and the signature, so every
    rank takes it alike) reads ``values`` to the end and writes nothing."""
    sig = weights_signature(named_weights)
    layout = cache.get(("layout", sig, bucket_bytes))
    if layout is None:
        layout = layout_from_signature(sig, bucket_bytes)
        for old in [k for k in cache if isinstance(k, tuple) and k[0] == "layout"]:
            del cache[old]
        cache[("layout", sig, bucket_bytes)] = layout
    if handles is None or layout.key != key:
        return {"status": "layout", "signature": sig}
    t0 = time.perf_counter()
    if not write:
        deque(values if values is not None else (), maxlen=0)  # (take part in the stream's gathers; keep nothing)
        return {"status": "ok", "pack_s": time.perf_counter() - t0}
    out = [from_wire(open_shared(h, cache, writable=True), b.dtype, b.numel) for h, b in zip(handles, layout.buckets)]
    if values is None:
        pack(named_weights, layout, out=out)
    else:
        pack_stream(values, layout, out=out)
    return {"status": "ok", "pack_s": time.perf_counter() - t0}
