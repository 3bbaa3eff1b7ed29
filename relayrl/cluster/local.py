"""The `local` backend: ranks on this machine, no cluster.

* One rank: the worker lives in the driver process and a call is a plain
  method call (no pickling). With `distributed=True` the driver joins a
  world-of-one default process group (shared by all in-process groups), so
  SPMD code (FSDP, DTensor) runs unchanged at world size 1.
* More ranks: one process per rank (`torch.multiprocessing`: CPU ranks fork
  from a server that imported torch and transformers once, CUDA ranks are
  spawned; `rank_context`), each serving (method, args) messages over a
  pipe; ranks form a gloo (CPU) or NCCL (CUDA) process group on 127.0.0.1
  and a free port. The driver waits on
  every rank's pipe *and* process sentinel, so a rank that raises or dies
  (killed, segfault, `os._exit`) surfaces at once as `WorkerError`; a rank
  leaves when the driver process is gone (`rank.watch_driver`), so a killed
  driver leaves no rank running. Each rank leads an OS process group of its
  own (`rank.own_process_group`), so what it starts (a vLLM engine core, a
  user's server) is stopped with it: by the driver once the rank is gone,
  however it ended, or by the rank itself when the driver is gone. Ctrl-C
  reaches the driver's group only; the driver shuts the ranks down, without waiting for a call still running
  in the background (`relayrl.cluster.interrupt`: its ranks are stopped). Ranks that do not answer a call within
  `cluster.call_timeout_s` (start-up: `start_timeout_s`) raise `CallTimeout`
  once every rank process of the group is stopped (SIGTERM, then SIGKILL); an
  in-driver rank past the limit is only reported (it cannot be stopped).

This plays the part of HybridFlow's single controller talking to its
multi-controller workers (HybridFlow) without Ray. Departures: data crosses the
pipe by plain pickling (no shared memory or CUDA IPC yet); a rank process
leaves with `os._exit(0)` after shutdown (skipping slow torch teardown), so a
worker must flush its own files before the group is shut down, not at exit.
"""
from __future__ import annotations

import itertools
import contextlib
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as mp_wait
from typing import Any

from relayrl.cluster import compute
from relayrl.dock import traffic
from relayrl.cluster.config import ClusterConfig
from relayrl.cluster.errors import WorkerError
from relayrl.cluster.rank import (SHUTDOWN, START_CALL, Replies, Reply, StartSpec, free_port, rank_process_main,
                                  stop_process_group)
from relayrl.cluster.worker import RankInfo, construct_worker
from relayrl.errors import ProcessLost, exit_reason

Payload = tuple[tuple, dict]


class InProcessRanks:
    """A single rank living in the driver process."""

    world_size = 1

    def __init__(self, group: str, worker_cls: type, init_kwargs: dict, device: str | tuple[str, ...],
                 distributed: bool, cfg: ClusterConfig) -> None:
        import torch

        self.group = group
        self.call_timeout_s = cfg.call_timeout_s
        owned = (device,) if isinstance(device, str) else tuple(device)
        device = owned[0]
        if distributed:
            _ensure_world_of_one(device, cfg)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        info = RankInfo(group, 0, 1, 0, device, distributed, owned)
        try:
            self.worker = construct_worker(worker_cls, info, init_kwargs)
        except Exception as exc:
            raise WorkerError(group, 0, "__init__", traceback.format_exc(), _user_message(exc),
                              lost=isinstance(exc, ProcessLost), node_id=getattr(exc, "node_id", None)) from exc

    def call(self, method: str, ranks: list[int], payloads: list[Payload]) -> list[Any]:
        if self.worker is None:
            raise RuntimeError(f"worker group {self.group!r} is shut down")
        (args, kwargs), = payloads
        late = None
        if self.call_timeout_s is not None:  # (a call in the driver cannot be stopped: it is only reported)
            late = threading.Timer(self.call_timeout_s, _warn_late, (self.group, method, self.call_timeout_s))
            late.daemon = True
            late.start()
        try:
            return [compute.run(getattr(self.worker, method), *args, **kwargs)]
        except Exception as exc:
            raise WorkerError(self.group, 0, method, traceback.format_exc(), _user_message(exc),
                              lost=isinstance(exc, ProcessLost), node_id=getattr(exc, "node_id", None)) from exc
        finally:
            if late is not None:
                late.cancel()

    def pids(self) -> list[int]:
        return [os.getpid()]

    def stop_now(self, grace_s: float) -> bool:
        """A call in the driver cannot be stopped from outside (`WorkerGroup.stop_calls`): False."""
        return False

    def shutdown(self) -> None:
        self.worker = None


