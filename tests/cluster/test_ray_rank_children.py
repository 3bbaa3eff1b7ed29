"""On Ray, what a rank actor started (a vLLM engine core out of process and its workers, a user's server) goes
with the actor, however the actor ended: `ray.kill` (a call timeout, Ctrl-C's stop of the calls in flight, a
shutdown), SIGKILL (the OOM killer), a driver gone. Ray 2.60 does this itself where its process-group clean-up
is on (its default); these tests start Ray with it off (an older Ray, a cluster started so), where before
grandchildren outlived `ray.kill` and every child outlived a SIGKILLed actor (each rank actor now leads a
process group with a reaper in it: relayrl/cluster/reaper.py)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster_workers import Parent
from ray_local import local_ray
from relayrl.cluster import ResourcePool, WorkerError, make_group
from tests.procs import alive, kill_left, left_after

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")]

RAY_OWN = "RAY_process_group_cleanup_enabled"  # read by the raylet when it starts


@pytest.fixture(scope="module")
def ray_without_cleanup():
    old = os.environ.get(RAY_OWN)
    os.environ[RAY_OWN] = "false"
    try:
        yield from local_ray(2)
    finally:
        if old is None:
            os.environ.pop(RAY_OWN, None)
        else:
            os.environ[RAY_OWN] = old


def _started(g) -> list[int]:
    """Every process the group's ranks started: a child each, and a shell each with its own child."""
    return [*g.all("start_child"), *(p for pair in g.all("start_grandchild") for p in pair)]


@pytest.mark.parametrize("how", ["ray.kill", "sigkill", "shutdown"])
def test_what_a_rank_actor_started_goes_with_the_actor(ray_without_cleanup, how):
    g = make_group(ray_without_cleanup, Parent, ResourcePool(f"kids-{how}", devices=2), "kids", distributed=False)
    kids: list[int] = []
    try:
        kids = _started(g)
        assert len(kids) == 6 and all(alive(p) for p in kids)
        if how == "ray.kill":  # (a call timeout, Ctrl-C's stop of the calls in flight)
            g._ranks.stop_now(0.0)
        elif how == "sigkill":  # (the OOM killer)
            os.kill(g.pids()[1], signal.SIGKILL)
            with pytest.raises(WorkerError) as e:
                g.all("pid")
            assert e.value.lost and e.value.rank == 1
            left = left_after([kids[1], kids[4], kids[5]], 15.0)  # rank 1's child, its shell and the shell's child
            assert not left, f"processes {left} a SIGKILLed rank actor started outlived it"
        g.shutdown()
        left = left_after(kids, 15.0)
        assert not left, f"processes {left} of {kids} the rank actors started outlived {how}"
    finally:
        g.shutdown()
        kill_left(kids)


DRIVER = """
import os, sys, time
os.environ["{own}"] = "false"
sys.path[:0] = {path!r}
from ray_local import local_ray
from relayrl.cluster import ResourcePool, make_group
from cluster_workers import Parent
cfg = next(local_ray(2))
g = make_group(cfg, Parent, ResourcePool("kids", devices=2), "kids", distributed=False)
print("PIDS", *g.pids(), *g.all("start_child"), *(p for pair in g.all("start_grandchild") for p in pair), flush=True)
time.sleep(600)
"""


def test_a_killed_driver_leaves_nothing_a_rank_actor_started(tmp_path):
    here = Path(__file__).parent
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(own=RAY_OWN, path=[str(here.parents[1]), str(here)])))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    pids: list[int] = []
    try:
        line = driver.stdout.readline()
        if not line.startswith("PIDS"):
            driver.kill()
            pytest.fail(line + driver.communicate(timeout=10)[1][-3000:])
        pids = [int(p) for p in line.split()[1:]]
        assert all(alive(p) for p in pids)
        driver.kill()  # SIGKILL: no ray.shutdown, no atexit
        driver.wait(timeout=10)
        left = left_after(pids, 30.0)
        assert not left, f"processes {left} (actors {pids[:2]}, what they started {pids[2:]}) outlived the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(pids)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)  # (Ray's own processes the driver started, if any are left)
