"""A driver killed outright (SIGKILL: the OOM killer, ``kill -9``, a CI timeout) while its Ray actors are busy
in a call leaves nothing behind: of a local Ray it started, no process of that Ray session (Ray's own agents
ran on about a minute before), whether Ray writes log files or not (``RAY_LOG_TO_STDERR=1``), nor when it is
killed inside ``ray.init``, while another driver connected to that Ray and a reader of its logs stay; of a
cluster it connected to (``cluster.ray_address``), none of its actors or what they started, and the cluster
stays. A driver that shuts its local Ray down and starts another, again and again, is left no reaper of the
sessions it ended."""
from __future__ import annotations

import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.procs import alive, descendants, holding, kill_left, left_after

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).parent

DRIVER = """
import sys, time
import ray
from relayrl.cluster import ClusterConfig, ResourcePool, WorkerGroup
from cluster_workers import Echo
if __name__ == '__main__':
    cfg = ClusterConfig(backend='ray', num_cpus=2, ray_address=sys.argv[1] if len(sys.argv) > 1 else None)
    g = WorkerGroup(Echo, ResourcePool('orphans', devices=2), name='orphans', distributed=True, backend=cfg)
    g.all_async('sleep_then_reduce', sleeper=1, hold_s=600.0)  # rank 1 sleeps, rank 0 waits in all_reduce
    print('READY', ray._private.worker._global_node.get_session_dir_path(), ray.get_runtime_context().gcs_address,
          *g.pids(), flush=True)
    time.sleep(600)
"""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **(extra or {}), "PYTHONPATH": path}


def _start_driver(tmp_path: Path, *args: str,
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str, list[int]]:
    """The driver, its Ray session directory, its Ray's address and its actors' pids, once its call runs on them
    (fails the test with the driver's stderr if it does not get there within 180 s)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver, line = _run(tmp_path, [str(script), *args], env, "READY")
    if not line.startswith("READY"):
        driver.kill()
        pytest.fail(f"the driver did not start its group: {line!r} {(tmp_path / 'driver.err').read_text()[-3000:]}")
    time.sleep(1.0)  # (the call has reached both ranks)
    _, session, address, *pids = line.split()
    return driver, session, address, [int(p) for p in pids]


def _run(tmp_path: Path, args: list[str], env: dict[str, str] | None, said: str) -> tuple[subprocess.Popen, str]:
    """A driver (``python args``, its stderr to driver.err: Ray's logs, with RAY_LOG_TO_STDERR=1, would fill a
    pipe) and the first line it prints within 180 s that starts with ``said`` ("" if none; Ray prints its
    workers' ``:job_id:``/``:actor_name:`` lines there too, with RAY_LOG_TO_STDERR=1)."""
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                                  env=_env(env))
    line, deadline = "", time.monotonic() + 180.0
    while not line.startswith(said) and time.monotonic() < deadline and driver.poll() is None:
        if select.select([driver.stdout], [], [], 1.0)[0]:
            line = driver.stdout.readline()  # (one line, printed at once)
    return driver, line if line.startswith(said) else ""


def _kill(driver: subprocess.Popen) -> None:
    driver.kill()
    driver.wait(timeout=10)
    driver.stdout.close()


@pytest.mark.parametrize("log_to_stderr", [None, "1"], ids=["log files", "RAY_LOG_TO_STDERR=1"])
def test_a_local_ray_goes_with_its_killed_driver(tmp_path, monkeypatch, log_to_stderr):
    monkeypatch.delenv("RAY_LOG_TO_STDERR", raising=False)
    driver, session, actors, started = None, None, [], []
    try:
        env = {"RAY_LOG_TO_STDERR": log_to_stderr} if log_to_stderr else None
        driver, session, _, actors = _start_driver(tmp_path, env=env)
        started = sorted(set(descendants(driver.pid)) | set(holding(session)))  # (the reapers: no descendants)
        assert set(actors) <= set(started) and all(alive(p) for p in actors)
        assert len(started) >= len(actors) + 4, started  # gcs_server, raylet, its agents, the reapers, ...
        named = " ".join(_named(started))
        assert "ray::DashboardAgent" in named and "ray::RuntimeEnvAgent" in named, named  # (those that ran on)
        _kill(driver)
        left = left_after(started, 20.0)
        assert not left, f"processes of the driver's Ray session outlived it: {_named(left)}"
        assert not holding(session), _named(holding(session))
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(started + (holding(session) if session else []))


