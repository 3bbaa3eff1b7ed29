"""The Python sandbox holds: every attack ends as a tool error, the run goes on, no process survives.

Limits are set in the child before the code runs (the boot script), so none of these can take the shared
machine: memory is capped per process (RLIMIT_AS) and for the whole tree (the memory cgroup), processes per
uid (RLIMIT_NPROC) and per tree (pids cgroup). The tool refusing to load where the sandbox cannot run is
tested in ``test_tools.py`` (it needs no sandbox).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest

from relayrl.environments.sandbox import SandboxConfig, check_available, processes_of_uid, run_python
from relayrl.environments.tools import PythonTool, ToolEnvironment, format_call

try:
    check_available()
    HAVE_SANDBOX = True
except RuntimeError as e:  # not Linux / no unshare / no libseccomp / neither root nor user namespaces
    HAVE_SANDBOX, WHY = False, str(e)

pytestmark = pytest.mark.skipif(not HAVE_SANDBOX, reason="the sandbox needs Linux, unshare, libseccomp and root "
                                "or user namespaces")

FAST = SandboxConfig(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=8, output_bytes=4096)
ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0


def _run(code: str, cfg: SandboxConfig = FAST):
    r = run_python(code, cfg)
    if r.uid is not None:
        assert processes_of_uid(r.uid) == [], f"processes of the sandbox uid {r.uid} survived"
    return r


def _python(script: str, *args: str, under: tuple[str, ...] = ()) -> list[str]:
    """The command running ``script`` in a fresh Python (``under`` another command, such as unshare)."""
    return [*under, sys.executable, "-c", textwrap.dedent(script), *args]


def _env(**extra: str) -> dict[str, str]:
    """This environment, with relayrl importable from this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


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


def test_code_that_kills_itself_is_not_reported_as_the_cpu_limit():
    r = _run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert not r.ok and r.exit_code == -9 and "CPU time" not in r.error and "SIGKILL" in r.error, r.error


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


