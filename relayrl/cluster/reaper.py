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

A driver that started a local Ray itself (no ``cluster.ray_address``) gets one too, for that Ray's session
(:func:`reap_session_with_driver`). A driver SIGKILLed (the OOM killer, ``kill -9``, a CI timeout) takes Ray's
head processes with it (Ray starts them with ``PR_SET_PDEATHSIG``: gcs_server, raylet, monitor, dashboard, log
monitor), its actors leave within about 2 s of their raylet, but the raylet's two agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) ran on about 62 s (measured, Ray 2.60): they see the raylet gone, then report it to the
dead control store with a fixed 60 s timeout (``ray/_private/process_watcher.py``: ``publish_error_to_driver``)
before they exit. The driver's reaper waits on two pidfds, the driver's and the session's gcs_server's (found
in /proc: the gcs_server naming the session directory, checked again once its pidfd is open), and ends with
whichever ends first, so a driver that calls ``ray.shutdown()`` and starts Ray again (a notebook, a sweep, a
test process) keeps one reaper per live session, not one per session it ever started. The gcs_server rather
than a pipe the driver would close at shutdown: ``ray.shutdown()`` is the user's call, with no hook of
relayrl's in it, and every fork of the driver (a data loader's workers) would inherit the pipe's write end and
hold it open; a local Ray's session cannot outlive its gcs_server (no fault-tolerant store behind it), which
``ray.shutdown()`` stops and the driver's death takes with it. Its session ended first, the reaper gives Ray's
shutdown 2 s to stop the rest (it takes about 1 s), then SIGKILLs what is left (nothing, after a clean shutdown).

What it SIGKILLs: every process that writes a file under the session directory (Ray's processes write their
logs there, its workers theirs, which what a worker starts inherits as stdout), or names it in its command
line and holds nothing there yet (a head process starting). Not the driver while it lives, nor another driver
connected to this Ray (``ray.init(address=...)``): a driver writes its core-driver log there
(``logs/python-core-driver-<job>_<pid>.log``), but its stdout is no log of the session, unlike a driver an
actor started, which goes; nor a reader of the session's files (a ``tail -f`` of a log, which names it in its
command line). Ancestry does not tell them apart: what Ray started is reparented once its parent has gone, and
another driver can be a child of the one killed. Where Ray's logs go to stderr (``RAY_LOG_TO_STDERR=1``) its
agents and what a worker starts hold nothing under the session (measured) and are not found. A driver
connected to a cluster it did not start gets no such reaper: Ray ends the driver's actors with it (their
owner), their reapers what they started, and the cluster stays.
"""
from __future__ import annotations

import os
import subprocess
import sys

REAPER = r"""
import contextlib, os, select, signal, sys, time
watched = int(sys.argv[1])
session = os.path.realpath(sys.argv[2]) if len(sys.argv) > 2 else None  # (None: a rank actor's own group)
spelled = {session, os.path.normpath(sys.argv[2])} if session else set()  # (in command lines: as Ray wrote it)
GRACE_S = 2.0  # a session ended before its driver: how long Ray's shutdown may take to stop what it started


def pids():
    return [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if p != os.getpid()]


