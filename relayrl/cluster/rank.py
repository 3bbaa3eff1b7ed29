"""What runs on one rank outside the driver: process-group setup, worker
construction and method invocation, shared by the spawned-process and the Ray
backends.

This is the "multi-controller" half of HybridFlow's hierarchy: each
rank runs the same SPMD code, and `torch.distributed` is initialised before the
worker is built (gloo for CPU ranks; on CUDA a `cpu:gloo,cuda:nccl` group, so
NCCL carries GPU tensors and gloo any CPU tensors). Errors never cross the
wire as exception objects (they may not unpickle in the driver); a rank
returns a `Reply` carrying the formatted traceback instead.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from relayrl.cluster.errors import CallTimeout, WorkerError
from relayrl.cluster.worker import RankInfo, construct_worker

START_CALL = -1  # call id of the start-up reply


@dataclass(frozen=True)
class Reply:
    """A rank's answer to one call."""

    call_id: int
    """Id of the call answered (`START_CALL` for start-up)."""
    ok: bool
    """False when the method raised (or the result could not be sent)."""
    value: Any = None
    """The method's return value when `ok`."""
    traceback: str = ""
    """Formatted remote traceback when not `ok`."""
    user_message: str | None = None
    """The error's message when it is the user's to fix (`relayrl.errors.is_user_error`)."""
    lost: bool = False
    """The error was a process the rank depends on lost (`relayrl.errors.ProcessLost`, e.g. a dock unit)."""
    lost_node: str | None = None
    """Ray: the node of that lost process, when known (`ProcessLost.node_id`)."""


def error_reply(call_id: int, exc: BaseException) -> Reply:
    """The reply for a call (or start-up) that raised `exc` (call it inside the `except` block): its
    traceback, and its message if the error is the user's to fix."""
    from relayrl.errors import ProcessLost, is_user_error, user_message

    return Reply(call_id, False, traceback=traceback.format_exc(),
                 user_message=user_message(exc) if is_user_error(exc) else None, lost=isinstance(exc, ProcessLost),
                 lost_node=exc.node_id if isinstance(exc, ProcessLost) else None)


