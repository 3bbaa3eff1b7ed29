"""What a rank process starts (a vLLM engine core, a user's reward server: anything that does not start a session
of its own) goes with the rank: each rank leads a process group of its own, which the driver stops after the
rank, however the rank ended (shutdown, a call timeout, killed outright), and which a rank whose driver was
killed stops itself. Before, such children ran on, orphaned, after every one of these. Ctrl-C still stops the
lot: the driver gets it and shuts its ranks down."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_workers import Parent
from relayrl.cluster import CallTimeout, ClusterConfig, ResourcePool, WorkerError, WorkerGroup
from tests.procs import alive, kill_left, left_after

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WAIT_S = 15.0  # the deadline for what a rank started to be gone once the rank is

DRIVER = """
import sys, time
from relayrl.cluster import ResourcePool, WorkerGroup
from cluster_workers import Parent
if __name__ == '__main__':
    g = WorkerGroup(Parent, ResourcePool('kids', devices=2), name='kids', distributed=False)
    print('PIDS', *g.pids(), *g.all('start_child'), flush=True)
    time.sleep(600)
"""


@pytest.fixture()
def group():
    g = WorkerGroup(Parent, ResourcePool("kids", devices=2), name="kids", distributed=False)
    yield g
    g.shutdown()


def test_what_a_rank_started_goes_with_it_at_shutdown(group):
    kids = group.all("start_child")
    try:
        assert all(alive(p) for p in kids)
        group.shutdown()
        assert not left_after(kids, WAIT_S), f"processes {kids} the ranks started outlived the group's shutdown"
    finally:
        kill_left(kids)


def test_what_a_rank_killed_outright_started_is_stopped_with_the_group(group):
    kids = group.all("start_child")
    try:
        os.kill(group.pids()[1], signal.SIGKILL)  # (the OOM killer)
        with pytest.raises(WorkerError) as e:
            group.all("pid")
        assert e.value.lost and e.value.rank == 1
        group.shutdown()
        assert not left_after(kids, WAIT_S), f"processes {kids} the ranks started outlived a rank killed with SIGKILL"
    finally:
        kill_left(kids)


def test_a_call_timeout_stops_what_the_hung_ranks_started(tmp_path):
    g = WorkerGroup(Parent, ResourcePool("hung", devices=2), name="hung", distributed=False,
                    backend=ClusterConfig(call_timeout_s=3.0))
    kids: list[int] = []
    try:
        with pytest.raises(CallTimeout):
            g.all("start_child_then_hang", str(tmp_path / "pid"))
        kids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
        assert not left_after(kids, WAIT_S), f"processes {kids} the hung ranks started outlived the call timeout"
    finally:
        g.shutdown()
        kill_left(kids)


def _driver(tmp_path: Path, **popen) -> tuple[subprocess.Popen, list[int], list[int]]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    here = Path(__file__).parent
    path = [str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, **popen)
    line = driver.stdout.readline()
    if not line.startswith("PIDS"):
        driver.kill()
        pytest.fail(line + driver.communicate(timeout=10)[1][-3000:])
    pids = [int(p) for p in line.split()[1:]]
    return driver, pids[:2], pids[2:]


def test_a_killed_driver_leaves_no_rank_and_nothing_a_rank_started(tmp_path):
    driver, ranks, kids = _driver(tmp_path)
    try:
        assert all(alive(p) for p in ranks + kids)
        driver.kill()
        driver.wait(timeout=10)
        left = left_after(ranks + kids, WAIT_S)
        assert not left, f"processes {left} (ranks {ranks}, their children {kids}) outlived their driver (SIGKILL)"
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(ranks + kids)


def test_ctrl_c_of_the_driver_stops_the_ranks_and_what_they_started(tmp_path):
    # SIGINT to the driver's process group, as a terminal's Ctrl-C sends it (the ranks lead groups of their own)
    driver, ranks, kids = _driver(tmp_path, start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert all(os.getpgid(p) == p for p in ranks), "each rank leads a process group of its own"
        os.killpg(driver.pid, signal.SIGINT)
        driver.wait(timeout=60)
        left = left_after(ranks + kids, WAIT_S)
        assert not left, f"processes {left} (ranks {ranks}, their children {kids}) outlived a Ctrl-C of the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(ranks + kids)


def test_each_ranks_process_group_is_stopped_once(group, monkeypatch):
    """A stopped group's id is a free pid again (a new session may take it as its own): a second stop, the
    shutdown after a call timeout, must not signal it again."""
    from relayrl.cluster import local

    stopped: list[int] = []
    monkeypatch.setattr(local, "stop_process_group", stopped.append)
    ranks = group._ranks
    ranks._stop()
    ranks._stop()
    assert sorted(stopped) == sorted(group.pids())
