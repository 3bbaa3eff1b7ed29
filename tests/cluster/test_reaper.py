"""relayrl/cluster/reaper.py without Ray: a process that leads its group with a reaper (as a Ray rank actor does)
takes what it started, children and grandchildren, with it when it is SIGKILLed; the reaper is no child of it
(Ray kills an actor's direct children first, which would take the reaper before it could act)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import alive, kill_left, left_after

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds")]

ACTOR = """
import os, subprocess, sys, time
from relayrl.cluster.reaper import lead_group_with_reaper
reaper = lead_group_with_reaper()
sh = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
print(os.getpid(), reaper, sh.pid, sh.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def test_a_killed_group_leader_takes_its_children_and_theirs_with_it():
    root = str(Path(__file__).parents[2])
    actor = subprocess.Popen([sys.executable, "-c", ACTOR], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    pids: list[int] = []
    try:
        pids = [int(p) for p in actor.stdout.readline().split()]
        me, reaper, sh, sleep = pids
        assert [os.getpgid(p) for p in pids] == [me] * 4, "the actor leads a group that all it started joins"
        with open(f"/proc/{reaper}/stat") as f:
            assert int(f.read().rsplit(") ", 1)[1].split()[1]) != me, "the reaper is no child of the actor"
        assert alive(reaper) and alive(sleep)
        os.kill(me, signal.SIGKILL)
        actor.wait(timeout=10)
        left = left_after(pids, 10.0)
        assert not left, f"processes {left} (reaper {reaper}, shell {sh}, its child {sleep}) outlived the actor"
    finally:
        if actor.poll() is None:
            actor.kill()
        kill_left(pids)