INSIDE_INIT = """
import os, signal, time
import psutil
import ray._private.worker
from relayrl.cluster import ClusterConfig
from relayrl.cluster.ray_backend import ensure_ray


def connect(node, *args, **kwargs):  # ray.init calls it once the local Ray's processes have started
    raylet = next(p for p in psutil.Process().children() if p.name() == 'raylet')
    deadline = time.monotonic() + 60.0
    while len(raylet.children()) < 2 and time.monotonic() < deadline:  # (its agents: those that ran on)
        time.sleep(0.1)
    started = [f'{p.pid}:{os.path.basename(p.cmdline()[0])}' for p in psutil.Process().children(recursive=True)]
    print('KILLED', node.get_session_dir_path(), *started, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


ray._private.worker.connect = connect
ensure_ray(ClusterConfig(backend='ray', num_cpus=1))
print('RETURNED', flush=True)
"""


def test_a_driver_killed_inside_ray_init_leaves_none_of_its_local_ray(tmp_path):
    driver, session, started = None, None, []
    try:
        driver, line = _run(tmp_path, ["-c", INSIDE_INIT], None, "KILLED")
        assert line.startswith("KILLED"), f"{line!r} {(tmp_path / 'driver.err').read_text()[-3000:]}"
        driver.wait(timeout=10)
        _, session, *named = line.split()  # (pid:program of each process the driver's Ray had started)
        started = sorted({int(p.split(":")[0]) for p in named} | set(holding(session)))
        programs = {p.split(":", 1)[1] for p in named}
        assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= programs, named
        left = left_after(started, 20.0)
        assert not left, f"processes of the driver's Ray session outlived it: {_named(left)}"
        assert not holding(session), _named(holding(session))
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(started + (holding(session) if session else []))


SECOND = """
import sys, time
import ray
ray.init(address=sys.argv[1], logging_level='ERROR')
print('READY', flush=True)
time.sleep(600)
"""


def test_another_driver_of_that_local_ray_and_a_reader_of_its_logs_stay(tmp_path):
    driver, second, tail, session, started, reapers = None, None, None, None, [], []
    try:
        driver, session, address, actors = _start_driver(tmp_path)
        second = subprocess.Popen([sys.executable, "-c", SECOND, address], stdout=subprocess.PIPE, text=True,
                                  env=_env({"RAY_AUTH_MODE": "token"}))  # (the token: the one the driver made)
        ready = select.select([second.stdout], [], [], 120.0)[0] and second.stdout.readline()
        assert ready == "READY\n", f"the second driver did not connect: {ready!r}"
        tail = subprocess.Popen(["tail", "-f", os.path.join(session, "logs", "raylet.out")],
                                stdout=subprocess.DEVNULL)
        time.sleep(0.5)  # (tail has opened the log)
        assert {second.pid, tail.pid} <= set(holding(session)), "both hold files under the session directory"
        reapers = _reapers_of(driver.pid)
        assert len(reapers) == 1, _named(reapers)
        started = sorted((set(descendants(driver.pid)) | set(holding(session))) - {second.pid, tail.pid})
        _kill(driver)
        left = left_after(started, 20.0)
        assert not left, f"processes of the driver's Ray session outlived it: {_named(left)}"
        assert not left_after(reapers, 10.0), f"the driver's reaper did not finish: {_named(reapers)}"
        assert second.poll() is None, f"the reaper killed another driver of that Ray (exit {second.returncode})"
        assert alive(tail.pid), "the reaper killed a `tail -f` of one of the session's logs"
    finally:
        for proc in (driver, second, tail):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        if second is not None:
            second.stdout.close()
        kill_left(started + reapers + (holding(session) if session else []))


CYCLES = """
import sys, time
import ray
from relayrl.cluster import ClusterConfig
from relayrl.cluster.ray_backend import ensure_ray
if __name__ == '__main__':
    for _ in range(3):
        ensure_ray(ClusterConfig(backend='ray', num_cpus=1))
        session = ray._private.worker._global_node.get_session_dir_path()
        ray.shutdown()
        print('DOWN', session, flush=True)
        sys.stdin.readline()  # (the test looks at what is left, then lets it go on)
    time.sleep(600)
"""


