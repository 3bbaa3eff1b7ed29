"""A driver killed outright (SIGKILL: the OOM killer, a scheduler's preemption) leaves no rank process behind,
even one busy in a call and one stuck in a collective waiting for it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import alive, kill_left, left_after

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DRIVER = """
import sys, time
from relayrl.cluster import ResourcePool, WorkerGroup
from cluster_workers import Echo
if __name__ == '__main__':
    g = WorkerGroup(Echo, ResourcePool('orphans', devices=2), name='orphans', distributed=True)
    g.all_async('sleep_then_reduce', sleeper=1, hold_s=600.0)  # rank 1 sleeps, rank 0 waits in all_reduce
    print('PIDS', *g.pids(), flush=True)
    time.sleep(600)
"""


def test_rank_processes_leave_when_the_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    ranks: list[int] = []
    try:
        line = driver.stdout.readline()
        assert line.startswith("PIDS"), line + driver.stderr.read()[-2000:]
        ranks = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # (the call has reached both ranks)
        assert all(alive(p) for p in ranks)
        driver.kill()
        driver.wait(timeout=10)
        left = left_after(ranks, 10.0)
        assert not left, f"rank processes {left} outlived their driver"
        assert "the driver (pid" in driver.stderr.read()  # each rank said why it left (on the shared stderr)
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(ranks)
