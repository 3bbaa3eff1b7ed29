"""Storage units served from their own processes (``Dock(backend="process")``).

Rank processes of the local cluster backend (spawned by ``torch.multiprocessing``)
must write samples into the units and read micro-batches from them without the
driver touching the data. Each unit is therefore one process of its own (a
fresh interpreter started with ``subprocess``) holding a ``PackedUnit`` (the
body the Ray actor hosts too) behind a small server:

* **Transport.** ``multiprocessing.connection.Listener`` on a Unix-domain
  socket in a private temporary directory (mode 0700) with a random 32-byte
  authkey (the HMAC handshake of ``multiprocessing``), one thread per
  connection, one lock around the unit body. A message is pickled with
  protocol 5 and its numpy buffers travel out of band, each as one frame
  straight from the array's memory (no copy into the pickle stream). The
  requests and the packed format are the Ray unit's (``wire.py``,
  ``columns.py``), so both backends store and return exactly the same thing.
* **Clients.** ``UnitClient`` keeps a pool of connections per unit in each
  process (one per concurrent caller, opened lazily); ``fan_out`` sends a
  request to every unit involved before waiting for any reply, so units work
  concurrently without client threads. There is no group commit as on Ray: a
  call costs tens of microseconds here, not milliseconds.
* **Failure.** Client sockets carry ``SO_RCVTIMEO``/``SO_SNDTIMEO`` (the dock's
  ``io_timeout_s``): a unit that died closes its sockets (the next call fails at
  once), one that stopped answering fails the call after the timeout; both
  raise ``UnitLostError`` naming the unit and its pid. A unit process ignores
  SIGINT (the driver decides), exits when its parent process is gone (it
  watches ``getppid`` twice a second, so even a SIGKILLed driver leaves no
  unit behind), and is stopped by its owner's ``shutdown`` or, if the owner
  forgets, by a ``weakref.finalize`` (garbage collection or interpreter exit).

Why not the alternatives: ``multiprocessing`` spawn would re-run the
driver's ``__main__`` module in every unit (a script without a main guard
would start a second driver); a ``multiprocessing.Manager`` proxy pickles every
call in band through a generic dispatcher; shared-memory segments per column
would save one copy but need an allocator and cross-process lifetimes (who
unlinks a segment when a writer dies?) on top of the same metadata channel;
Ray is the other backend, not something to start for one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any, Sequence

from relayrl.errors import exit_reason

from .config import DockError, UnitLostError
from .units import PackedUnit

_COUNT = struct.Struct("<I")  # out-of-band buffers following a message
_OPS = frozenset({"ping", "put_many", "get", "drop"})
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds relayrl/


# --- messages -------------------------------------------------------------------------
def send_msg(conn: Connection, obj: Any) -> None:
    """Send ``obj`` as one pickle frame (protocol 5) followed by one frame per out-of-band buffer."""
    bufs: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    conn.send_bytes(_COUNT.pack(len(bufs)) + head)
    for b in bufs:
        conn.send_bytes(b.raw())


def recv_msg(conn: Connection) -> Any:
    """Inverse of :func:`send_msg` (numpy arrays come back over the received bytes, read-only)."""
    first = conn.recv_bytes()
    (n,) = _COUNT.unpack_from(first)
    bufs = [conn.recv_bytes() for _ in range(n)]
    return pickle.loads(memoryview(first)[_COUNT.size:], buffers=bufs)


# --- the unit process -------------------------------------------------------------------
def main() -> None:
    """Entry point of a unit process: read its settings from stdin, listen, report the pid, serve."""
    cfg = json.loads(sys.stdin.readline())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver decides
    body, lock = PackedUnit(), threading.Lock()
    listener = Listener(cfg["address"], family="AF_UNIX", backlog=64, authkey=bytes.fromhex(cfg["authkey"]))
    threading.Thread(target=_watch_parent, args=(cfg["parent_pid"],), daemon=True, name="parent-watch").start()
    print(os.getpid(), flush=True)
    while True:
        try:
            conn = listener.accept()
        except OSError:  # e.g. out of file descriptors: try again shortly
            time.sleep(0.05)
            continue
        except Exception:  # noqa: BLE001 - a client that failed the handshake
            continue
        threading.Thread(target=_serve_connection, args=(conn, body, lock), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _serve_connection(conn: Connection, body: PackedUnit, lock: threading.Lock) -> None:
    with conn:
        while True:
            try:
                op, args = recv_msg(conn)
            except (EOFError, OSError):
                return
            try:
                if op not in _OPS:
                    raise ValueError(f"unknown storage unit request {op!r}")
                with lock:
                    reply = (True, getattr(body, op)(*args))
            except Exception as e:  # noqa: BLE001 - the caller re-raises it
                reply = (False, e)
            try:
                try:
                    send_msg(conn, reply)
                except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
                    send_msg(conn, (False, RuntimeError(repr(reply[1]))))
            except (EOFError, OSError):
                return


# --- starting and stopping units (owner process) -----------------------------------------
def _socket_dir() -> str:
    root = tempfile.mkdtemp(prefix="relayrl-dock-")  # mode 0700: only this user can connect
    if len(root) > 80:  # AF_UNIX paths are limited to ~107 bytes
        shutil.rmtree(root, ignore_errors=True)
        root = tempfile.mkdtemp(prefix="relayrl-dock-", dir="/tmp")
    return root


def start_units(n: int, timeout_s: float) -> tuple[str, bytes, list[str], list[subprocess.Popen]]:
    """Start ``n`` unit processes; returns ``(socket dir, authkey, addresses, processes)`` once all listen.

    A fresh interpreter runs ``main`` (``subprocess``, not ``multiprocessing``
    spawn, which would re-run the caller's ``__main__`` module in every unit);
    it imports the same ``relayrl`` as this process.
    """
    root, authkey = _socket_dir(), os.urandom(32)
    addresses = [os.path.join(root, f"unit-{k}.sock") for k in range(n)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    procs: list[subprocess.Popen] = []
    try:
        for address in addresses:
            p = subprocess.Popen([sys.executable, "-c", "from relayrl.dock.unitproc import main; main()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
            procs.append(p)
            p.stdin.write(json.dumps({"address": address, "authkey": authkey.hex(), "parent_pid": os.getpid()}).encode() + b"\n")
            p.stdin.close()
        deadline = time.monotonic() + timeout_s
        for k, p in enumerate(procs):
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else b""
            p.stdout.close()
            if not line.strip():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=1.0)
                why = f"it {exit_reason(p.returncode)}" if p.returncode is not None else f"not within {timeout_s:g} s"
                raise DockError(f"storage unit {k} (pid {p.pid}) did not start: {why}")
    except BaseException:
        stop_units(os.getpid(), procs, root)
        raise
    return root, authkey, addresses, procs


def stop_units(owner_pid: int, procs: Sequence[subprocess.Popen], root: str) -> None:
    """Stop the unit processes and remove their sockets (only in the process that started them:
    a forked child inherits this finalizer and must leave the units alone)."""
    if os.getpid() != owner_pid:
        return
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=2.0)
    shutil.rmtree(root, ignore_errors=True)


# --- clients (any process) -------------------------------------------------------------------
def _gone(pid: int) -> bool:
    """Whether process ``pid`` no longer runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class UnitClient:
    """This process's connections to one unit process (thread-safe; one connection per concurrent call).

    Args:
        unit: the unit's number (for errors).
        address, authkey: where the unit listens and the key of its handshake.
        pid: the unit process's pid (for errors).
        timeout_s: limit on each socket send/receive without progress.
        proc: the unit's ``subprocess.Popen`` in the owner (for the exit code in errors), else None.
    """

    def __init__(self, unit: int, address: str, authkey: bytes, pid: int, timeout_s: float, proc: Any = None) -> None:
        self.unit, self.address, self.pid, self.timeout_s = unit, address, pid, timeout_s
        self._authkey, self._proc = authkey, proc
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    def _connect(self) -> Connection:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.settimeout(self.timeout_s)
            s.connect(self.address)
            s.setblocking(True)
            tv = struct.pack("ll", int(self.timeout_s), int(self.timeout_s % 1 * 1e6))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            conn = Connection(s.detach())
        finally:
            s.close()
        try:
            answer_challenge(conn, self._authkey)
            deliver_challenge(conn, self._authkey)
        except BaseException:
            conn.close()
            raise
        return conn

    def send(self, op: str, *args: Any) -> Connection:
        """Send one request; returns the connection to ``finish`` it on."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None:
                conn = self._connect()
            send_msg(conn, (op, args))
        except (EOFError, OSError) as e:
            if conn is not None:
                conn.close()
            raise self._lost(op, e) from e
        return conn

    def finish(self, conn: Connection) -> Any:
        """The reply to the request sent on ``conn``; re-raises the unit's exception."""
        try:
            ok, value = recv_msg(conn)
        except (EOFError, OSError) as e:
            conn.close()
            raise self._lost("reply", e) from e
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.append(conn)
        if not ok:
            raise value
        return value

    def call(self, op: str, *args: Any) -> Any:
        return self.finish(self.send(op, *args))

    def _lost(self, op: str, e: BaseException) -> UnitLostError:
        who = f"storage unit {self.unit} (pid {self.pid})"
        timed_out = isinstance(e, (BlockingIOError, TimeoutError))
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a unit that closed its socket is exiting:
                self._proc.wait(timeout=0.0 if timed_out else 1.0)  # give it a moment to be reaped
            if self._proc.returncode is not None:
                return UnitLostError(f"{who} died ({exit_reason(self._proc.returncode)}); its rows are lost [{op}: {e!r}]")
        if _gone(self.pid):
            return UnitLostError(f"{who} died; its rows are lost [{op}: {e!r}]")
        if timed_out:
            return UnitLostError(f"{who} did not answer within {self.timeout_s:g} s [{op}]")
        return UnitLostError(f"{who} is unreachable [{op}: {e!r}]")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def fan_out(requests: Sequence[tuple[UnitClient, str, tuple]]) -> list[Any]:
    """Send every request, then collect every reply (in order); a failed one is its exception object.

    The units work on their requests concurrently; every sent request is
    received, so each connection goes back to its pool in a clean state.
    """
    sent: list[tuple[UnitClient, Any]] = []
    for client, op, args in requests:
        try:
            sent.append((client, client.send(op, *args)))
        except Exception as e:  # noqa: BLE001 - reported with the others
            sent.append((client, e))
    out: list[Any] = []
    for client, conn in sent:
        if isinstance(conn, BaseException):
            out.append(conn)
            continue
        try:
            out.append(client.finish(conn))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out
