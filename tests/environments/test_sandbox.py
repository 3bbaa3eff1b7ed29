"""The Python sandbox holds: every attack ends as a tool error, the run goes on, no process survives.

Limits are set in the child before the code runs (the boot script), so none of these can take the shared
machine: memory is capped per process (RLIMIT_AS) and processes per uid (RLIMIT_NPROC).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from relayrl.environments.sandbox import SandboxConfig, check_available, processes_of_uid, run_python
from relayrl.environments.tools import PythonTool, ToolEnvironment, format_call

try:
    check_available()
    HAVE_SANDBOX = True
except RuntimeError as e:  # not root / no unshare: the tool refuses to load (tested below)
    HAVE_SANDBOX, WHY = False, str(e)

pytestmark = pytest.mark.skipif(not HAVE_SANDBOX, reason="the sandbox needs Linux, root and unshare")

FAST = SandboxConfig(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=8, output_bytes=4096)


def _run(code: str, cfg: SandboxConfig = FAST):
    r = run_python(code, cfg)
    assert processes_of_uid(r.uid) == [], f"processes of the sandbox uid {r.uid} survived"
    return r


def test_prints_and_imports_the_standard_library():
    r = _run("import math, json\nprint(math.factorial(10), json.dumps([1]))")
    assert r.ok and r.stdout == "3628800 [1]\n" and r.exit_code == 0


def test_writes_in_its_own_directory():
    r = _run("import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())")
    assert r.ok and r.stdout == "hi /work\n"


@pytest.mark.slow
def test_infinite_loop_hits_the_cpu_limit():
    r = _run("while True:\n    pass", SandboxConfig(wall_s=20, cpu_s=1))
    assert not r.ok and "CPU time limit" in r.error and r.seconds < 10


@pytest.mark.slow
def test_sleeping_code_hits_the_wall_limit():
    t0 = time.monotonic()
    r = _run("import time\ntime.sleep(60)", SandboxConfig(wall_s=1.0))
    assert not r.ok and "wall time limit" in r.error and time.monotonic() - t0 < 8


@pytest.mark.slow
def test_fork_bomb_is_capped_and_leaves_no_process():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = _run(code, SandboxConfig(wall_s=2.0, cpu_s=2, max_processes=8))
    assert not r.ok


def test_escaped_children_die_with_the_sandbox():
    code = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
            "print('parent done')")
    r = _run(code)
    assert r.stdout == "parent done\n"


def test_allocating_tens_of_gb_is_a_memory_error():
    r = _run("x = bytearray(40 * 1024**3)")
    assert not r.ok and "MemoryError" in r.error


def test_cannot_write_outside_its_directory(tmp_path: Path):
    target = tmp_path / "owned.txt"
    r = _run(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')")
    assert not r.ok and not target.exists() and "wrote" not in r.stdout
    r = _run("open('/etc/owned', 'w').write('x')")
    assert not r.ok and not Path("/etc/owned").exists()


def test_cannot_read_the_run_directory_or_home(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    os.chmod(secret, 0o644)
    home = Path.home() / ".relayrl-sandbox-test"
    home.write_text("HOMESECRET")
    try:
        for path in (secret, home, Path.cwd() / "pyproject.toml"):
            r = _run(f"print(open({str(path)!r}).read())")
            assert not r.ok and "SECRET" not in r.stdout and "relayrl" not in r.stdout
    finally:
        home.unlink()


def test_cannot_open_a_network_connection():
    r = _run("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
    assert not r.ok and "connected" not in r.stdout and ("unreachable" in r.error or "Errno" in r.error)


def test_printing_a_gigabyte_is_cut_at_the_cap():
    t0 = time.monotonic()
    r = _run("import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)")
    assert not r.ok and "output exceeded" in r.error
    assert len(r.stdout) + len(r.stderr) <= FAST.output_bytes and time.monotonic() - t0 < 10


def test_cannot_kill_its_parent():
    me = os.getpid()
    r = _run(f"import os, signal\nos.kill({me}, signal.SIGKILL)\nprint('killed it')")
    assert "killed it" not in r.stdout and not r.ok
    r = _run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert os.getpid() == me  # still here


def test_each_attack_is_a_tool_error_observation_and_the_episode_goes_on():
    env = ToolEnvironment({"python": PythonTool(FAST)}, score=lambda p, t: 1.0)
    env.reset(None)
    for code in ("x = bytearray(40 * 1024**3)", "import socket; socket.create_connection(('1.1.1.1', 80), 2)",
                 "open('/etc/x', 'w')"):
        out = env.step(format_call("python", {"code": code}))
        assert out.observation.startswith("<error>") and not out.done and out.info.get("tool_error")
    out = env.step(format_call("python", {"code": "print(6 * 7)"}))
    assert out.observation == "<result>42</result>"