def test_a_driver_that_shuts_its_local_ray_down_is_left_no_reaper_of_it(tmp_path):
    driver, seen, err = None, [], tmp_path / "driver.err"
    try:
        with open(err, "w") as stderr:
            driver = subprocess.Popen([sys.executable, "-c", CYCLES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=stderr, text=True, env=_env())
        for cycle in range(3):
            line = select.select([driver.stdout], [], [], 180.0)[0] and driver.stdout.readline()
            assert line and line.startswith("DOWN"), f"cycle {cycle}: no local Ray started and stopped: {line!r} " \
                                                     f"{err.read_text()[-3000:]}"
            session, deadline = line.split()[1], time.monotonic() + 15.0
            while (left := _left_of(session, driver.pid)) and time.monotonic() < deadline:
                seen += left  # (its reaper sweeps what is left, then ends)
                time.sleep(0.2)
            assert not left, f"cycle {cycle}: left after ray.shutdown(): {_named(left)}"
            assert driver.poll() is None, f"cycle {cycle}: the driver ended (exit {driver.returncode})"
            driver.stdin.write("\n")
            driver.stdin.flush()
    finally:
        if driver is not None:
            driver.kill()
            driver.wait(timeout=10)
            driver.stdin.close()
            driver.stdout.close()
        kill_left(seen)


def _left_of(session: str, driver: int) -> list[int]:
    """What runs of the Ray session ``session`` but its driver (which holds its logs still), and the driver's
    reapers."""
    return sorted((set(holding(session)) - {driver}) | set(_reapers_of(driver)))


def test_a_cluster_connected_to_stays_and_only_the_drivers_actors_go(tmp_path):
    from relayrl.cluster.rank import free_port

    temp = tempfile.mkdtemp(prefix="rk-", dir="/tmp")  # (short: Ray's socket paths live under it)
    port = free_port()
    token = Path(temp) / "auth_token"
    token.write_text(secrets.token_hex(32))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}  # (a cluster of Ray 2.60 asks for one)
    driver, actors, cluster = None, [], []
    try:
        up = subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
                             f"--ray-client-server-port={free_port()}", "--num-cpus=2", "--include-dashboard=false",
                             f"--temp-dir={temp}", "--disable-usage-stats"],
                            capture_output=True, text=True, env=_env(auth), timeout=120)
        cluster = holding(temp)
        assert up.returncode == 0, up.stdout + up.stderr
        named = " ".join(_named(cluster))
        assert "gcs_server" in named and "raylet" in named, named
        driver, _, _, actors = _start_driver(tmp_path, f"127.0.0.1:{port}", env=auth)
        mine = [p for p in holding(temp) if _group(p) in actors]  # the actors and their reapers
        assert set(actors) <= set(mine) and len(mine) > len(actors), (actors, mine)
        _kill(driver)
        left = left_after(mine, 20.0)
        assert not left, f"the driver's actors (or what they started) outlived it: {_named(left)}"
        assert all(alive(p) for p in cluster), f"the user's cluster lost {_named([p for p in cluster if not alive(p)])}"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        kill_left(actors + cluster + holding(temp))  # (that cluster only: never `ray stop`, which stops every Ray here)
        shutil.rmtree(temp, ignore_errors=True)


def _reapers_of(pid: int) -> list[int]:
    """The running reapers started for process ``pid`` (relayrl.cluster.reaper's script, ``pid`` its argument)."""
    from relayrl.cluster.reaper import REAPER

    out = []
    for p in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[3:6] == ["-c", REAPER, str(pid)] and alive(p):
            out.append(p)
    return out


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _named(pids: list[int]) -> list[str]:
    out = []
    for p in pids:
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")
            # the program's file name first: a cut of its full path loses it where the checkout's path is long
            out.append(f"{p} {Path(argv[0]).name} {' '.join(argv[1:])[:60]}".replace("\n", " "))
        except OSError:
            out.append(f"{p} (gone)")
    return out
