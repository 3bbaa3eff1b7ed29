"""A Python sandbox for model-written code: a jailed, unprivileged, resource-limited child process.

Code execution is the most common tool of agentic RL (NeMo RL's code environments) and the most
common way such a system lets someone in where they do not belong. :func:`run_python` runs ``code`` like
this (Linux; as root, or as any user where the kernel allows user namespaces; :func:`check_available` says
why not when it cannot)::

    relayrl
      └─ unshare [--user --map-root-user] --mount --net --pid --ipc --uts --fork --kill-child  (new session)
           └─ sandbox_boot.py: pid 1 of a new PID namespace, root of a new mount namespace
                leaves when the lifeline (a pipe whose write end relayrl alone holds) closes
                join the run's cgroup (cpu, memory, pids), where the machine lets it make one
                mount a size-capped tmpfs as the new root; bind read-only, recursively: /usr /bin /lib*, the
                Python executable, standard library and shared libraries (site-packages hidden under empty
                tmpfs); /dev/null, /dev/zero, /dev/urandom; an empty /work (the cwd) and /tmp
                pivot_root into it and detach the host's root
                └─ fork: drop every capability; a uid of its own (root mode); PR_SET_PDEATHSIG=SIGKILL;
                   setrlimit: CPU, address space, processes, file size, open files, no core;
                   PR_SET_NO_NEW_PRIVS; seccomp filter; exec python -I -S -B /work/main.py

Root mode (relayrl runs as root) gives each run a uid of its own, leased from a registry of lock files
(``/run/relayrl-sandbox-uids``), so two runs never share one, whatever their trainers' pids. User-namespace
mode (any other user) runs the code as root of a user namespace that maps that one user, with every
capability dropped: to the host it is relayrl's own uid, confined by the namespaces and the filter.

What it guarantees (each is a test in ``tests/environments/test_sandbox.py``):

* **time**: wall time (the parent kills the whole PID namespace at ``wall_s``) and CPU time (RLIMIT_CPU);
  CPU share: the whole tree gets at most ``cpus`` cores (cgroup cpu quota);
* **memory**: RLIMIT_AS per process, and the cgroup caps the whole tree (its tmpfs files included) at
  ``memory_mb + disk_mb``; without a memory cgroup the bound is ``max_processes x memory_mb``;
* **processes**: RLIMIT_NPROC (per uid, and per user namespace) and the cgroup's ``pids.max`` stop a fork
  bomb at ``max_processes``; when pid 1 of the PID namespace ends, the kernel kills every process left in
  it, and the parent ends a run by killing that pid 1 and waiting until the namespace is empty;
* **network**: a fresh network namespace has only a loopback device, down: no route anywhere, and the
  abstract Unix sockets of the host are in the host's namespace;
* **files**: the host's root is not mounted in the jail's namespace (pivot_root, then detached); only the
  read-only binds above are (so the run directory, the rest of ``$HOME``, ``/work``, ``/tmp`` of the host
  cannot be read or written, submounts under the binds included); writes go to a tmpfs of ``disk_mb``
  that vanishes with the namespace; RLIMIT_FSIZE caps a single file;
* **system calls**: a seccomp filter (:mod:`.sandbox_seccomp`) refuses ptrace, mounts, new namespaces,
  bpf, perf, io_uring, keyrings and the machine's configuration; no-new-privs and an empty capability set
  (bounding set included) mean no program it runs can gain a privilege;
* **no orphans**: a run ends with the process that started it, even one killed outright (SIGKILL, the OOM
  killer, a rank stopped by ``cluster.call_timeout_s``): pid 1 leaves when its lifeline pipe reads end of file,
  so the kernel ends the jail and ``unshare`` exits (without it they ran on, in a session of their own, until
  the code ended by itself);
* **the parent**: the code runs in its own PID namespace, without privileges (another uid in root mode),
  so it can neither see nor signal relayrl's processes;
* **output**: stdout and stderr are read up to ``output_bytes`` together; past that the run is killed and
  reported as such (printing 1 GB costs the parent ``output_bytes``).

What it does not guarantee: the read-only system directories and the Python standard library are visible
(so code can read ``/usr``); the filter is a deny list, so the other system calls of an unprivileged user
remain (a kernel exploit through them is out of scope); where no cgroup can be made (not root and no
delegated cgroup) CPU share is not limited and memory is bounded per process only (a log line says so);
uids are unique among the runs that share ``/run``: containers that share a kernel but not ``/run`` need
different ``uid_base``; third-party packages of the virtualenv are not importable inside.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from relayrl.environments import sandbox_cgroup, sandbox_seccomp

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailable", "run_python", "check_available",
           "processes_of_uid"]

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the jail (not Linux, no ``unshare``, no libseccomp, neither root nor user
    namespaces)."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(5.0, gt=0, description="wall-clock limit; the whole process tree is killed after it")
    cpu_s: int = Field(5, ge=1, description="CPU-seconds limit of each process (RLIMIT_CPU)")
    cpus: float = Field(1.0, gt=0, description="CPU share of the whole process tree, in cores (cgroup cpu "
                        "quota; not limited where no cgroup can be made)")
    memory_mb: int = Field(512, ge=64, description="address-space limit of each process (RLIMIT_AS); the whole "
                           "tree's memory, its files included, is capped at memory_mb + disk_mb (memory cgroup)")
    max_processes: int = Field(8, ge=1, description="processes the sandbox may have (RLIMIT_NPROC, cgroup "
                               "pids.max)")
    output_bytes: int = Field(16384, ge=256, description="stdout+stderr kept; more kills the sandboxed program "
                              "(the python tool answers the model with the error 'output exceeded N bytes "
                              "(killed)'; the training run goes on)")
    disk_mb: int = Field(32, ge=1, description="size of the jail's tmpfs (its /work and /tmp)")
    file_mb: int = Field(16, ge=1, description="largest file the code may write (RLIMIT_FSIZE)")
    uid_base: int = Field(200_000, ge=1000, le=2**31, description="as root, each run leases a uid of its own "
                          "in uid_base .. uid_base+65535 (no such user needs to exist); pick a range no real "
                          "user has")


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
    uid: int | None
    """The uid it ran as in root mode (for checking that no process of it is left); None in a user namespace,
    where it ran as relayrl's own uid."""
    cgroup: tuple[str, ...] = ()
    """The cgroup controllers that limited the run (cpu, memory, pids; empty where none could be made)."""

    @property
    def ok(self) -> bool:
        return self.error is None


_BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/alternatives")
_SYSTEM_FILES = ("/etc/ld.so.cache",)
_UID_SLOTS = 65536
_UID_REGISTRIES = (Path("/run/relayrl-sandbox-uids"), Path(tempfile.gettempdir()) / "relayrl-sandbox-uids")
_logged: set[str] = set()


# ---------------------------------------------------------------- what the jail shows of the host

def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _kind(path: str) -> str | None:
    if os.path.islink(path):
        return "link"
    if os.path.isdir(path):
        return "dir"
    return "file" if os.path.isfile(path) else None


def _python_paths() -> list[str]:
    """What the interpreter needs to run ``python -I -S``: its executable, its standard library (with
    lib-dynload) and, for a shared build, the shared libraries beside libpython (a conda install links its
    extension modules to them). Not the rest of its install (bin/, include/, share/), nor site-packages."""
    paths = [os.path.realpath(sys.executable), os.path.realpath(os.path.dirname(os.__file__))]
    dynload = sysconfig.get_config_var("DESTSHARED")
    if dynload and os.path.isdir(dynload):
        paths.append(os.path.realpath(dynload))
    libdir = os.path.realpath(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and os.path.isdir(libdir):
        paths += [os.path.join(libdir, n) for n in sorted(os.listdir(libdir)) if n.startswith("lib") and ".so" in n]
    return paths


def _site_dirs() -> list[str]:
    """Package directories of this interpreter and its base install (hidden in the jail where a bind shows
    them: ``-S`` never reads them, and the trainer's packages are not the code's business)."""
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dirs = [os.path.join(stdlib, "site-packages"), os.path.join(stdlib, "dist-packages"),
            "/usr/lib/python3/dist-packages", f"/usr/local/lib/python{version}/dist-packages",
            f"/usr/local/lib/python{version}/site-packages", site.getusersitepackages()]
    with contextlib.suppress(AttributeError):  # site.getsitepackages is missing in some old virtualenvs
        dirs += site.getsitepackages()
    return [os.path.realpath(d) for d in dirs]


@functools.lru_cache(maxsize=1)
def _jail_plan() -> tuple[list[tuple[str, str]], list[str]]:
    """(binds, masks): the host paths bound into the jail, each with its kind (dir, file, link: a symlink
    made again), and the directories among them hidden under an empty read-only tmpfs. No bind lies inside
    another (the boot would create its mount point in the host's directory)."""
    binds: list[tuple[str, str]] = []
    dirs: list[str] = []
    for path in (*_SYSTEM_DIRS, *_SYSTEM_FILES, *_python_paths()):
        kind = _kind(path)
        if kind is None or _under(path, dirs):
            continue
        binds.append((path, kind))
        if kind == "dir":
            dirs.append(path)
    masks = sorted({d for d in _site_dirs() if os.path.isdir(d) and _under(d, dirs)})
    return binds, masks


# ---------------------------------------------------------------- who may build it

def check_available() -> None:
    """Raise :class:`SandboxUnavailable` naming what is missing (checked when a tool is loaded)."""
    if sys.platform != "linux":
        raise SandboxUnavailable(f"the Python sandbox needs Linux namespaces; this is {sys.platform}: run relayrl on "
                                 f"Linux or drop the python tool from env.tools")
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("the Python sandbox needs util-linux's unshare on PATH; install it (apt-get install "
                                 "util-linux) or drop the python tool from env.tools")
    try:
        sandbox_seccomp.filter_program()
    except (ImportError, RuntimeError, OSError) as e:
        raise SandboxUnavailable(f"the Python sandbox filters system calls with libseccomp, which cannot be loaded "
                                 f"here ({e}); install libseccomp (apt-get install libseccomp2) and pyseccomp (pip "
                                 f"install pyseccomp), or drop the python tool from env.tools") from None
    if os.geteuid() != 0:
        why = _user_namespaces_refused()
        if why is not None:
            raise SandboxUnavailable(
                f"the Python sandbox needs root or a user namespace, and this kernel refuses user namespaces to uid "
                f"{os.geteuid()} ({why}); run relayrl as root, allow unprivileged user namespaces (sysctl "
                f"user.max_user_namespaces, kernel.unprivileged_userns_clone=1 or "
                f"kernel.apparmor_restrict_unprivileged_userns=0, by distribution), or drop the python tool from "
                f"env.tools")


@functools.lru_cache(maxsize=1)
def _user_namespaces_refused() -> str | None:
    """Why ``unshare`` cannot make the namespaces of the jail as this user (None: it can)."""
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "true"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]


