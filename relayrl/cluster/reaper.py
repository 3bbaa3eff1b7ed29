"""A Ray rank actor's reaper: what the actor started goes with it, whatever Ray's own settings.

A Ray actor is a worker process the raylet forked. What it starts (a vLLM engine core out of process, a user's
reward server, the engine core's own workers) is stopped with it only where Ray's process-group clean-up is on
(``RAY_process_group_cleanup_enabled``, on in the Ray 2.60 relayrl is tested with; off in older Rays and in a
cluster started with it off): otherwise Ray SIGKILLs the actor's direct children at a clean exit
(``RAY_kill_child_processes_on_worker_exit``), and nothing when the actor is SIGKILLed (the OOM killer, a
raylet gone), so grandchildren always, and every child of a killed actor, ran on, orphaned, holding GPU memory.

So each rank actor leads a process group of its own (as a local rank process does), and starts a reaper in it:
a small process, detached from the actor (its parent is gone at once, so Ray's kill of the actor's direct
children does not take it first), that waits for the actor's end through a pidfd and then SIGKILLs the
group: the actor's children, theirs, and itself. One ``ray.kill``, a SIGKILLed actor, a lost raylet or a
driver's ``ray.shutdown`` all end the actor, so all of them end what it started.
"""
from __future__ import annotations

import os
import subprocess
import sys

REAPER = r"""
import os, select, signal, sys
actor = int(sys.argv[1])
try:
    fd = os.pidfd_open(actor)
except ProcessLookupError:
    fd = None
if fd is not None and os.getppid() == actor:  # (checked after the open: while the actor is our parent, the
    child = os.fork()                          # pidfd is the actor's, not a later process's with its pid)
    if child:
        print(child, flush=True)
        os._exit(0)  # the go-between leaves: the reaper is no child of the actor, whose children Ray kills first
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # (the actor reads the pid above until this pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    select.select([fd], [], [])
else:
    print(os.getpid(), flush=True)  # the actor is already gone
os.killpg(os.getpgid(0), signal.SIGKILL)
"""


def lead_group_with_reaper() -> int | None:
    """Make this process (a rank actor) lead a process group of its own, which whatever it starts joins, and
    start the reaper that SIGKILLs that group once this process has ended. The reaper's pid; None where there
    is no pidfd (not Linux 5.3+) or no process groups, after saying so on stderr: then only Ray's own
    clean-up applies."""
    if not hasattr(os, "setpgid") or not hasattr(os, "pidfd_open"):
        print(f"relayrl: rank actor (pid {os.getpid()}): no process groups or pidfds here; what this rank "
              f"starts is stopped with it only by Ray's own clean-up (RAY_process_group_cleanup_enabled)",
              file=sys.stderr, flush=True)
        return None
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    go_between = subprocess.run([sys.executable, "-I", "-S", "-c", REAPER, str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, close_fds=True)
    if go_between.returncode != 0 or not go_between.stdout.strip().isdigit():
        raise RuntimeError(f"the reaper of rank actor {os.getpid()} did not start (exit {go_between.returncode}, "
                           f"said {go_between.stdout!r})")
    return int(go_between.stdout)