def test_home_shows_only_what_python_needs_and_no_site_packages():
    """The Python install is bound file by file: its executable, standard library and shared libraries. Here it
    lives under $HOME (pyenv), whose other files (the install's bin/ and include/, anything else) stay out."""
    exe = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    libdir = os.path.realpath(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
    site_packages = os.path.join(stdlib, "site-packages")
    code = f"""import json, os
seen = []
for d, dirs, files in os.walk({str(Path.home())!r}):
    dirs[:] = [x for x in dirs if os.path.join(d, x) != {stdlib!r}]  # the standard library is expected
    seen += [os.path.join(d, f) for f in files]
try:
    site = os.listdir({site_packages!r})
except OSError:
    site = []
print(json.dumps({{"seen": seen, "site": site}}))"""
    r = _run(code, SandboxConfig(output_bytes=1 << 20))
    assert r.ok, r.error
    out = json.loads(r.stdout)
    assert out["site"] == [], f"the install's site-packages is visible: {out['site'][:5]}"

    def needed(path: str) -> bool:
        return (path == exe or path.startswith(stdlib + "/")
                or (os.path.dirname(path) == libdir and os.path.basename(path).startswith("lib")
                    and ".so" in path))

    extra = [p for p in out["seen"] if not needed(p)]
    assert extra == [], f"files of $HOME beyond the Python install's needs are visible: {extra[:5]}"


def test_cannot_open_a_network_connection():
    r = _run("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
    assert not r.ok and "connected" not in r.stdout and ("unreachable" in r.error or "Errno" in r.error)


def test_printing_a_gigabyte_is_cut_at_the_cap():
    t0 = time.monotonic()
    r = _run("import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)")
    assert not r.ok and "output exceeded" in r.error
    assert len(r.stdout) + len(r.stderr) <= FAST.output_bytes and time.monotonic() - t0 < 10


def test_flooding_stderr_is_cut_at_the_cap_as_quickly_as_stdout():
    """The launcher writes its own last words to stderr: with that pipe full and unread it could not exit, and
    the stop waited 5 s for it, past wall_s. The bound is measured against a run that prints one line, now: a
    fixed 2.5 s was within what starting a sandbox takes on a loaded machine."""
    t0 = time.monotonic()
    assert _run("print(1)").ok
    start = time.monotonic() - t0
    for stream in ("stdout", "stderr"):
        t0 = time.monotonic()
        r = _run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 10000)")
        assert not r.ok and "output exceeded" in r.error
        took = time.monotonic() - t0
        assert took < 2 * start + 2.0, (stream, took, start)


def test_cannot_kill_its_parent():
    me = os.getpid()
    r = _run(f"import os, signal\nos.kill({me}, signal.SIGKILL)\nprint('killed it')")
    assert "killed it" not in r.stdout and not r.ok
    # its parent in the jail is pid 1, which must outlive the attempt: it reports the code's exit status
    code = ("import os, signal, time\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError as e:\n"
            "    print(type(e).__name__)\ntime.sleep(0.2)\nprint('parent', os.getppid())")
    r = _run(code)
    assert r.ok and r.exit_code == 0 and r.stdout.endswith("parent 1\n"), (r.stdout, r.error)


# ---------------------------------------------------------------- system calls and privileges

_SYSCALLS = {"x86_64": {"keyctl": 250, "io_uring_setup": 425, "perf_event_open": 298},
             "aarch64": {"keyctl": 219, "io_uring_setup": 425, "perf_event_open": 241}}


@pytest.mark.skipif(platform.machine() not in _SYSCALLS, reason="system call numbers known for x86_64, aarch64")
def test_seccomp_refuses_ptrace_keyrings_io_uring_perf_and_new_namespaces():
    nr = _SYSCALLS[platform.machine()]
    code = f"""import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
def attempt(call):
    ctypes.set_errno(0)
    r = call()
    return [r, ctypes.get_errno()]
params = ctypes.create_string_buffer(120)
attr = ctypes.create_string_buffer(128)
attr[4] = 128  # perf_event_attr.size; type 1 (software), config 0 (cpu clock)
attr[0] = 1
print(json.dumps({{
    "ptrace": attempt(lambda: libc.ptrace(0, 0, 0, 0)),  # PTRACE_TRACEME
    "keyctl": attempt(lambda: libc.syscall({nr["keyctl"]}, 0, -3, 1)),  # the session keyring, made if missing
    "io_uring": attempt(lambda: libc.syscall({nr["io_uring_setup"]}, 4, params)),
    "perf": attempt(lambda: libc.syscall({nr["perf_event_open"]}, attr, 0, -1, -1, 0)),
    "userns": attempt(lambda: libc.unshare(0x10000000)),  # CLONE_NEWUSER
    "mountns": attempt(lambda: libc.unshare(0x00020000)),  # CLONE_NEWNS
}}))"""
    r = _run(code)
    assert r.ok, r.error
    for call, (ret, err) in json.loads(r.stdout).items():
        assert ret == -1 and err == 1, f"{call} returned {ret} (errno {err}); the filter must refuse it (EPERM)"
    if platform.machine() == "x86_64":  # getpid through the x32 ABI, which the filter does not know: killed
        r = _run("import ctypes\nprint(ctypes.CDLL(None).syscall(0x40000000 + 39))")
        assert not r.ok and r.stdout == "" and "another ABI" in r.error, (r.stdout, r.error)


def test_no_new_privileges_and_no_capabilities():
    code = """import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
bounding = [cap for cap in range(64) if libc.prctl(23, cap, 0, 0, 0) == 1]  # PR_CAPBSET_READ
print(json.dumps({"no_new_privs": libc.prctl(39, 0, 0, 0, 0), "seccomp": libc.prctl(21, 0, 0, 0, 0),
                  "bounding": bounding}))"""
    r = _run(code)
    assert r.ok, r.error
    out = json.loads(r.stdout)
    assert out == {"no_new_privs": 1, "seccomp": 2, "bounding": []}, out


# ---------------------------------------------------------------- the file system

# Sandboxed code that runs until the test releases it (``_release``): a test that must look at (or run beside)
# a sandbox while its code runs cannot rely on a sleep, which under load ended before the test got there.
# SIGWINCH is ignored by default, so one sent before the code blocks it is lost, not fatal: _release resends.
_HELD = "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})\nsignal.sigwait({signal.SIGWINCH})\n"


def _release(pids, running, timeout: float = 60.0) -> None:
    """Send SIGWINCH to ``pids()`` until ``running()`` is false (the held code has ended)."""
    deadline = time.monotonic() + timeout
    while running():
        assert time.monotonic() < deadline, "the held sandboxed code did not end once released"
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGWINCH)
        time.sleep(0.02)