# ---------------------------------------------------------------- uids of their own, and cleaning up

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


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (5 s at most)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = processes_of_uid(uid)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # it ended between the scan and the kill
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _uid_registry() -> Path:
    """The directory of uid lock files, shared by every relayrl process of this machine (root only)."""
    for d in _UID_REGISTRIES:
        try:
            d.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            continue
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise SandboxUnavailable(f"{d}, the registry of sandbox uids, must be a directory owned by root and "
                                     f"writable by root only; remove it and run again")
        return d
    raise SandboxUnavailable(f"the registry of sandbox uids cannot be made in {' or '.join(map(str, _UID_REGISTRIES))}")


@contextlib.contextmanager
def _lease_uid(base: int) -> Iterator[int]:
    """A uid no other run on this machine holds: the first of ``base``, ``base + 1``, ... whose lock file this
    process can flock. The lock lives as long as the open file, so a trainer that dies frees its uids; the
    next holder first kills what that run left."""
    registry = _uid_registry()
    for uid in range(base, base + _UID_SLOTS):
        fd = os.open(registry / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            _kill_uid(uid)
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {_UID_SLOTS} sandbox uids from env.sandbox.uid_base={base} are in use")


def _cgroup(cfg: SandboxConfig, uid: int | None) -> sandbox_cgroup.Cgroup | None:
    """The run's cgroup with its limits (None where none can be made: logged once per reason)."""
    name = f"relayrl-sandbox-{uid if uid is not None else secrets.token_hex(8)}"
    limits = sandbox_cgroup.CgroupLimits(cpus=cfg.cpus, memory_bytes=(cfg.memory_mb + cfg.disk_mb) << 20,
                                         pids=cfg.max_processes + 1)  # + pid 1
    group, why = sandbox_cgroup.create(name, limits)
    if why is not None and why not in _logged:
        _logged.add(why)
        log.warning("python sandbox: %s; runs go on without it (the rlimits still hold: CPU share is not limited, "
                    "memory is bounded per process and processes per uid)", why)
    return group


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _stop(proc: subprocess.Popen, uid: int | None) -> None:
    """End every process of the run: SIGKILL pid 1 of its PID namespace (the kernel kills the rest, and
    unshare exits once they are all gone), then the launcher, then (root mode) any process of the uid."""
    if proc.poll() is None:
        for pid in _children_of(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
    if proc.poll() is None:  # pid 1 not started yet, or stuck: the launcher's group (pid 1 is in it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if uid is not None:
        _kill_uid(uid)


# ---------------------------------------------------------------- a run

def _boot_config(cfg: SandboxConfig, uid: int | None, root: Path, group: sandbox_cgroup.Cgroup | None,
                 report_fd: int, lifeline_fd: int) -> dict:
    binds, masks = _jail_plan()
    try:
        mount_setattr = sandbox_seccomp.syscall_number("mount_setattr")
    except OSError:  # older than libseccomp 2.5.2: the boot remounts each submount
        mount_setattr = None
    return {"root": str(root), "uid": uid, "disk_mb": cfg.disk_mb, "python": os.path.realpath(sys.executable),
            "binds": binds, "masks": masks, "cgroup_procs": group.procs_files if group else [],
            "seccomp": sandbox_seccomp.filter_program().hex(), "report_fd": report_fd,
            "lifeline_fd": lifeline_fd,
            "nr": {"pivot_root": sandbox_seccomp.syscall_number("pivot_root"), "mount_setattr": mount_setattr},
            # in a user namespace pid 1 has the code's uid, and RLIMIT_NPROC counts it
            "limits": {"cpu_s": cfg.cpu_s, "as": cfg.memory_mb << 20, "fsize": cfg.file_mb << 20,
                       "nproc": cfg.max_processes + (1 if uid is None else 0)}}


def run_python(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the jail described in the module docstring; never raises for what the code does."""
    cfg = cfg or SandboxConfig()
    check_available()
    chunks = {"stdout": bytearray(), "stderr": bytearray()}
    with contextlib.ExitStack() as cleanup:  # undone in reverse: the cgroup, the jail's directory, the uid
        uid = cleanup.enter_context(_lease_uid(cfg.uid_base)) if os.geteuid() == 0 else None
        work = Path(tempfile.mkdtemp(prefix="relayrl-sbx-"))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        (work / "root").mkdir()
        group = _cgroup(cfg, uid)
        if group is not None:
            cleanup.callback(group.kill_and_remove)
        report_r, report_w = os.pipe()
        # The lifeline: pid 1 leaves (and the kernel ends the jail) when its write end closes, which this
        # process holds alone: at the end of the run, or when this process dies, SIGKILL included (the
        # launcher is in a session of its own: nothing else would stop it then).
        lifeline_r, lifeline_w = os.pipe()
        cleanup.callback(os.close, lifeline_w)
        boot_cfg = _boot_config(cfg, uid, work / "root", group, report_w, lifeline_r)
        userns = ["--user", "--map-root-user"] if uid is None else []
        cmd = ["unshare", *userns, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
               os.path.realpath(sys.executable), "-I", "-S", "-B", _BOOT, json.dumps(boot_cfg)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True, pass_fds=(report_w, lifeline_r), cwd=str(work),
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        os.close(report_w)
        os.close(lifeline_r)
        stopped_why = None
        try:
            with contextlib.suppress(BrokenPipeError):  # the code's process ended before reading it all
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            stopped_why = _collect(proc, chunks, cfg, t0)
        finally:
            for pipe in (proc.stdout, proc.stderr):  # first: a launcher that writes its last words into a full
                pipe.close()  # pipe nobody reads would never exit (the stop then waited 5 s, past wall_s)
            _stop(proc, uid)
            with os.fdopen(report_r) as f:
                report = f.read()
        oom_kills = group.oom_kills() if group is not None else 0
    stderr = chunks["stderr"].decode("utf-8", "replace")
    seconds = time.monotonic() - t0
    error, exit_code = _verdict(cfg, stopped_why, report, oom_kills, proc.returncode, stderr, seconds)
    return SandboxResult(chunks["stdout"].decode("utf-8", "replace"), stderr, exit_code, error, seconds, uid,
                         group.controllers if group is not None else ())


def _verdict(cfg: SandboxConfig, stopped_why: str | None, report: str, oom_kills: int, launcher_status: int | None,
             stderr: str, seconds: float) -> tuple[str | None, int | None]:
    """(error, exit_code) of a run from why the parent stopped it (None: it ended by itself), pid 1's report
    (JSON lines: ``{"exit": status}``, or ``{"boot_error": why}`` from the code's process before its exec),
    the memory cgroup's OOM kills and the run's wall ``seconds`` (a process cannot have used more CPU time, so
    a SIGKILL sooner than ``cpu_s`` is not RLIMIT_CPU's)."""
    records = []
    for line in report.splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by the kill
            records.append(json.loads(line))
    boot_error = next((r["boot_error"] for r in records if "boot_error" in r), None)
    exit_code = next((r["exit"] for r in records if "exit" in r), None) if stopped_why is None else None
    if boot_error is not None:
        return f"the sandbox failed to start: {boot_error}", None
    if oom_kills:
        return (f"memory limit of {cfg.memory_mb + cfg.disk_mb} MB for the whole sandbox reached ({oom_kills} "
                f"process{'es' if oom_kills > 1 else ''} killed)"), exit_code
    if stopped_why is not None:
        return stopped_why, None
    if exit_code is None:
        return f"the sandbox failed to start (launcher exit status {launcher_status}): {stderr.strip()[-300:]}", None
    if exit_code == -signal.SIGSYS:
        return "a system call of another ABI (i386 or x32), which the sandbox's filter forbids (killed)", exit_code
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and seconds >= cfg.cpu_s):
        return f"CPU time limit of {cfg.cpu_s} s reached (killed)", exit_code
    if exit_code is not None and exit_code < 0:
        return f"the code was killed by {_signal_name(-exit_code)}", exit_code
    if exit_code != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {exit_code}"
        if "MemoryError" in stderr:
            last = f"MemoryError (the memory limit is {cfg.memory_mb} MB per process)"
        return f"the code failed: {last}", exit_code
    return None, 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # (a real-time signal)
        return f"signal {number}"


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