class Replies:
    """One call's replies, one per rank, as the driver collects them (both backends).

    The call may take ``limit_s`` seconds from now (``None``: no limit), the value of the config key ``key``
    (``cluster.call_timeout_s`` for a call, ``cluster.start_timeout_s`` for start-up): :meth:`timeout` says how
    long the backend may still wait. The first error starts a grace period of ``grace_s`` for the other ranks;
    :meth:`outcome` returns the results in rank order or raises. ``broken`` is set when the group can no longer
    be trusted (a rank never answered); ``timed_out`` when ranks did not answer within ``limit_s`` (the
    backend then stops the group's ranks).
    """

    def __init__(self, group: str, method: str, ranks: list[int], limit_s: float | None, key: str,
                 grace_s: float) -> None:
        self.group, self.method, self.ranks, self.grace_s = group, method, ranks, grace_s
        self.limit_s, self.key = limit_s, key
        self.started = time.monotonic()
        self.deadline = None if limit_s is None else self.started + limit_s
        self.pending = set(ranks)
        self.results: dict[int, Any] = {}
        self.first_error: WorkerError | None = None
        self.broken: str | None = None
        self.timed_out = False

    def timeout(self) -> float | None:
        """Seconds left to wait (None: no limit)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add(self, rank: int, reply: Reply) -> None:
        self.pending.discard(rank)
        if reply.ok:
            self.results[rank] = reply.value
        elif self.first_error is None:
            self.first_error = WorkerError(self.group, rank, self.method, reply.traceback, reply.user_message,
                                           lost=reply.lost, node_id=reply.lost_node)
            self.deadline = time.monotonic() + self.grace_s
        elif reply.user_message is not None and reply.user_message == self.first_error.user_message:
            self.first_error.other_ranks.append(rank)  # the same mistake seen by every rank: one message

    def outcome(self) -> list[Any]:
        """Results in rank order; else the first error raises, or, when ranks did not answer within the
        limit, a :class:`CallTimeout` naming them (and the ranks that did answer)."""
        if self.first_error is not None:
            if self.pending:
                self.broken = (f"rank {self.first_error.rank} failed in {self.method!r} while ranks "
                               f"{sorted(self.pending)} did not answer")
            raise self.first_error
        if self.pending:
            self.timed_out = True
            late = sorted(self.pending)
            self.broken = f"ranks {late} did not answer {self.method!r} within {self.key}={self.limit_s:g} s"
            raise CallTimeout(self.group, late, self.method, time.monotonic() - self.started, self.key,
                              self.limit_s, answered=sorted(self.results))
        return [self.results[r] for r in self.ranks]


@dataclass(frozen=True)
class StartSpec:
    """Everything a rank needs to start."""

    info: RankInfo
    worker_cls: type
    init_kwargs: dict = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 1800.0
    num_threads: int | None = None
    """CPU ranks in their own process: `torch.set_num_threads` value."""


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(spec: StartSpec) -> None:
    """Set the torch.distributed env vars and join the group's process group."""
    import torch
    import torch.distributed as dist

    info = spec.info
    os.environ.update(
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
    )
    device = torch.device(info.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(
        backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


class RankRuntime:
    """Start one rank (process group, then worker) and run methods on it."""

    def __init__(self, spec: StartSpec) -> None:
        import torch

        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        if spec.info.device.startswith("cuda") and not spec.info.distributed:
            torch.cuda.set_device(torch.device(spec.info.device))
        if spec.info.distributed:
            init_distributed(spec)
        self.worker = construct_worker(spec.worker_cls, spec.info, spec.init_kwargs)

    def invoke(self, call_id: int, method: str, args: tuple, kwargs: dict) -> Reply:
        try:
            return Reply(call_id, True, getattr(self.worker, method)(*args, **kwargs))
        except Exception as exc:
            return error_reply(call_id, exc)

    def close(self) -> None:
        import torch.distributed as dist

        self.worker = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def encode_reply(reply: Reply) -> bytes:
    """Pickle a reply; an unpicklable result becomes an error reply."""
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        tb = traceback.format_exc()
        return pickle.dumps(Reply(reply.call_id, False, traceback=f"the result could not be pickled:\n{tb}"))


SHUTDOWN = "__relayrl_shutdown__"


def _thread_lock_for_progress_bars() -> None:
    """tqdm guards its bars with a multiprocessing lock, a named semaphore that is removed at interpreter
    exit. A rank process leaves with `os._exit` (below), so the driver's resource tracker would warn about
    "leaked semaphore objects" after every run; a thread lock serves the one process that draws the bars."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())


def _driver_gone(driver_pid: int) -> Callable[[], None]:
    """A call that returns once process ``driver_pid`` has ended (at once if it already has): it waits on a
    pidfd where Linux has them (a pid reused later cannot fool it), else looks twice a second."""
    try:
        fd = os.pidfd_open(driver_pid)
    except ProcessLookupError:
        return lambda: None
    except (AttributeError, OSError):  # no pidfds here: poll the pid
        def alive() -> bool:
            try:
                os.kill(driver_pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True  # (alive, another user's: cannot happen for our own driver)
            return True

        def poll() -> None:
            while alive():
                time.sleep(0.5)

        return poll
    return lambda: select.select([fd], [], [])


def own_process_group() -> bool:
    """Make this rank process the leader of a process group of its own, which whatever it starts joins (a vLLM
    engine core, a user's reward server, a compiler's workers: anything that does not start a session of its
    own), so one ``killpg`` stops the rank and all of it (`relayrl.cluster.local.ProcessRanks`), even after the
    rank itself died. False where there are no process groups (not POSIX)."""
    if not hasattr(os, "setpgid"):
        return False
    os.setpgid(0, 0)
    return True


def stop_process_group(pid: int) -> None:
    """SIGKILL every process left in the process group led by rank process ``pid`` (this one included, when it is
    ``pid``): what the rank started must not outlive it."""
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def watch_driver(driver_pid: int, group: str, rank: int, own_group: bool = False) -> None:
    """Leave this rank process when the driver process is gone (killed: SIGKILL, the OOM killer, a scheduler's
    preemption), even while the rank is busy in a call or stuck in a collective, which would otherwise run on
    (a collective until ``cluster.collective_timeout_s``), holding its devices, as an orphan. A forked rank's
    parent is the fork server, not the driver, so the driver's pid is watched, not ``getppid``. With
    ``own_group`` (the rank leads its process group: :func:`own_process_group`) the processes the rank started
    go with it."""
    wait = _driver_gone(driver_pid)

    def body() -> None:
        wait()
        with contextlib.suppress(Exception):
            print(f"relayrl: worker group {group!r} rank {rank}: the driver (pid {driver_pid}) is gone; this rank "
                  f"process (pid {os.getpid()}) exits", file=sys.stderr, flush=True)
        if own_group:
            stop_process_group(os.getpid())
        os._exit(1)

    threading.Thread(target=body, name="relayrl-watch-driver", daemon=True).start()


def rank_process_main(conn, start_payload: bytes, env: dict[str, str] | None = None,
                      driver_pid: int | None = None) -> None:
    """Entry point of a rank process: start, then serve calls until the driver sends `SHUTDOWN` or closes the
    pipe. ``env``: the driver's environment when the group started (a rank forked from the fork server
    would otherwise see the server's, from when it started). ``driver_pid``: the process whose end ends this
    one (:func:`watch_driver`)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    _thread_lock_for_progress_bars()
    # A process group of its own: the driver stops the rank with all it started. Ctrl-C reaches the terminal's
    # foreground process group, the driver's, not this one: the driver alone handles it (it shuts the ranks
    # down); SIGINT stays ignored in case one arrives all the same (a `kill -INT` of the rank), so a rank
    # prints no KeyboardInterrupt traceback of its own.
    own_group = own_process_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        spec: StartSpec = pickle.loads(start_payload)
        if driver_pid is not None:
            watch_driver(driver_pid, spec.info.group_name, spec.info.rank, own_group)
        runtime = RankRuntime(spec)
    except Exception as exc:
        conn.send_bytes(encode_reply(error_reply(START_CALL, exc)))
        return
    conn.send_bytes(encode_reply(Reply(START_CALL, True)))
    driver_gone = False
    try:
        while True:
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):
                driver_gone = True  # the driver went away
                break
            msg = pickle.loads(raw)  # (call_id, method, inner bytes) or SHUTDOWN: plain types only
            if msg == SHUTDOWN:
                break
            call_id, method, inner = msg
            try:
                args, kwargs = pickle.loads(inner)
            except Exception:
                tb = traceback.format_exc()
                reply = Reply(call_id, False, traceback=f"the arguments of {method!r} could not be unpickled:\n{tb}")
            else:
                reply = runtime.invoke(call_id, method, args, kwargs)
            conn.send_bytes(encode_reply(reply))
    finally:
        runtime.close()
    # Leave at once: interpreter teardown of torch/gloo state in a rank process takes
    # seconds and there is nothing left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    if driver_gone and own_group:  # (after a shutdown the driver stops what is left of the group)
        stop_process_group(os.getpid())
    os._exit(0)
