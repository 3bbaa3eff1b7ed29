"""Process checks for the tests that kill a parent and look for what it left behind (Linux: reads /proc).

A zombie counts as gone everywhere here: it has ended, only its parent has not reaped it yet (a parent killed
outright never will, until init does).
"""

from __future__ import annotations

import os
import signal
import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running: it exists and is neither a zombie (``Z``) nor dead (``X``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # (the command in parentheses may hold spaces)
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are running now, in their order."""
    return [p for p in pids if alive(p)]


def left_after(pids: list[int], within_s: float, every_s: float = 0.1) -> list[int]:
    """Poll every ``every_s`` seconds until none of ``pids`` runs or ``within_s`` seconds have passed; those
    still running then (empty: all gone in time)."""
    deadline = time.monotonic() + within_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(every_s)
    return running(pids)


def kill_left(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still runs (a test's cleanup); one gone already, or gone meanwhile, is
    skipped."""
    for pid in running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int | None = None, *, skip_cmdline: str | None = None) -> list[int]:
    """The running descendants of ``pid`` (default: this process), children's children included; empty if
    ``pid`` itself is gone. ``skip_cmdline``: leave out those whose command line contains it (e.g.
    ``"resource_tracker"``, multiprocessing's helper that lives as long as its owner)."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in tree:
        try:
            if skip_cmdline is not None and skip_cmdline in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:  # (ended since: ZombieProcess is one)
            continue
        if alive(p.pid):
            out.append(p.pid)
    return out


def pids_written(files, proc, within_s: float) -> list[int]:
    """The pids that processes ``proc`` started wrote into ``files`` (one each), once every file holds one; fails
    the test (showing ``proc``'s stderr) if ``proc`` ends or ``within_s`` passes first."""
    import pytest

    deadline = time.monotonic() + within_s
    while not all(f.exists() and f.read_text() for f in files):
        if proc.poll() is not None or time.monotonic() >= deadline:
            pytest.fail(f"the pid files {[str(f) for f in files]} were not all written: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def ctrl_c(proc, within_s: float, what: str) -> tuple[str, float]:
    """Ctrl-C to ``proc`` (SIGINT to its process group): its stderr and the seconds it took to exit; fails the
    test (killing ``proc``) if it still runs after ``within_s``, naming ``what`` it must not have waited for."""
    import subprocess

    import pytest

    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"it still ran {within_s:.0f} s after Ctrl-C: it waited for {what}")
    return err, time.monotonic() - t0


def holding(path: str) -> list[int]:
    """The running processes (other than this one) with ``path`` in their command line or a file open under it:
    those of a Ray session, for ``path`` its session directory (Ray's processes keep their logs there; its
    workers' stdout is a log there, which what they start inherits)."""
    path = os.path.realpath(path)
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid() or not alive(pid):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # (gone meanwhile, or not ours)
            continue
        hit = any(f"{path}{end}".encode() in cmdline for end in "/\0")
        for fd in fds if not hit else ():
            try:
                hit = os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path + "/")
            except OSError:
                continue
            if hit:
                break
        if hit:
            out.append(pid)
    return out