def _jailed(timeout: float = 10.0) -> list[int]:
    """Pids of the processes of the one sandbox this test started (the code, and pid 1 of its namespaces)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            mnt = _ns(entry)
            if b"/work/main.py" in cmd and mnt not in (None, _ns("self")) and _descends_from(entry, os.getpid()):
                return [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if _ns(p) == mnt]
        time.sleep(0.02)
    raise AssertionError("the sandboxed code did not start")


def _ns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _descends_from(pid: str, ancestor: int) -> bool:
    while pid not in ("0", "1"):
        try:
            pid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            return False
        if pid == str(ancestor):
            return True
    return False


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_the_hosts_root_is_not_mounted_in_the_jails_namespace():
    """pivot_root and a detached old root: no process of the jail (pid 1 included, which a chroot leaves
    outside) has a path back to the host's tree."""
    host_root = next(line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()
                     if line.split()[4] == "/")
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_run(_HELD, FAST.model_copy(update={"wall_s": 60.0}))))
    t.start()
    pids: list[int] = []
    try:
        pids = _jailed(60.0)
        mountinfo = {pid: Path(f"/proc/{pid}/mountinfo").read_text() for pid in pids}
    finally:
        _release(lambda: pids, t.is_alive)
        t.join()
    assert result["r"].ok, result["r"].error
    assert len(mountinfo) >= 2  # the code and pid 1
    for pid, text in mountinfo.items():
        for line in text.splitlines():
            fields = line.split()
            fstype = line.split(" - ")[1].split()[0]
            assert not (fields[2] == host_root[2] and fields[3] == "/"), f"pid {pid} has the host's root: {line}"
            assert fstype not in ("proc", "sysfs", "cgroup", "cgroup2"), f"pid {pid} sees {line}"


_SUBMOUNT_SCRIPT = """
import json, os, subprocess, sys
point, enosys = sys.argv[1], sys.argv[2] == "1"
# a writable submount under a directory the jail binds read-only, in this process's own mount namespace
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", point], check=True)
if enosys:  # a kernel before mount_setattr (5.12): the boot must remount each submount instead
    import errno, pyseccomp
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "mount_setattr")
    f.load()
from relayrl.environments.sandbox import SandboxConfig, run_python
r = run_python(f"open({point + '/owned'!r}, 'w').write('x')\\nprint('wrote')", SandboxConfig(wall_s=10))
print(json.dumps({"ok": r.ok, "stdout": r.stdout, "error": r.error, "exists": os.path.exists(point + "/owned")}))
"""