def names_session(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read()
    return argv, any(f"{path}{end}".encode() in argv for path in spelled for end in "/\0")  # (not a longer name)


def of_session(pid):
    # Ray's processes write their logs under the session directory (what a worker starts inherits its log as
    # stdout); its head processes name it in their command line too, before they have opened their logs.
    # Spared: a driver, the one that started this Ray or another one connected to it (it writes its own
    # core-driver log there, but its stdout is no log of the session, unlike a driver an actor started), and
    # a reader of the session's files (`tail -f` of a log, which names it in its command line).
    try:
        named = names_session(pid)[1]
        held = {}  # fd -> (path, whether written)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # (closed meanwhile)
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if path.startswith(session + "/"):
                    held[int(fd)] = (path, written(pid, fd))
    except OSError:  # (gone meanwhile, or not ours to read)
        return False
    writes = {fd: path for fd, (path, w) in held.items() if w}
    if not writes:
        return named and not held
    driver = any("-core-driver-" in os.path.basename(path) for path in writes.values())
    return not driver or 1 in writes or 2 in writes


def written(pid, fd):  # whether pid holds fd open for writing (as Ray's processes hold their logs)
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
    return True  # (a kernel that does not say: counted, as every file held was before readers were spared)


def session_gcs():
    # the session's control store: the gcs_server naming the session; None if there is none
    for p in pids():
        with contextlib.suppress(OSError):
            argv, named = names_session(p)
            if named and os.path.basename(argv.split(b"\0")[0]) == b"gcs_server":
                return p
    return None


def pidfd(pid, of_this_session=False):
    # None: gone (or, of_this_session, no longer the session's: its pid reused between the scan and the open)
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
        if not of_this_session or names_session(pid)[1]:
            return fd
        os.close(fd)
    return None


fd = pidfd(watched)
gcs = session_gcs() if session is not None and fd is not None else None
gcs_fd = pidfd(gcs, of_this_session=True) if gcs is not None else None
if fd is not None and os.getppid() == watched:  # (checked after the open: while the watched process is our
    child = os.fork()                            # parent, the pidfd is its, not a later process's with its pid)
    if child:
        print(child, gcs if gcs_fd is not None else "-", flush=True)
        os._exit(0)  # the go-between leaves: the reaper is no child of the watched process (Ray kills an actor's)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # (the watched process reads the pid above until this pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if fd not in select.select([fd] if gcs_fd is None else [fd, gcs_fd], [], [])[0]:
        select.select([fd], [], [], GRACE_S)  # the session ended first (a shutdown): it may still be stopping
else:
    print(os.getpid(), "-", flush=True)  # the watched process is already gone
if session is None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # (this process too: a rank actor's reaper ends here)
driver_runs = fd is not None and not select.select([fd], [], [], 0)[0]
for _ in range(50):  # (again until none is left: one may have started another as it went)
    left = [p for p in pids() if not (driver_runs and p == watched) and of_session(p)]
    if not left:
        break
    for p in left:
        with contextlib.suppress(OSError):  # (gone meanwhile)
            os.kill(p, signal.SIGKILL)
    time.sleep(0.1)
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
    return _start_reaper("rank actor")[0]


def reap_session_with_driver(session_dir: str) -> int | None:
    """Start the reaper that SIGKILLs the processes of the local Ray session ``session_dir`` (the one this
    process, the driver, started) once this process or the session has ended, however it ended (module
    docstring). The reaper's pid; None where there is no pidfd or no /proc (not Linux 5.3+), after saying so
    on stderr: then a driver killed outright leaves Ray's agents running for about a minute."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc/self/fd"):
        print(f"relayrl: driver (pid {os.getpid()}): no pidfds or /proc here; if this driver is killed outright, "
              f"the processes of its Ray session {session_dir} may outlive it: stop them by their pids "
              f"(docs/scale.md), not with `ray stop`, which stops every Ray on this machine",
              file=sys.stderr, flush=True)
        return None
    reaper, gcs = _start_reaper("driver", session_dir)
    if gcs is None:
        print(f"relayrl: driver (pid {os.getpid()}): no gcs_server of Ray session {session_dir} found; its "
              f"reaper (pid {reaper}) ends only with this driver, not at `ray.shutdown()`",
              file=sys.stderr, flush=True)
    return reaper


def _start_reaper(who: str, *args: str) -> tuple[int, int | None]:
    """The reaper's pid and, for a session's, its gcs_server's pid (None: none found)."""
    go_between = subprocess.run([sys.executable, "-I", "-S", "-c", REAPER, str(os.getpid()), *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, close_fds=True)
    said = go_between.stdout.split()
    if go_between.returncode != 0 or len(said) != 2 or not said[0].isdigit():
        raise RuntimeError(f"the reaper of {who} {os.getpid()} did not start (exit {go_between.returncode}, "
                           f"said {go_between.stdout!r})")
    return int(said[0]), int(said[1]) if said[1].isdigit() else None
