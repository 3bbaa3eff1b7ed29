"""A Python sandbox for model-written code: a jailed, unprivileged, resource-limited child process.

Code execution is the most common tool of agentic RL (NeMo RL's code environments) and the most
common way such a system lets someone in where they do not belong. :func:`run_python` runs ``code`` like
this (Linux, as root; :func:`check_available` says why not when it cannot)::

    relayrl (root)
      └─ unshare --mount --net --pid --ipc --uts --fork --kill-child      (new session, own process group)
           └─ boot script, pid 1 of a new PID namespace, root of a new mount namespace
                mount a size-capped tmpfs as the new root; bind read-only: /usr /bin /lib* and the Python
                install; /dev/null, /dev/zero, /dev/urandom; an empty /work (the cwd) and /tmp
                chroot; drop to a fresh uid/gid (no supplementary groups); PR_SET_PDEATHSIG=SIGKILL
                setrlimit: CPU, address space, processes (fork bombs), file size, open files, no core
                exec python -I -S -B /work/main.py

What it guarantees (each is a test in ``tests/environments/test_sandbox.py``):

* **time**: wall time (the parent kills the whole process group at ``wall_s``) and CPU time (RLIMIT_CPU);
* **memory**: RLIMIT_AS per process; with RLIMIT_NPROC the whole tree holds at most
  ``max_processes x memory_mb`` (there is no cgroup, so that product is the bound);
* **processes**: RLIMIT_NPROC counts the processes of the sandbox's own uid (a fresh one per run), so a
  fork bomb stops at ``max_processes``; when pid 1 of the PID namespace ends, the kernel kills every
  process left in it, and the parent kills the process group and then any process of the sandbox uid;
* **network**: a fresh network namespace has only a loopback device, down: no route anywhere, and the
  abstract Unix sockets of the host are in the host's namespace;
* **files**: the real filesystem is not mounted in the jail, apart from the read-only system directories
  above (so the run directory, ``$HOME``, ``/work``, ``/tmp`` of the host cannot be read or written); writes go
  to a tmpfs of ``disk_mb`` that vanishes with the namespace; RLIMIT_FSIZE caps a single file;
* **the parent**: the code runs as an unprivileged uid in its own PID namespace, so it can neither see nor
  signal relayrl's processes;
* **output**: stdout and stderr are read up to ``output_bytes`` together; past that the run is killed and
  reported as such (printing 1 GB costs the parent ``output_bytes``).

What it does not guarantee: the read-only system directories and the Python install are visible (so code
can read ``/usr`` and the standard library); there is no seccomp filter, so every system call of an
unprivileged user is available (a kernel exploit is out of scope); CPU share is not limited (a busy loop
uses one core until its CPU limit); third-party packages of the virtualenv are not importable inside.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailable", "run_python", "check_available",
           "processes_of_uid"]


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the jail (not Linux, not root, no ``unshare``)."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(5.0, gt=0, description="wall-clock limit; the whole process tree is killed after it")
    cpu_s: int = Field(5, ge=1, description="CPU-seconds limit of each process (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, description="address-space limit of each process (RLIMIT_AS)")
    max_processes: int = Field(8, ge=1, description="processes the sandbox uid may have (RLIMIT_NPROC)")
    output_bytes: int = Field(16384, ge=256, description="stdout+stderr kept; more kills the run")
    disk_mb: int = Field(32, ge=1, description="size of the jail's tmpfs (its /work and /tmp)")
    file_mb: int = Field(16, ge=1, description="largest file the code may write (RLIMIT_FSIZE)")
    uid_base: int = Field(200_000, ge=1000, description="sandbox uids are uid_base + a per-run offset (no "
                          "such user needs to exist); pick a range no real user has")


@dataclass(frozen=True)
class SandboxResult:
    """What a run produced."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status (negative: killed by that signal); None when the parent killed it."""
    error: str | None
    """Why the run failed, in one line (None: it exited 0)."""
    seconds: float
    uid: int
    """The uid it ran as (for checking that no process of it is left)."""

    @property
    def ok(self) -> bool:
        return self.error is None


_BOOT = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "sandbox: mount %s on %s: %s" % (src, tgt, os.strerror(e)))
mount(None, "/", None, MS_REC | MS_PRIVATE)
root = cfg["root"]
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % cfg["disk_mb"])
for path in cfg["ro"]:
    tgt = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(tgt), exist_ok=True)
        os.symlink(os.readlink(path), tgt)
        continue
    if not os.path.isdir(path):
        continue
    os.makedirs(tgt, exist_ok=True)
    mount(path, tgt, None, MS_BIND | MS_REC)
    mount(None, tgt, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
os.makedirs(root + "/dev", exist_ok=True)
for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
    open(root + dev, "w").close()
    mount(dev, root + dev, None, MS_BIND)
uid = cfg["uid"]
for d, mode in (("/work", 0o700), ("/tmp", 0o1777)):
    os.makedirs(root + d, exist_ok=True)
    os.chmod(root + d, mode)
os.chown(root + "/work", uid, uid)
code = sys.stdin.buffer.read()
with open(root + "/work/main.py", "wb") as f:
    f.write(code)
os.chown(root + "/work/main.py", uid, uid)
report = os.fdopen(cfg["report_fd"], "w")
child = os.fork()
if child == 0:
    report.close()
    os.chroot(root)
    os.chdir("/work")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG=SIGKILL (the uid change cleared it): dies with pid 1
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    lim = cfg["limits"]
    for name, value in (("RLIMIT_CPU", (lim["cpu_s"], lim["cpu_s"] + 1)), ("RLIMIT_AS", (lim["as"], lim["as"])),
                        ("RLIMIT_NPROC", (lim["nproc"], lim["nproc"])), ("RLIMIT_FSIZE", (lim["fsize"], lim["fsize"])),
                        ("RLIMIT_NOFILE", (64, 64)), ("RLIMIT_CORE", (0, 0))):
        resource.setrlimit(getattr(resource, name), value)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "/work/main.py"], env)