@pytest.mark.skipif(not IS_ROOT, reason="making a submount in a private mount namespace needs root")
@pytest.mark.parametrize("enosys", [False, True], ids=["mount_setattr", "remount_each"])
def test_submounts_under_bound_directories_are_read_only(enosys):
    point = next((p for p in ("/usr/local/share", "/usr/local/src", "/usr/src") if os.path.isdir(p)), None)
    if point is None:
        pytest.skip("no directory under /usr to mount on")
    p = subprocess.run(_python(_SUBMOUNT_SCRIPT, point, "1" if enosys else "0", under=("unshare", "--mount", "--")),
                       capture_output=True, text=True, timeout=60, env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert not out["ok"] and "wrote" not in out["stdout"] and "Read-only file system" in out["error"], out
    assert not out["exists"]


# ---------------------------------------------------------------- uids, cgroups, no root

_TRAINER_SCRIPT = """
import contextlib, json, os, sys
os.getpid = lambda: 4242  # two trainers whose pids are equal modulo 4096, as pids of two containers can be
from relayrl.environments import sandbox
lease = sandbox._lease_uid


@contextlib.contextmanager
def announced(base):  # the test learns the run's uid as soon as the run holds it
    with lease(base) as uid:
        print("uid", uid, flush=True)
        yield uid


sandbox._lease_uid = announced
print("ready", flush=True)
sys.stdin.readline()  # the test says when to run
r = sandbox.run_python(sys.argv[1], sandbox.SandboxConfig(wall_s=60))
print(json.dumps({"uid": r.uid, "ok": r.ok, "stdout": r.stdout, "error": r.error}))
"""

def _trainer(code: str) -> subprocess.Popen:
    p = subprocess.Popen(_python(_TRAINER_SCRIPT, code), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    assert p.stdout.readline() == "ready\n", p.stderr.read()[-2000:] if p.poll() is not None else ""
    return p


def _go(p: subprocess.Popen) -> int:
    """Start the trainer's run; the uid it leased."""
    p.stdin.write("go\n")
    p.stdin.flush()  # (communicate closes it)
    line = p.stdout.readline()
    assert line.startswith("uid "), (line, p.stderr.read()[-2000:] if p.poll() is not None else "")
    return int(line.split()[1])


@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="uids are leased in root mode only (a user namespace runs as the trainer)")
def test_two_trainers_with_colliding_pids_get_their_own_uids():
    """The first trainer's code runs (held) through the whole of the second's run, whatever the load: both
    trainers have imported the sandbox before either runs, and the first's code ends only once the test
    releases it (a sleep of 2 s in it, begun 0.7 s before the second trainer started, ended first under load:
    the second then leased the freed uid and the uids matched)."""
    first, second = _trainer(_HELD + "print('A done')"), _trainer("print('B done')")
    uid_a = _go(first)
    deadline = time.monotonic() + 60
    while not processes_of_uid(uid_a):  # the first sandbox's code is running under its uid
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:]
        time.sleep(0.02)
    uid_b = _go(second)
    out_b, err_b = second.communicate(timeout=60)
    assert processes_of_uid(uid_a), f"the second trainer's cleanup killed the first's code: {err_b[-2000:]}"
    _release(lambda: processes_of_uid(uid_a), lambda: first.poll() is None)
    out_a, err_a = first.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, (err_a[-2000:], err_b[-2000:])
    a, b = json.loads(out_a.splitlines()[-1]), json.loads(out_b.splitlines()[-1])
    assert b["ok"] and b["stdout"] == "B done\n", b
    assert a["ok"] and a["stdout"] == "A done\n", f"the second trainer's cleanup killed the first's code: {a}"
    assert a["uid"] == uid_a != uid_b == b["uid"]


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_uid_leases_are_exclusive_and_come_back():
    if not IS_ROOT:
        pytest.skip("uids are leased in root mode only")
    import contextlib

    from relayrl.environments.sandbox import _lease_uid, _uid_registry

    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(_lease_uid(300_000)) for _ in range(260)]  # the old scheme wrapped at 256
        assert len(set(held)) == 260
    with _lease_uid(300_000) as uid:
        assert uid == 300_000
    for uid in range(300_000, 300_260):  # this test's range only, every lease released
        (_uid_registry() / f"{uid}.lock").unlink(missing_ok=True)


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_concurrent_runs_never_share_a_uid():
    """Tools run in threads: runs whose code overlaps in time hold different uids (and all succeed)."""
    code = "import os, time\nt = time.time()\ntime.sleep(0.5)\nprint(os.getuid(), t, time.time())"
    results: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _run(code))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results), [r.error for r in results]
    spans = [tuple(float(x) for x in r.stdout.split()) for r in results]
    for i, (uid, t0, t1) in enumerate(spans):
        for uid2, u0, u1 in spans[i + 1:]:
            assert uid != uid2 or t1 <= u0 or u1 <= t0, f"two runs held uid {uid:.0f} at the same time"