def _warn_late(group: str, method: str, limit_s: float) -> None:
    """A one-rank group in the driver has run ``method`` past ``cluster.call_timeout_s``: say so (it cannot be
    stopped from outside without stopping the driver)."""
    print(f"relayrl: warning: worker group {group!r} (its one rank runs in the driver) has not answered "
          f"{method!r} within cluster.call_timeout_s={limit_s:g} s and cannot be stopped from outside; it keeps "
          f"waiting (Ctrl-C stops the run). cluster.in_process=false runs the rank in a process of its own, which "
          f"the limit stops", file=sys.stderr, flush=True)


def _user_message(exc: BaseException) -> str | None:
    from relayrl.errors import is_user_error, user_message

    return user_message(exc) if is_user_error(exc) else None


def _ensure_world_of_one(device: str, cfg: ClusterConfig) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"the driver process already belongs to a process group of world size {dist.get_world_size()}; "
                "an in-process rank needs world size 1 (do not launch the driver with torchrun)"
            )
        return
    backend = "cpu:gloo,cuda:nccl" if (device.startswith("cuda") or torch.cuda.is_available()) else "gloo"
    from datetime import timedelta

    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=cfg.collective_timeout_s))


PRELOAD = ("relayrl.cluster.rank", "torch", "transformers", "transformers.modeling_utils",
           "relayrl.engines.training.torch_engine")
"""What the fork server imports once, before it forks CPU rank processes (importing torch and transformers
takes a new process about 10 s of one core here; a fork of the server takes milliseconds)."""


def rank_context(devices: list[str]):
    """How rank processes start. CPU ranks fork from a server that has imported torch and transformers once
    (``PRELOAD``); a CUDA rank is spawned, a fresh interpreter: a process forked after CUDA was touched cannot
    use it, and torch or transformers may query the driver at import."""
    import multiprocessing
    import torch.multiprocessing as tmp

    if any(d != "cpu" for d in devices) or "forkserver" not in multiprocessing.get_all_start_methods():
        return tmp.get_context("spawn")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # (read when the server starts: the first CPU group of the process)
    return ctx


