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

A driver that starts a local Ray itself (no ``cluster.ray_address``) gets one too, for that Ray's session
(:class:`SessionReaper`). A driver SIGKILLed (the OOM killer, ``kill -9``, a CI timeout) takes Ray's head
processes with it (Ray starts them with ``PR_SET_PDEATHSIG``: gcs_server, raylet, monitor, dashboard, log
monitor), its actors leave within about 2 s of their raylet, but the raylet's two agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) ran on about 62 s (measured, Ray 2.60): they see the raylet gone, then report it to the
dead control store with a fixed 60 s timeout (``ray/_private/process_watcher.py``: ``publish_error_to_driver``)
before they exit.

Which processes are the session's: before ``ray.init`` the driver puts a random token in its environment
(``RELAYRL_RAY_SESSION``), which every process that Ray starts inherits (its head processes, the raylet's agents
and workers, what those start: measured, Ray 2.60; :data:`KEEP_ENVIRON` keeps Ray's process titles off it), and
takes it out again once ``ray.init`` has returned. The
reaper finds them by it in ``/proc/<pid>/environ``, whether Ray writes log files or not (``RAY_LOG_TO_STDERR=1``
writes none, and the agents' process titles name no session), and spares what did not come from that Ray: the
driver itself (``/proc`` shows the environment a process was started with), another driver connected to that
Ray (``ray.init(address=...)``), a reader of the session's logs (``tail -f``), another driver's Ray session (its
own token). Found too: a process whose stdout or stderr is a file under the session directory (what a worker
starts with an environment of its own inherits the worker's log as stdout, where Ray writes log files). Not
found: a process of the session that both drops the token from its environment and writes no log there (a
rank actor's own reaper takes what a rank started, its process group); taken beside the session's: a process
another thread of the driver starts while ``ray.init`` runs (it inherits the token too).

When: the reaper is started, and the token set, before ``ray.init``, so a driver killed inside it (its Ray's
processes started, ``ray.init`` not returned) leaves none either. It waits on the driver's pidfd and on a pipe
on which the driver writes one line once ``ray.init`` has returned (the session directory; ``-`` if it failed:
the reaper then takes what that Ray left and ends); from then on on the driver's pidfd and the session's
gcs_server's (the session's process so named), and ends with whichever ends first, so a driver that calls
``ray.shutdown()`` and starts Ray again (a notebook, a sweep, a test process) keeps one reaper per live session,
not one per session it ever started. The gcs_server rather than the pipe's end: ``ray.shutdown()`` is the user's
call, with no hook of relayrl's in it, and every fork of the driver (a data loader's workers) holds the pipe's
write end; a local Ray's session cannot outlive its gcs_server (no fault-tolerant store behind it), which
``ray.shutdown()`` stops and the driver's death takes with it. Its session ended first, the reaper waits for
the session's processes that the driver started (Ray's head processes, which ``ray.shutdown()`` stops: pidfds)
to end, or the driver, for at most ``SHUTDOWN_S`` (10 s; an unloaded shutdown takes about 1 s), then SIGKILLs
what is left of the session (nothing, after a clean shutdown). A driver connected to a cluster it did not
start gets no such reaper: Ray ends the driver's actors with it (their owner), their reapers what they
started, and the cluster stays.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys

MARK = "RELAYRL_RAY_SESSION"
"""The environment variable whose value (a random token) marks the processes of one local Ray session."""
KEEP_ENVIRON = {"SPT_NOENV": "1"}
"""Set with the mark: Ray's workers and agents set their process titles (``ray::IDLE``) with setproctitle (Ray's
own copy), which writes a long title over the process's environment block, and so over the mark as /proc shows
it (measured: an agent's first ~1.1 kB zeroed), unless ``SPT_NOENV`` is set (then a title is at most as long as
the command line it replaces: Ray's are hundreds of bytes)."""

REAPER = r"""
import contextlib, os, select, signal, sys, time
watched = int(sys.argv[1])
mark = b"\0%s=%s\0" % (sys.argv[2].encode(), sys.argv[3].encode()) if len(sys.argv) > 3 else None  # (None: a
told = int(sys.argv[4]) if mark else None  # rank actor's own group) the pipe on which the driver says Ray is up
SHUTDOWN_S = 10.0  # a session ended before its driver: how long Ray's shutdown may take to stop its head processes
session = None  # the session directory, once the driver has said it


def pids():
    return [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if p != os.getpid()]


def marked(pid):  # whether pid came from this session's Ray (it inherited the token the driver set for ray.init)
    with open(f"/proc/{pid}/environ", "rb") as f:
        return mark in b"\0" + f.read()


def logs_to_session(pid):  # whether pid's stdout or stderr is a file under the session directory
    for fd in (1, 2):
        with contextlib.suppress(OSError):  # (closed)
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(session + "/"):
                return True
    return False


def of_session(pid):
    try:
        return marked(pid) or (session is not None and logs_to_session(pid))
    except OSError:  # (gone meanwhile, or not ours to read)
        return False


def pidfd(pid, of_this_session=False):
    # None: gone (or, of_this_session, no longer the session's: its pid reused between the scan and the open)
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
        if not of_this_session or marked(pid):
            return fd
        os.close(fd)
    return None


def scan(gcs_only):  # pidfds of the session's gcs_server ([] if none), or of its processes the driver started
    out = []
    for p in pids():
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/stat") as f:
                parent = int(f.read().rsplit(") ", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0")[0])
            if (program == b"gcs_server" if gcs_only else parent == watched) and marked(p):
                out += [fd for fd in [pidfd(p, of_this_session=True)] if fd is not None]
    return out


def ended(fd):
    return fd in select.select([fd], [], [], 0)[0]


fd = pidfd(watched)
if fd is not None and os.getppid() == watched:  # (checked after the open: while the watched process is our
    child = os.fork()                            # parent, the pidfd is its, not a later process's with its pid)
    if child:
        print(child, flush=True)
        os._exit(0)  # the go-between leaves: the reaper is no child of the watched process (Ray kills an actor's)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # (the watched process reads the pid above until this pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mark is None:
        select.select([fd], [], [])
    elif fd not in select.select([fd, told], [], [])[0]:  # the driver's ray.init returned (a line < PIPE_BUF: whole)
        said = os.read(told, 4096).decode().strip()
        session = os.path.realpath(said) if said not in ("", "-") else None  # (None: ray.init failed)
        gcs = scan(gcs_only=True) if session else []  # ([]: ray.init failed, or the session ended already)
        if gcs:
            select.select([fd, *gcs], [], [])
        heads, deadline = scan(gcs_only=False), time.monotonic() + SHUTDOWN_S  # the session ended first (or
        while heads and not ended(fd) and time.monotonic() < deadline:       # never started): Ray's shutdown
            ready = select.select([fd, *heads], [], [], max(0.0, deadline - time.monotonic()))[0]  # stops these
            heads = [h for h in heads if h not in ready]
else:
    print(os.getpid(), flush=True)  # the watched process is already gone
if mark is None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # (this process too: a rank actor's reaper ends here)
driver_runs = fd is not None and not ended(fd)
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
    return _start_reaper("rank actor")


class SessionReaper:
    """The reaper of the local Ray session this process (the driver) is about to start (module docstring):
    :meth:`arm` it before ``ray.init``, tell it :meth:`started` once ``ray.init`` has returned or failed."""

    def __init__(self, pid: int | None, tell: int | None, before: dict[str, str | None]) -> None:
        self.pid = pid
        """The reaper's pid; None where there is none (no pidfds or no /proc)."""
        self._tell, self._before = tell, before

    @classmethod
    def arm(cls) -> SessionReaper:
        """Start the reaper, then mark this process's environment (and keep process titles off it:
        :data:`KEEP_ENVIRON`), which the Ray it starts next inherits. Where
        there is no pidfd or no /proc (not Linux 5.3+), say so on stderr and start none: then a driver killed
        outright leaves Ray's agents running for about a minute."""
        before = {k: os.environ.get(k) for k in (MARK, *KEEP_ENVIRON)}
        if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc/self/fd"):
            print(f"relayrl: driver (pid {os.getpid()}): no pidfds or /proc here; if this driver is killed outright, "
                  f"the processes of its local Ray session may outlive it: stop them by their pids (docs/scale.md), "
                  f"not with `ray stop`, which stops every Ray on this machine", file=sys.stderr, flush=True)
            return cls(None, None, before)
        token = secrets.token_hex(16)
        read, tell = os.pipe()
        try:
            pid = _start_reaper("driver", MARK, token, str(read), pass_fds=(read,))
        except BaseException:
            os.close(tell)
            raise
        finally:
            os.close(read)
        os.environ.update({**KEEP_ENVIRON, MARK: token})
        return cls(pid, tell, before)

    def started(self, session_dir: str | None) -> None:
        """``ray.init`` has returned: the session directory of the Ray it started, or None where it raised (the
        reaper then SIGKILLs what that Ray left and ends). Puts this process's environment back as it was (a
        process it starts from now on is none of that Ray's)."""
        for key, value in self._before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._tell is not None:
            with contextlib.suppress(OSError):  # (the reaper gone: killed by hand)
                os.write(self._tell, f"{session_dir or '-'}\n".encode())
            os.close(self._tell)
            self._tell = None


def _start_reaper(who: str, *args: str, pass_fds: tuple[int, ...] = ()) -> int:
    """The reaper's pid."""
    go_between = subprocess.run([sys.executable, "-I", "-S", "-c", REAPER, str(os.getpid()), *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
    said = go_between.stdout.split()
    if go_between.returncode != 0 or len(said) != 1 or not said[0].isdigit():
        raise RuntimeError(f"the reaper of {who} {os.getpid()} did not start (exit {go_between.returncode}, "
                           f"said {go_between.stdout!r})")
    return int(said[0])