@pytest.mark.slow
def test_cpu_share_is_capped_by_the_cgroup():
    code = """import time
t, c = time.monotonic(), time.process_time()
while time.monotonic() - t < 1.5:
    pass
print((time.process_time() - c) / (time.monotonic() - t))"""
    r = _run(code, SandboxConfig(wall_s=10, cpu_s=5, cpus=0.25))
    if "cpu" not in r.cgroup:
        pytest.skip("this machine gives the sandbox no cpu cgroup (see the log line)")
    assert r.ok, r.error
    assert float(r.stdout) < 0.5, f"a busy loop got {float(r.stdout):.2f} cores with cpus=0.25"


@pytest.mark.slow  # (about 1 s; the full `make test` runs it)
def test_memory_of_the_whole_tree_is_capped_by_the_cgroup():
    """Two processes of 170 MB each: within RLIMIT_AS (256 MB each), beyond the tree's 256 + 32 MB. Each holds
    its memory until the other has touched all of its own (pipes, not a sleep: under load a sleep let the child
    exit before the parent had touched its memory, and the two never held 340 MB at once)."""
    code = """import os
n = 170 << 20
done_r, done_w = os.pipe()  # the child: all of mine is touched
go_r, go_w = os.pipe()  # the parent: so is mine, you may go
pid = os.fork()
b = bytearray(n)
for i in range(0, n, 4096):
    b[i] = 1
if pid == 0:
    os.write(done_w, b"c")
    os.read(go_r, 1)
    os._exit(0)
os.close(done_w)
if os.read(done_r, 1) == b"c":
    os.write(go_w, b"p")
os.waitpid(pid, 0)
print('both held', n >> 20, 'MB')"""
    r = _run(code, SandboxConfig(wall_s=10, cpu_s=5, memory_mb=256, disk_mb=32))
    if "memory" not in r.cgroup:
        pytest.skip("this machine gives the sandbox no memory cgroup (see the log line)")
    assert not r.ok and "memory limit of 288 MB for the whole sandbox" in r.error, (r.stdout, r.error)


def test_without_a_cgroup_the_run_goes_on_and_the_log_says_why(monkeypatch, caplog):
    from relayrl.environments import sandbox, sandbox_cgroup

    monkeypatch.setattr(sandbox_cgroup, "_hierarchies", lambda: [])
    monkeypatch.setattr(sandbox, "_logged", set())
    with caplog.at_level("WARNING", logger="relayrl.environments.sandbox"):
        r1, r2 = _run("print(1)"), _run("print(2)")
    assert r1.ok and r2.ok and r1.cgroup == r2.cgroup == ()
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 1 and "no cpu, memory, pids cgroup" in lines[0] and "runs go on" in lines[0], lines


def _reachable(paths: list[str], keep: Path) -> str:
    """Shell commands making ``paths`` reachable by any uid in a private mount namespace: a directory on
    their way that others cannot enter (such as /root, where pyenv puts Python) is covered by a tmpfs that
    holds only the entries on the way, bound back. The host's directories are not changed."""
    covers: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for i in range(1, len(parts) - 1):
            d = os.path.join(*parts[:i + 1])
            if not os.stat(d).st_mode & 0o001:
                covers.setdefault(d, set()).add(parts[i + 1])
                break
    cmds = []
    for n, (d, entries) in enumerate(sorted(covers.items())):
        saved = [(keep / f"{n}-{k}", os.path.join(d, e)) for k, e in enumerate(sorted(entries))]
        cmds += [f"mkdir -p {s} && mount --bind {e} {s}" for s, e in saved]
        cmds.append(f"mount -t tmpfs -o mode=755 tmpfs {d}")
        cmds += [f"mkdir {e} && mount --move {s} {e}" for s, e in saved]
    return "".join(c + " && " for c in cmds)