class ProcessRanks:
    """N ranks as processes of their own on this machine (started as ``rank_context`` says). ``devices``: one
    entry per rank, its device or the tuple of devices it owns (the first is its ``device``)."""

    def __init__(self, group: str, worker_cls: type, init_kwargs: dict, devices: list[str] | list[tuple[str, ...]],
                 distributed: bool, cfg: ClusterConfig) -> None:
        owned = [(d,) if isinstance(d, str) else tuple(d) for d in devices]
        devices = [o[0] for o in owned]
        self.group = group
        self.cfg = cfg
        self.world_size = len(devices)
        self.broken: str | None = None
        self._ids = itertools.count()
        self._groups_stopped: set[int] = set()  # rank pids whose process group `_stop` has killed
        ctx = rank_context(devices)
        env = dict(os.environ)  # (a forked rank gets the fork server's environment: this one is the driver's now)
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) * len(owned[0]) // sum(map(len, owned)))
        self.procs, self.conns = [], []
        try:
            for r, dev in enumerate(devices):
                spec = StartSpec(
                    info=RankInfo(group, r, self.world_size, r, dev, distributed, owned[r]), worker_cls=worker_cls,
                    init_kwargs=init_kwargs, master_addr="127.0.0.1", master_port=port,
                    timeout_s=cfg.collective_timeout_s, num_threads=threads if dev == "cpu" else None,
                )
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=rank_process_main, args=(child, pickle.dumps(spec), env, os.getpid()),
                                   name=f"relayrl-{group}-rank{r}", daemon=False)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._collect(START_CALL, list(range(self.world_size)), "__init__", cfg.start_timeout_s,
                          "cluster.start_timeout_s")
        except BaseException:
            self.shutdown()
            raise

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, method: str, ranks: list[int], payloads: list[Payload]) -> list[Any]:
        if self.broken is not None:
            raise RuntimeError(f"worker group {self.group!r} is broken ({self.broken}); shut it down and create it again")
        call_id = next(self._ids)
        try:
            # An `all` call repeats one payload object for every rank: pickle it once.
            pickled: dict[int, bytes] = {}
            for p in payloads:
                if id(p) not in pickled:
                    pickled[id(p)] = pickle.dumps((call_id, method, pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)))
            msgs = [pickled[id(p)] for p in payloads]
            traffic.add("calls", sum(len(m) for m in msgs))
        except Exception as exc:
            raise TypeError(f"group {self.group!r}: the arguments of {method!r} cannot be pickled for the rank "
                            f"processes: {exc}") from exc
        for r, msg in zip(ranks, msgs):
            try:
                self.conns[r].send_bytes(msg)
            except (BrokenPipeError, OSError):
                self._raise_dead(r, method)
        return self._collect(call_id, ranks, method, self.cfg.call_timeout_s, "cluster.call_timeout_s")

    def _raise_dead(self, r: int, method: str) -> None:
        proc = self.procs[r]
        proc.join(timeout=1.0)
        reason = f"rank process (pid {proc.pid}) died: {exit_reason(proc.exitcode, running='its pipe closed')}"
        self.broken = f"rank {r} died in {method!r}"
        raise WorkerError(self.group, r, method, reason, lost=True)

    def _collect(self, call_id: int, ranks: list[int], method: str, limit_s: float | None, key: str) -> list[Any]:
        """Wait for one reply per rank (results in `ranks` order), up to ``limit_s`` (the value of ``key``). The
        first error or death raises; after an error the other ranks get `error_grace_s`; ranks that did not
        answer in time raise `CallTimeout`, once the group's rank processes are stopped."""
        replies = Replies(self.group, method, ranks, limit_s, key, self.cfg.error_grace_s)
        while replies.pending:
            timeout = replies.timeout()
            if timeout == 0.0:
                break
            waitables = {}
            for r in replies.pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            for obj in mp_wait(list(waitables), timeout=timeout):
                r = waitables[obj]
                if r not in replies.pending:
                    continue
                conn = self.conns[r]
                try:
                    has_data = conn.poll()
                    raw = conn.recv_bytes() if has_data else b""
                    traffic.add("calls", len(raw))
                    reply: Reply | None = pickle.loads(raw) if has_data else None
                except (EOFError, OSError):
                    reply, has_data = None, False
                if not has_data:
                    if obj is conn or not self.procs[r].is_alive():
                        self._raise_dead(r, method)
                    continue
                if reply.call_id != call_id:
                    continue  # a late reply of an earlier, failed call
                replies.add(r, reply)
        try:
            return replies.outcome()
        finally:
            self.broken = replies.broken or self.broken
            if replies.timed_out:
                self._stop()

    def _stop(self, grace_s: float = 2.0) -> None:
        """Stop every rank process of the group at once, hung or not (a hung rank reads no `SHUTDOWN`, and
        the others share its torch process group): SIGTERM, then SIGKILL for one still there after ``grace_s``;
        then whatever each rank started that is still in its OS process group (`rank.own_process_group`),
        whether the rank left, was stopped or died (a vLLM engine core, a user's server)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for proc in self.procs:
            if proc.pid is not None and proc.pid not in self._groups_stopped:
                # (once only: an empty group's id is a free pid again, which a new session may take as its own)
                self._groups_stopped.add(proc.pid)
                stop_process_group(proc.pid)

    def stop_now(self, grace_s: float) -> bool:
        """Ctrl-C while a call runs (`WorkerGroup.stop_calls`): stop every rank process now, not after the call
        (SIGTERM, SIGKILL after ``grace_s``, then each rank's process group); the call's waiter gets a
        lost-worker `WorkerError`. True."""
        self.broken = self.broken or "its ranks were stopped while a call ran (interrupted)"
        self._stop(grace_s)
        return True

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(pickle.dumps(SHUTDOWN))
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
