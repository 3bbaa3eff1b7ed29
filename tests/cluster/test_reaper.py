"""relayrl/cluster/reaper.py without Ray: a process that leads its group with a reaper (as a Ray rank actor does)
takes what it started, children and grandchildren, with it when it is SIGKILLed; the reaper is no child of it
(Ray kills an actor's direct children first, which would take the reaper before it could act). A driver's
reaper of a (stand-in) Ray session takes the session's processes (those that inherited its mark, whether or not
they hold a file of the session, and what writes its stdout to a log of the session) with the driver, killed
after its Ray started or inside ``ray.init``; it spares other drivers, readers of its logs, another session's
processes and what the driver starts after ``ray.init``; and it ends with the session's gcs_server once Ray's
shutdown has stopped its head processes, however long they take, sweeping what is left."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.cluster.reaper import MARK
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


DRIVER = """
import os, subprocess, sys, time
from relayrl.cluster.reaper import SessionReaper
session, when = sys.argv[1], sys.argv[2]
log = open(os.path.join(session, "logs", f"python-core-driver-01_{os.getpid()}.log"), "a")  # (a Ray driver's)
reaper = SessionReaper.arm()
# what `ray.init` starts: the gcs_server, a head process (which Ray's shutdown stops) taking 3 s to stop once the
# gcs_server has ended, an agent that holds no file (Ray's logs to stderr) and names no session (a process title)
gcs = subprocess.Popen([os.path.join(session, "bin", "gcs_server"), "600"])  # (it names the session)
head = subprocess.Popen([sys.executable, "-c", sys.argv[3], str(gcs.pid), session])  # (names it, holds none)
sh = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True)  # (an orphan)
agent = int(sh.stdout.readline())
sh.wait()
print(os.getpid(), reaper.pid, gcs.pid, head.pid, agent, end=" ", flush=True)
if when == "inside ray.init":
    os.kill(os.getpid(), 9)
reaper.started(session)
mine = subprocess.Popen(["sleep", "600"])  # (this driver's, started after ray.init: none of the session's)
print(mine.pid, flush=True)
print("HEAD", head.wait(), flush=True)
time.sleep(600)
"""

HEAD = "import os, select, sys, time; select.select([os.pidfd_open(int(sys.argv[1]))], [], []); time.sleep(3)"

HOLDER = """
import os, sys, time
log = open(sys.argv[1], "a")
time.sleep(600)
"""


def _session(tmp_path: Path) -> Path:
    """A stand-in of a Ray session directory: logs/, and bin/gcs_server, a `sleep` under Ray's name."""
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    (session / "bin").mkdir()
    (session / "bin" / "gcs_server").symlink_to(shutil.which("sleep"))
    return session


def _driver(session: Path, when: str = "after ray.init") -> tuple[subprocess.Popen, list[int]]:
    """A driver of the stand-in session, its reaper armed before its stand-in `ray.init`, killing itself
    ``when`` "inside ray.init": the driver, [its pid, its reaper's, its gcs_server's, the head's, the agent's,
    (after ray.init) the driver's own child's]."""
    root = str(Path(__file__).parents[2])
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(session), when, HEAD], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": root})
    return driver, [int(p) for p in driver.stdout.readline().split()]


def _others(logs: Path) -> dict[str, tuple[subprocess.Popen, bool]]:
    """Processes beside the driver's, started by this test (none inherits the driver's mark): name: (process,
    whether the driver's reaper is to kill it)."""
    with open(logs / "worker-1.out", "a") as out, open(logs / "worker-2.out", "a") as out2:
        return {
            "worker's child with an environment of its own": (subprocess.Popen(["sleep", "600"], stdout=out), True),
            "driver from an actor": (subprocess.Popen([sys.executable, "-c", HOLDER,
                                                       str(logs / "python-core-driver-03_1.log")], stdout=out2), True),
            "other driver": (subprocess.Popen([sys.executable, "-c", HOLDER,
                                               str(logs / "python-core-driver-02_1.log")]), False),
            "tail -f": (subprocess.Popen(["tail", "-f", str(logs / "worker-1.out")]), False),
            "another session's": (subprocess.Popen(["sleep", "600"], env={**os.environ, MARK: "0" * 32}), False),
        }


def test_a_killed_drivers_reaper_takes_its_sessions_processes_and_spares_the_rest(tmp_path):
    session = _session(tmp_path)
    driver, pids, others = None, [], {}
    try:
        driver, pids = _driver(session)
        others = _others(session / "logs")
        time.sleep(0.5)  # (the holders have opened their logs)
        assert all(p.poll() is None for p, _ in others.values())
        me, reaper, gcs, head, agent, mine = pids
        os.kill(me, signal.SIGKILL)
        driver.wait(timeout=10)
        assert not left_after([reaper, gcs, head, agent], 10.0), "the session's processes or its reaper outlived it"
        assert [name for name, (p, killed) in others.items() if alive(p.pid) == killed] == []
        assert alive(mine), "the reaper killed what the driver started after ray.init"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(pids + [p.pid for p, _ in others.values()])
        for p, _ in others.values():
            p.wait(timeout=10)


def test_a_driver_killed_inside_ray_init_leaves_none_of_its_session(tmp_path):
    session = _session(tmp_path)
    driver, pids = None, []
    try:
        driver, pids = _driver(session, "inside ray.init")
        assert len(pids) == 5, pids
        driver.wait(timeout=10)
        assert driver.returncode == -signal.SIGKILL
        assert not left_after(pids[1:], 10.0), "the session's processes or its reaper outlived the driver"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(pids)


def test_a_drivers_reaper_ends_with_its_session_once_rays_shutdown_has_stopped_it(tmp_path):
    session = _session(tmp_path)
    driver, pids = None, []
    try:
        driver, pids = _driver(session)
        me, reaper, gcs, head, agent, mine = pids
        t0 = time.monotonic()
        os.kill(gcs, signal.SIGKILL)  # (the session ends: `ray.shutdown()` stops its gcs_server, then the rest)
        assert driver.stdout.readline().split() == ["HEAD", "0"], "the reaper SIGKILLed a head process stopping"
        assert not left_after([reaper, agent], 10.0), "the reaper did not end with its session, or spared a leftover"
        took = time.monotonic() - t0
        assert 3.0 <= took < 8.0, f"the reaper ended {took:.1f} s after the gcs_server, not soon after the head"
        assert alive(me), "the reaper killed its driver"
        assert alive(mine), "the reaper killed what the driver started after ray.init"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(pids)