_UNPRIVILEGED_SCRIPT = """
import json, os, sys
from relayrl.environments.sandbox import SandboxConfig, check_available, processes_of_uid, run_python
check_available()
cfg = SandboxConfig(wall_s=5, cpu_s=2, memory_mb=256, max_processes=8)
out = {}
for name, code in [
    ("hello", "import os\\nprint(6 * 7, os.getuid())"),
    ("write_etc", "open('/etc/owned', 'w').write('x')"),
    ("read_probe", "print(open(%r).read())" % sys.argv[1]),
    ("ptrace", "import ctypes\\nl = ctypes.CDLL(None, use_errno=True)\\n"
               "print(l.ptrace(0, 0, 0, 0), ctypes.get_errno())"),
    ("caps", "import ctypes\\nl = ctypes.CDLL(None)\\nprint([c for c in range(64) if l.prctl(23, c, 0, 0, 0) == 1])"),
    ("fork_bomb", "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass"),
    ("escape", "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\nprint('left a child')"),
]:
    r = run_python(code, cfg)
    out[name] = {"ok": r.ok, "stdout": r.stdout, "error": r.error, "uid": r.uid}
out["left"] = [p for p in processes_of_uid(os.getuid()) if p != os.getpid()]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_runs_without_root_in_a_user_namespace(tmp_path: Path):
    """As an unprivileged uid: the jail is built in a user namespace and every attack still fails."""
    probe = tmp_path / "probe.txt"
    probe.write_text("HOSTSECRET")
    probe.chmod(0o644)
    tmp_path.chmod(0o755)
    if IS_ROOT:  # as an unused uid, in a mount namespace of this test's own where it can reach Python
        if shutil.which("setpriv") is None:
            pytest.skip("dropping to an unprivileged uid needs util-linux's setpriv")
        prelude = _reachable([os.path.realpath(sys.executable), sys.prefix, str(ROOT)], tmp_path / "keep")
        cmd = _python(_UNPRIVILEGED_SCRIPT, str(probe), under=(
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            prelude + 'exec setpriv --reuid 59999 --regid 59999 --clear-groups -- "$@"', "sh"))
    else:
        cmd = _python(_UNPRIVILEGED_SCRIPT, str(probe))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(HOME=str(tmp_path)),
                       cwd=str(tmp_path))
    if "refuses user namespaces" in p.stderr:
        pytest.skip(f"this kernel refuses user namespaces: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["hello"]["ok"] and out["hello"]["stdout"] == "42 0\n" and out["hello"]["uid"] is None, out["hello"]
    assert not out["write_etc"]["ok"]
    assert not out["read_probe"]["ok"] and "HOSTSECRET" not in out["read_probe"]["stdout"]
    assert out["ptrace"]["stdout"] == "-1 1\n", out["ptrace"]
    assert out["caps"]["stdout"] == "[]\n", out["caps"]
    assert not out["fork_bomb"]["ok"]
    assert out["escape"]["stdout"] == "left a child\n"
    assert out["left"] == [], f"processes of the unprivileged uid survived: {out['left']}"


def test_each_attack_is_a_tool_error_observation_and_the_episode_goes_on():
    env = ToolEnvironment({"python": PythonTool(FAST)}, score=lambda p, t: 1.0)
    env.reset(None)
    for code in ("x = bytearray(40 * 1024**3)", "import socket; socket.create_connection(('1.1.1.1', 80), 2)",
                 "open('/etc/x', 'w')"):
        out = env.step(format_call("python", {"code": code}))
        assert out.observation.startswith("<error>") and not out.done and out.info.get("tool_error")
    out = env.step(format_call("python", {"code": "print(6 * 7)"}))
    assert out.observation == "<result>42</result>"


def test_the_python_tool_printing_a_megabyte_reaches_the_model_capped_and_never_the_console(capsys):
    from relayrl.data.tasks import Problem

    env = ToolEnvironment({"python": PythonTool(FAST)}, score=lambda p, t: 0.0, max_chars=512)
    env.reset(Problem("q", "a"))
    r = env.step(format_call("python", {"code": "import sys\nprint('x' * (1 << 20))\nsys.stderr.write('y' * (1 << 20))"}))
    assert r.observation.startswith("<error>output exceeded 4096 bytes") and len(r.observation) < 1024
    out, err = capsys.readouterr()
    assert out == "" and err == ""
