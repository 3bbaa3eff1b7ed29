"""The process checks of tests/procs.py, on real processes: a running one, a zombie, one that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.procs import alive, descendants, kill_left, left_after, running

pytestmark = pytest.mark.multiproc

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_zombie_counts_as_gone_and_a_reaped_process_too():
    p = subprocess.Popen(SLEEP)
    try:
        assert alive(p.pid) and running([p.pid]) == [p.pid]
        p.kill()
        deadline = time.monotonic() + 10
        while alive(p.pid):  # (not reaped yet: a zombie)
            assert time.monotonic() < deadline, f"pid {p.pid} still runs after SIGKILL"
            time.sleep(0.01)
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        p.kill()
        p.wait()
    assert not alive(p.pid) and left_after([p.pid], 0.0) == []


def test_left_after_waits_for_the_deadline_and_kill_left_ends_what_is_left():
    a, b = subprocess.Popen(SLEEP), subprocess.Popen(SLEEP)
    try:
        b.kill()
        b.wait()
        t0 = time.monotonic()
        assert left_after([a.pid, b.pid], 0.3) == [a.pid]
        assert time.monotonic() - t0 >= 0.3
        kill_left([a.pid, b.pid])  # (b is gone: skipped)
        a.wait(timeout=10)
        assert a.returncode == -9
    finally:
        a.kill()
        a.wait()


def test_descendants_finds_grandchildren_and_skips_by_command_line():
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen({SLEEP!r})\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, "marker-of-the-child"], stdout=subprocess.PIPE, text=True)
    tree: list[int] = []
    try:
        assert p.stdout.readline() == "started\n"
        tree = descendants(p.pid)
        assert len(tree) == 1 and tree[0] != p.pid  # the grandchild of this process
        mine = descendants()
        assert p.pid in mine and tree[0] in mine
        assert p.pid not in descendants(skip_cmdline="marker-of-the-child")
    finally:
        kill_left(tree)
        p.kill()
        p.wait()
    assert descendants(p.pid) == []
    assert os.getpid() not in descendants()