os.close(0)
for fd in (1, 2):  # pid 1 keeps no end of the output pipes: they close when the code's processes end
    os.dup2(os.open("/dev/null", os.O_WRONLY), fd)
while True:  # pid 1 reaps every orphan until the code's own process ends; then the kernel kills the rest
    pid, status = os.wait()
    if pid == child:
        break
report.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}))
report.close()
'''

_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def _next_uid(base: int) -> int:
    """A uid no other run of this machine's relayrl processes uses at the same time."""
    with _uid_lock:
        k = next(_uid_counter)
    return base + (os.getpid() % 4096) * 256 + k % 256


def _readonly_paths() -> list[str]:
    prefix = os.path.realpath(sys.base_prefix)
    paths = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/alternatives", "/etc/ld.so.cache"]
    return paths + ([prefix] if not prefix.startswith("/usr") else [])


def check_available() -> None:
    """Raise :class:`SandboxUnavailable` naming what is missing (checked when a tool is loaded)."""
    if sys.platform != "linux":
        raise SandboxUnavailable(f"the Python sandbox needs Linux namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailable("the Python sandbox mounts a jail and drops to a fresh uid, which needs root; "
                                 "run relayrl as root (e.g. in its container) or drop the python tool from env.tools")
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("the Python sandbox needs util-linux's unshare on PATH (apt-get install util-linux)")


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live processes whose real uid is ``uid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(entry))
                        break
        except OSError:
            continue
    return out


def _kill_all(proc: subprocess.Popen, uid: int) -> None:
    """Kill the sandbox's process group, then any process left with its uid, and reap the launcher."""
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = processes_of_uid(uid)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # it ended between the scan and the kill
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_python(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the jail described in the module docstring; never raises for what the code does."""
    cfg = cfg or SandboxConfig()
    check_available()
    uid = _next_uid(cfg.uid_base)
    work = Path(tempfile.mkdtemp(prefix="relayrl-sbx-"))
    root = work / "root"
    root.mkdir()
    boot_cfg = {"root": str(root), "uid": uid, "disk_mb": cfg.disk_mb, "python": os.path.realpath(sys.executable),
                "ro": _readonly_paths(),
                "limits": {"cpu_s": cfg.cpu_s, "as": cfg.memory_mb << 20, "nproc": cfg.max_processes,
                           "fsize": cfg.file_mb << 20}}
    report_r, report_w = os.pipe()
    boot_cfg["report_fd"] = report_w
    cmd = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
           os.path.realpath(sys.executable), "-I", "-S", "-c", _BOOT, json.dumps(boot_cfg)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True, pass_fds=(report_w,), cwd=str(work),
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    os.close(report_w)
    error = None
    chunks = {"stdout": bytearray(), "stderr": bytearray()}
    try:
        with contextlib.suppress(BrokenPipeError):  # the code's process ended before reading it all: _collect says why
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        error = _collect(proc, chunks, cfg, t0)
    finally:
        _kill_all(proc, uid)
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        with os.fdopen(report_r) as f:
            report = f.read()
        shutil.rmtree(work, ignore_errors=True)
    stderr = chunks["stderr"].decode("utf-8", "replace")
    exit_code = json.loads(report)["exit"] if report and error is None else None
    if error is None and exit_code is None:
        error = f"the sandbox failed to start (launcher exit status {proc.returncode}): {stderr.strip()[-300:]}"
    elif error is None and exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        error = f"CPU time limit of {cfg.cpu_s} s reached (killed)"
    elif error is None and exit_code != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {exit_code}"
        if "MemoryError" in stderr:
            last = f"MemoryError (the memory limit is {cfg.memory_mb} MB per process)"
        error = f"the code failed: {last}"
    return SandboxResult(chunks["stdout"].decode("utf-8", "replace"), stderr, exit_code, error,
                         time.monotonic() - t0, uid)


def _collect(proc: subprocess.Popen, chunks: dict[str, bytearray], cfg: SandboxConfig, t0: float) -> str | None:
    """Read both pipes until they close, the wall limit passes or the output cap is exceeded; the reason
    the parent stopped the run (None: the code ended by itself)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    open_pipes = 2
    try:
        while open_pipes:
            left = cfg.wall_s - (time.monotonic() - t0)
            if left <= 0:
                return f"wall time limit of {cfg.wall_s:g} s reached (killed)"
            for key, _ in sel.select(timeout=left):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                    continue
                buf = chunks[key.data]
                room = cfg.output_bytes - len(chunks["stdout"]) - len(chunks["stderr"])
                buf += data[:max(room, 0)]
                if len(data) > room:
                    return f"output exceeded {cfg.output_bytes} bytes (killed)"
        left = cfg.wall_s - (time.monotonic() - t0)
        try:
            proc.wait(timeout=max(left, 0.01))
        except subprocess.TimeoutExpired:
            return f"wall time limit of {cfg.wall_s:g} s reached (killed)"
        return None
    finally:
        sel.close()
