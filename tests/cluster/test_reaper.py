"""relayrl/cluster/reaper.py without Ray: a process that leads its group with a reaper (as a Ray rank actor does)
takes what it started, children and grandchildren, with it when it is SIGKILLed; the reaper is no child of it
(Ray kills an actor's direct children first, which would take the reaper before it could act). A driver's
reaper of a (stand-in) Ray session takes the session's processes with the driver, spares other drivers and
readers of its logs, and ends with the session's gcs_server, sweeping what is left."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
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


DRIVER = """
import os, subprocess, sys, time
from relayrl.cluster.reaper import reap_session_with_driver
session = sys.argv[1]
log = open(os.path.join(session, "logs", f"python-core-driver-01_{os.getpid()}.log"), "a")  # (a Ray driver's)
gcs = subprocess.Popen([os.path.join(session, "bin", "gcs_server"), "600"])  # (it names the session)
while not open(f"/proc/{gcs.pid}/cmdline").read().startswith(session):  # (exec'd)
    time.sleep(0.01)
print(os.getpid(), gcs.pid, reap_session_with_driver(session), flush=True)
time.sleep(600)
"""

HOLDER = """
import os, sys, time
log = open(sys.argv[1], "a")
time.sleep(600)
"""


def _session(tmp_path: Path) -> Path:
    """A stand-in of a Ray session directory: logs/, and bin/ of programs that are `sleep` under Ray's names."""
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    (session / "bin").mkdir()
    for name in ("gcs_server", "raylet"):
        (session / "bin" / name).symlink_to(shutil.which("sleep"))
    return session


def _driver(session: Path) -> tuple[subprocess.Popen, list[int]]:
    """A driver of the stand-in session with its reaper: the driver, [its pid, its gcs_server's, its reaper's]."""
    root = str(Path(__file__).parents[2])
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(session)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": root})
    return driver, [int(p) for p in driver.stdout.readline().split()]


def test_a_killed_drivers_reaper_takes_its_sessions_processes_and_spares_drivers_and_readers(tmp_path):
    session = _session(tmp_path)
    logs = session / "logs"
    driver, pids, others = None, [], {}
    try:
        driver, pids = _driver(session)
        with open(logs / "worker-1.out", "a") as out, open(logs / "worker-2.out", "a") as out2:
            others = {  # name: (process, whether the reaper is to kill it)
                "agent": (subprocess.Popen(["sleep", "600"], stdout=out), True),  # (a log of the session as stdout)
                "raylet": (subprocess.Popen([str(session / "bin" / "raylet"), "600"]), True),  # (names it, holds none)
                "driver from an actor": (subprocess.Popen([sys.executable, "-c", HOLDER,
                                                           str(logs / "python-core-driver-03_1.log")], stdout=out2),
                                         True),
                "other driver": (subprocess.Popen([sys.executable, "-c", HOLDER,
                                                   str(logs / "python-core-driver-02_1.log")]), False),
                "tail -f": (subprocess.Popen(["tail", "-f", str(logs / "worker-1.out")]), False),
            }
        time.sleep(0.5)  # (the holders have opened their logs)
        assert all(p.poll() is None for p, _ in others.values())
        os.kill(pids[0], signal.SIGKILL)
        driver.wait(timeout=10)
        assert not left_after(pids[1:], 10.0), "the driver's gcs_server or reaper outlived it"
        assert [name for name, (p, killed) in others.items() if alive(p.pid) == killed] == []
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(pids + [p.pid for p, _ in others.values()])
        for p, _ in others.values():
            p.wait(timeout=10)


def test_a_drivers_reaper_ends_with_its_session_and_takes_what_is_left_of_it(tmp_path):
    session = _session(tmp_path)
    driver, pids, agent = None, [], None
    try:
        driver, pids = _driver(session)
        with open(session / "logs" / "worker-1.out", "a") as out:
            agent = subprocess.Popen(["sleep", "600"], stdout=out)
        me, gcs, reaper = pids
        os.kill(gcs, signal.SIGKILL)  # (the session ends: `ray.shutdown()` stops its gcs_server)
        assert not left_after([reaper, agent.pid], 10.0), "the reaper did not end with its session, or spared a leftover"
        assert alive(me), "the reaper killed its driver, which still holds its own log under the session"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(pids + ([agent.pid] if agent else []))
