"""Ctrl-C stops a driver within seconds even while a worker group's call runs in the background (an ``*_async``
call, a rollout drawn ahead): the driver stops that call's ranks, and what they started, without waiting for
the call, says so in one line, and leaves no process behind. Before, shutting the group down finished the
running call first (measured: 40 s for a 40 s call), and so did the interpreter's exit, which joins the
call's thread."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import ctrl_c, descendants, kill_left, left_after, pids_written

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CALL_S = 60.0  # how long the background call would run
EXIT_S = 10.0  # how soon after Ctrl-C the driver must be gone

DRIVER = """
import sys, time
from relayrl.cluster import ResourcePool, WorkerGroup
from cluster_workers import Parent
if __name__ == '__main__':
    pid_file, seconds, style = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    g = WorkerGroup(Parent, ResourcePool('busy', devices=2), name='busy', distributed=False)
    def body():
        fut = g.all_async('start_child_then_sleep', pid_file, seconds)
        print('PIDS', *g.pids(), flush=True)
        fut.result()  # Ctrl-C lands here: the call goes on in the group's thread
    if style == 'with':
        with g:
            body()
    else:  # a plain script: the interrupt is left uncaught, the interpreter exits
        body()
"""


def _driver(tmp_path: Path, style: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    # a session of its own, SIGINT to its process group as a terminal's Ctrl-C sends it (the ranks lead groups
    # of their own); SIGINT not ignored, as a background shell may leave it
    driver = subprocess.Popen([sys.executable, str(script), str(tmp_path / "kid"), str(CALL_S), style],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = driver.stdout.readline()
    if not line.startswith("PIDS"):
        driver.kill()
        pytest.fail(line + driver.communicate(timeout=10)[1][-3000:])
    return driver, [int(p) for p in line.split()[1:]]


@pytest.mark.parametrize("style", ["plain", "with"])
def test_ctrl_c_during_a_background_call_exits_within_seconds_and_leaves_no_process(tmp_path, style):
    driver, ranks = _driver(tmp_path, style)
    tree: list[int] = []
    try:
        children = pids_written((tmp_path / "kid.0", tmp_path / "kid.1"), driver, 30)  # the call runs on both ranks
        tree = descendants(driver.pid)
        assert set(ranks + children) <= set(tree)
        err, took = ctrl_c(driver, CALL_S - 15, "the background call")
        assert took < EXIT_S, f"the driver took {took:.1f} s to exit after Ctrl-C ({err[-2000:]})"
        assert driver.returncode == -signal.SIGINT, err[-3000:]
        assert ("relayrl: interrupted: stopped the ranks of worker group 'busy' in 'start_child_then_sleep' "
                "without waiting for the call") in err, err[-3000:]
        assert err.count("relayrl: interrupted:") == 1, err[-3000:]
        left = left_after(tree, 5.0)
        assert not left, f"processes {left} (ranks {ranks}, their children {children}) outlived a Ctrl-C"
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(tree)


def test_stopping_the_calls_in_flight_fails_the_running_and_queued_calls_and_spares_an_idle_group(tmp_path):
    from cluster_workers import Parent
    from relayrl.cluster import ResourcePool, WorkerError, WorkerGroup
    from relayrl.cluster.interrupt import stop_calls_in_flight

    busy = WorkerGroup(Parent, ResourcePool("busy", devices=2), name="busy", distributed=False)
    idle = WorkerGroup(Parent, ResourcePool("idle", devices=2), name="idle", distributed=False)
    kids: list[int] = []
    try:
        running = busy.all_async("start_child_then_sleep", str(tmp_path / "kid"), CALL_S)
        queued = busy.all_async("pid")  # behind it in the group's queue
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"kid.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.05)
        kids = [int((tmp_path / f"kid.{r}").read_text()) for r in range(2)]
        t0 = time.monotonic()
        line = stop_calls_in_flight()
        assert line == ("interrupted: stopped the ranks of worker group 'busy' in 'start_child_then_sleep' "
                        "without waiting for the call")
        with pytest.raises(WorkerError) as e:
            running.result(timeout=10)
        assert e.value.lost and time.monotonic() - t0 < EXIT_S
        with pytest.raises(RuntimeError, match="'pid' did not start, the run was interrupted"):
            queued.result(timeout=10)
        # (SIGKILL is delivered, not awaited)
        assert not left_after(busy.pids() + kids, 5.0), "the stopped ranks and what they started are gone"
        assert idle.all("pid") == idle.pids(), "a group with no call in flight is left as it was"
        assert stop_calls_in_flight() is None  # nothing runs any more
    finally:
        busy.shutdown()
        idle.shutdown()
        kill_left(kids)
