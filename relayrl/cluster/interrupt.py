"""Ctrl-C (or SIGTERM) stops the calls still running in the background: the driver does not wait for them.

A group's ``*_async`` call, or a blocking call made by another driver thread (a rollout drawn ahead, a stage
thread of the dataflow), keeps its ranks busy after the driver's main thread was interrupted; shutting the
group down the ordinary way finishes the running call first, which for a long generation meant waiting for it
(measured: 40 s for a 40 s call). :func:`stop_calls_in_flight` stops the ranks of every live group with a call
in flight at once instead: a local rank process gets SIGTERM, ``cluster.error_grace_s`` to exit, then SIGKILL
with its whole process group (what it started); Ray kills the group's actors. Whoever waits for the call gets
a lost-worker ``WorkerError``; the group is broken and only shut down after. A call queued behind it (waiting
for its pool's turn) does not start. A rank living in the driver (a one-rank ``in_process`` group) cannot be
stopped from outside: it is named as such.

It runs where the driver meets the interrupt: :meth:`relayrl.workflows.session.Session.run`, the CLI's error
boundary, ``with WorkerGroup(...)`` left by one, and the interpreter's exit after an uncaught
``KeyboardInterrupt`` (a script's own driver), before Python joins the call's thread. Checkpoints and the final
model are written atomically (:mod:`relayrl.checkpoint.atomic`): one interrupted mid-write is left as a scratch
directory, never as a complete-looking one.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Protocol


class Stoppable(Protocol):
    """What this module needs of a group (`relayrl.cluster.group.WorkerGroup`)."""

    name: str

    def stop_calls(self) -> tuple[list[str], bool]: ...

__all__ = ["register", "say_stopped", "stop_calls_in_flight", "stopped_line"]

_live: "weakref.WeakSet[Stoppable]" = weakref.WeakSet()
_lock = threading.Lock()


def register(group: Stoppable) -> None:
    """Track ``group`` while it lives (:func:`stop_calls_in_flight` looks at every live group)."""
    with _lock:
        _live.add(group)


def stop_calls_in_flight(groups: list[Stoppable] | None = None, why: str = "interrupted") -> str | None:
    """Stop, without waiting, the ranks of every live worker group (or of ``groups``) with a call in flight,
    and keep the calls queued behind them from starting (module docstring). Returns the one line saying what
    was stopped, for the caller to print (:func:`say_stopped`); None when no call was running."""
    if groups is None:
        with _lock:
            groups = list(_live)
    stopped, kept = [], []
    for g in groups:
        methods, done = g.stop_calls()
        if methods:
            (stopped if done else kept).append(f"{g.name!r} in {', '.join(map(repr, methods))}")
    return stopped_line(stopped, kept, why)


def stopped_line(stopped: list[str], kept: list[str], why: str = "interrupted") -> str | None:
    """The one line for the groups whose calls were ``stopped`` and those ``kept`` (ranks in the driver)."""
    parts = []
    if stopped:
        parts.append(f"stopped the ranks of worker group{'s' if len(stopped) > 1 else ''} {'; '.join(stopped)} "
                     f"without waiting for {'their calls' if len(stopped) > 1 else 'the call'}")
    if kept:
        parts.append(f"worker group{'s' if len(kept) > 1 else ''} {'; '.join(kept)} "
                     f"run{'' if len(kept) > 1 else 's'} in the driver and cannot be stopped from outside")
    return f"{why}: " + "; ".join(parts) if parts else None


def say_stopped(line: str | None) -> None:
    """Print :func:`stop_calls_in_flight`'s line, if any, as ``relayrl: ...`` on stderr."""
    if line is not None:
        print(f"relayrl: {line}", file=sys.stderr, flush=True)


def _at_exit() -> None:
    """Interpreter exit after an uncaught Ctrl-C: stop the calls still in flight before Python joins their
    threads (``threading._register_atexit`` hooks run newest first, so this one before the executors')."""
    if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        return
    say_stopped(stop_calls_in_flight())


import concurrent.futures.thread  # noqa: E402,F401 - its exit hook first, so that ours runs before it

threading._register_atexit(_at_exit)  # (private, but the only hook that runs before thread joins at exit)
