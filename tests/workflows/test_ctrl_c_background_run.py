"""Ctrl-C of a training run (``relayrl train``) while a worker group's call runs in the background stops the
run within seconds, says what it stopped and leaves no process: the run's loop stops that call's ranks instead
of waiting for it. Before, the run said "interrupted at step N" and then the process waited for the call to
end (here 60 s) before it exited. (The call is a side group's, started by the test at step 1 and left running;
a rollout drawn ahead is such a call.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from e2e_cli import FAST, ROOT
from tests.procs import ctrl_c, descendants, kill_left, left_after, pids_written

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CALL_S = 60.0
EXIT_S = 10.0

DRIVER = """
import sys
from relayrl.cli.main import main
from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.workflows.session import Session
from cluster_workers import Parent

real, held = Session.end_step, []

def end_step(self, step, *args, **kwargs):
    if step == 1 and not held:  # a call that goes on in the background while the run trains
        g = WorkerGroup(Parent, ResourcePool('side', devices=2), name='side', distributed=False)
        held.append((g, g.all_async('start_child_then_sleep', sys.argv[1], float(sys.argv[2]))))
        print('PIDS', *g.pids(), flush=True)
    return real(self, step, *args, **kwargs)

Session.end_step = end_step
if __name__ == '__main__':
    sys.exit(main(sys.argv[3:]))
"""


def test_ctrl_c_of_a_run_with_a_call_in_the_background_exits_within_seconds(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    path = [str(ROOT / "tests" / "cluster"), str(ROOT / "tests" / "workflows"), str(ROOT),
            os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "kid"), str(CALL_S), "train", "recipes/arith_sft.yaml",
         "trainer.steps=100000", "run.save_every=0", "cluster.devices=2", f"run.dir={run}", *FAST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tree: list[int] = []
    try:
        # (the side call runs on both of its ranks once each wrote its child's pid)
        children = pids_written((tmp_path / "kid.0", tmp_path / "kid.1"), driver, 300)
        tree = descendants(driver.pid)
        assert set(children) <= set(tree)
        err, took = ctrl_c(driver, CALL_S - 15, "the background call")
        assert took < EXIT_S, f"the run took {took:.1f} s to exit after Ctrl-C ({err[-2000:]})"
        assert driver.returncode == 130, err[-3000:]
        assert "Traceback" not in err and "relayrl: interrupted at step " in err, err[-3000:]
        assert ("relayrl: interrupted: stopped the ranks of worker group 'side' in 'start_child_then_sleep' "
                "without waiting for the call") in err, err[-3000:]
        left = left_after(tree, 5.0)
        assert not left, f"processes {left} of the interrupted run (children {children}) are still alive"
    finally:
        if driver.poll() is None:
            driver.kill()
        kill_left(tree)
