"""A sandboxed run ends with the process that started it, even one killed outright (SIGKILL: the OOM killer, a
rank stopped by ``cluster.call_timeout_s``, a driver killed while its ranks run tools): pid 1 of the jail leaves
when its lifeline pipe closes, so nothing of the run is left. Before, ``unshare``, pid 1 and the code ran on in
a session of their own until the code ended by itself (a ``sleep`` for ever)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relayrl.environments.sandbox import check_available
from tests.procs import descendants, kill_left, left_after

try:
    check_available()
    HAVE_SANDBOX = True
except RuntimeError:
    HAVE_SANDBOX = False

pytestmark = [pytest.mark.slow, pytest.mark.multiproc,
              pytest.mark.skipif(not HAVE_SANDBOX, reason="the sandbox needs Linux, unshare, libseccomp and root "
                                 "or user namespaces")]

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = "import time\ntime.sleep(300)"
WAIT_S = 15.0  # the deadline for what was started to be gone after its parent is killed

RUNNER = f"""
from relayrl.environments.sandbox import SandboxConfig, run_python
run_python({SLEEPER!r}, SandboxConfig(wall_s=300))
"""

JAILER = f"""
from relayrl.cluster import Worker
from relayrl.environments.sandbox import SandboxConfig, run_python


class Jailer(Worker):
    def run(self) -> str | None:
        return run_python({SLEEPER!r}, SandboxConfig(wall_s=300)).error
"""

DRIVER = """
import time
from relayrl.cluster import ResourcePool, WorkerGroup
from jailer import Jailer
if __name__ == '__main__':
    g = WorkerGroup(Jailer, ResourcePool('jails', devices=2), name='jails', distributed=False)
    g.all_async('run')
    time.sleep(600)
"""


def _jailed(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are sandboxed code (``python ... /work/main.py`` inside the jail)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[-2:-1] == [b"/work/main.py"]:
                    out.append(pid)
        except OSError:
            continue
    return out


def _kill_when_jailed(parent: subprocess.Popen, n: int, within_s: float) -> list[int]:
    """Wait until ``n`` sandboxed programs run under ``parent``, then SIGKILL ``parent``; the tree it had."""
    deadline = time.monotonic() + within_s
    while len(_jailed(descendants(parent.pid))) < n:
        if parent.poll() is not None or time.monotonic() > deadline:
            out, err = parent.communicate(timeout=5)
            pytest.fail(f"{n} sandboxed programs did not start under pid {parent.pid} within {within_s:g} s "
                        f"(exit {parent.returncode}): {err[-3000:]}")
        time.sleep(0.1)
    tree = descendants(parent.pid)
    parent.kill()
    parent.wait(timeout=10)
    return tree


def _left_after(tree: list[int], within_s: float = WAIT_S) -> list[str]:
    """Those of ``tree`` still running after up to ``within_s`` seconds, each with its command line."""
    left = []
    for pid in left_after(tree, within_s):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        left.append(f"{pid}: {cmd[:100]}")
    return left


def _cleanup(parent: subprocess.Popen, tree: list[int]) -> None:
    if parent.poll() is None:
        parent.kill()
        parent.wait(timeout=10)
    kill_left(tree + descendants(parent.pid))  # (unshare first: --kill-child takes the jail with it)


def _env(*extra: Path) -> dict[str, str]:
    path = [*map(str, extra), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_a_run_ends_when_the_process_running_it_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", RUNNER], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    tree: list[int] = []
    try:
        tree = _kill_when_jailed(parent, 1, within_s=60.0)
        assert len(tree) >= 3, tree  # unshare, pid 1 of the jail, the code
        left = _left_after(tree)
        assert not left, f"the sandbox outlived the process running it (SIGKILL): {left}"
    finally:
        _cleanup(parent, tree)


def test_a_killed_driver_leaves_no_rank_and_no_sandbox_of_a_rank(tmp_path):
    (tmp_path / "jailer.py").write_text(textwrap.dedent(JAILER))
    (tmp_path / "driver.py").write_text(DRIVER)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "driver.py")], env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree: list[int] = []
    try:
        tree = _kill_when_jailed(parent, 2, within_s=120.0)  # (the ranks import torch first)
        left = _left_after(tree)
        assert not left, f"processes outlived their driver (SIGKILL) while its ranks ran sandboxes: {left}"
    finally:
        _cleanup(parent, tree)
