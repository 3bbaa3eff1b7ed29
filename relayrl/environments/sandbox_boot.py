"""The sandbox's boot: pid 1 of the jail's new namespaces builds the jail, then starts the code in it.

:func:`relayrl.environments.sandbox.run_python` runs this file as a script, ``python -I -S -B sandbox_boot.py
CONFIG``, under ``unshare`` (as root, or as root of a new user namespace); it reads the code on stdin. It uses
the standard library only (the virtualenv is not on its path) and is never imported. Its steps:

0. watch the lifeline (a pipe whose write end only the relayrl process that started the run holds): when it
   reads end of file, that process has ended the run or died (SIGKILL included), and pid 1 leaves at once, so
   the kernel kills everything in the jail;
1. join the run's cgroups (so that pid 1 and everything it starts is counted);
2. make every mount private, mount a tmpfs as the new root, with /work and /tmp on a second one of
   ``disk_mb``, and bind into it, read-only and recursively (``mount_setattr(AT_RECURSIVE)``, or a remount
   of each submount where the kernel lacks it): the system directories, the Python install's executable,
   standard library and shared libraries; hide the install's site-packages under an empty read-only tmpfs;
   bind /dev/null, /dev/zero, /dev/urandom;
3. ``pivot_root`` into the new root, detach the old one (no path leads back to the host's tree) and make
   the new root read-only (/work and /tmp stay writable);
4. fork the code's process: drop every capability (bounding set, ambient, securebits so that ``execve`` as
   root grants none), change to the run's uid where there is one (root mode), set the rlimits,
   ``PR_SET_PDEATHSIG``, ``PR_SET_NO_NEW_PRIVS``, load the seccomp filter, and ``execve`` the code;
5. reap every process until the code's own ends, report its exit status and exit (the kernel then kills
   whatever is left in the PID namespace).
"""

import ctypes
import json
import os
import re
import resource
import sys
import threading

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_RECURSIVE = -100, 0x100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = (
    1, 22, 24, 28, 38, 47)
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
# SECBIT_NOROOT (+ its lock), KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE (+ its lock): execve as uid 0 grants no
# capability and nothing can bring one back. Not NO_SETUID_FIXUP: setuid to the run's uid must clear them.
SECUREBITS = 0x01 | 0x02 | 0x20 | 0x40 | 0x80
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)


def _fail(what):
    e = ctypes.get_errno()
    raise OSError(e, "sandbox: %s: %s" % (what, os.strerror(e)))


def _enc(s):
    return None if s is None else s.encode()


def mount(src, tgt, fstype, flags, data=None):
    if libc.mount(_enc(src), _enc(tgt), _enc(fstype), ctypes.c_ulong(flags), _enc(data)) != 0:
        _fail("mount %s on %s" % (src, tgt))


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


_MS_OF_OPTION = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                 "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


def _mounts_under(tgt):
    """Mount points at or below ``tgt`` with their per-mount flags, parents first (/proc/self/mountinfo)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
            if point == tgt or point.startswith(tgt.rstrip("/") + "/"):
                flags = 0
                for opt in fields[5].split(","):
                    flags |= _MS_OF_OPTION.get(opt, 0)
                out.append((point, flags))
    return out


def seal(tgt, mount_setattr_nr, device=False):
    """Make the mount at ``tgt`` and every mount below it read-only, nosuid and nodev (a device: writable,
    nosuid and noexec): one atomic ``mount_setattr(AT_RECURSIVE)``, or a remount of each (kernels before
    5.12)."""
    if device:
        attr, extra = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, MS_NOSUID | MS_NOEXEC
    else:
        attr, extra = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, MS_RDONLY | MS_NOSUID | MS_NODEV
    if mount_setattr_nr is not None:
        ma = MountAttr(attr, 0, 0, 0)
        r = libc.syscall(ctypes.c_long(mount_setattr_nr), ctypes.c_long(AT_FDCWD), _enc(tgt),
                         ctypes.c_uint(AT_RECURSIVE | AT_SYMLINK_NOFOLLOW), ctypes.byref(ma),
                         ctypes.c_size_t(ctypes.sizeof(ma)))
        if r == 0:
            return
        if ctypes.get_errno() != 38:  # ENOSYS: an older kernel, remount each mount below
            _fail("mount_setattr %s" % tgt)
    for point, flags in _mounts_under(tgt):  # keep each mount's own flags: a user namespace may not clear them
        mount(None, point, None, MS_BIND | MS_REMOUNT | flags | extra)


def build_root(cfg):
    """Mount the jail at cfg["root"] (step 2)."""
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")  # read-only once built
    sealed = []
    for src, kind in cfg["binds"]:
        tgt = root + src
        os.makedirs(os.path.dirname(tgt), exist_ok=True)
        if kind == "link":
            os.symlink(os.readlink(src), tgt)
            continue
        if kind == "dir":
            os.makedirs(tgt, exist_ok=True)
        else:
            open(tgt, "w").close()
        mount(src, tgt, None, MS_BIND | MS_REC)
        sealed.append(tgt)
    for path in cfg["masks"]:  # an empty, read-only directory over the install's site-packages
        mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=755")
    for tgt in sealed:
        seal(tgt, cfg["nr"]["mount_setattr"])
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        open(root + dev, "w").close()
        mount(dev, root + dev, None, MS_BIND)
        seal(root + dev, cfg["nr"]["mount_setattr"], device=True)
    scratch = root + "/.scratch"  # /work and /tmp share one tmpfs of disk_mb
    os.mkdir(scratch)
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % cfg["disk_mb"])
    for d, mode in (("/work", 0o700), ("/tmp", 0o1777)):
        os.mkdir(scratch + d)
        os.chmod(scratch + d, mode)
        os.makedirs(root + d, exist_ok=True)
        mount(scratch + d, root + d, None, MS_BIND)
    if libc.umount2(_enc(scratch), MNT_DETACH) != 0:
        _fail("detach %s" % scratch)
    os.rmdir(scratch)


def pivot(root, pivot_root_nr):
    """Make ``root`` the root of this mount namespace and detach the host's (step 3)."""
    old = root + "/.oldroot"
    os.mkdir(old)
    if libc.syscall(ctypes.c_long(pivot_root_nr), _enc(root), _enc(old)) != 0:
        _fail("pivot_root to %s" % root)
    os.chdir("/")
    if libc.umount2(b"/.oldroot", MNT_DETACH) != 0:
        _fail("detach the old root")
    os.rmdir("/.oldroot")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # not /work, /tmp below it


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _prctl(what, option, *args):
    if libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(a) for a in args + (0,) * (4 - len(args)))) != 0:
        _fail(what)


def become_code(cfg, last_cap):
    """In the code's process: give up everything, then execve the code (step 4)."""
    os.chdir("/work")
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for cap in range(last_cap + 1):
        _prctl("drop capability %d from the bounding set" % cap, PR_CAPBSET_DROP, cap)
    _prctl("clear ambient capabilities", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl("set securebits", PR_SET_SECUREBITS, SECUREBITS)
    uid = cfg["uid"]
    if uid is not None:  # root mode: a uid of its own (a user namespace maps one uid only: stay its root)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    data = (CapData * 2)()
    if libc.capset(ctypes.byref(CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        _fail("drop capabilities")
    _prctl("PR_SET_PDEATHSIG", PR_SET_PDEATHSIG, 9)  # dies with pid 1 (the uid change cleared it)
    lim = cfg["limits"]
    for name, value in (("RLIMIT_CPU", (lim["cpu_s"], lim["cpu_s"] + 1)), ("RLIMIT_AS", (lim["as"], lim["as"])),
                        ("RLIMIT_NPROC", (lim["nproc"], lim["nproc"])), ("RLIMIT_FSIZE", (lim["fsize"], lim["fsize"])),
                        ("RLIMIT_NOFILE", (64, 64)), ("RLIMIT_CORE", (0, 0))):
        resource.setrlimit(getattr(resource, name), value)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    argv = [cfg["python"], "-I", "-S", "-B", "/work/main.py"]
    _prctl("PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1)
    prog = ctypes.create_string_buffer(bytes.fromhex(cfg["seccomp"]))
    fprog = SockFprog(len(prog.raw) // 8, ctypes.cast(prog, ctypes.c_void_p))
    if libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        _fail("load the seccomp filter")
    os.execve(cfg["python"], argv, env)


def watch_lifeline(fd):
    """Leave (pid 1: the kernel then kills the whole PID namespace) once ``fd``, the read end of the lifeline,
    reads end of file: every write end is closed, so the process that started the run is done with it or gone."""
    os.set_inheritable(fd, False)  # the code's execve closes it

    def body():
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(1)

    threading.Thread(target=body, name="lifeline", daemon=True).start()


def main():
    cfg = json.loads(sys.argv[1])
    watch_lifeline(cfg["lifeline_fd"])
    for procs in cfg["cgroup_procs"]:  # step 1: "0" moves the writer
        with open(procs, "w") as f:
            f.write("0")
    with open("/proc/sys/kernel/cap_last_cap") as f:  # read now: /proc is not mounted in the jail
        last_cap = int(f.read())
    build_root(cfg)
    root, uid = cfg["root"], cfg["uid"]
    code = sys.stdin.buffer.read()
    with open(root + "/work/main.py", "wb") as f:
        f.write(code)
    if uid is not None:
        os.chown(root + "/work", uid, uid)
        os.chown(root + "/work/main.py", uid, uid)
    pivot(root, cfg["nr"]["pivot_root"])
    os.set_inheritable(cfg["report_fd"], False)  # the code's execve closes it
    report = os.fdopen(cfg["report_fd"], "w")
    child = os.fork()
    if child == 0:
        try:
            become_code(cfg, last_cap)
        except BaseException as e:  # reported as "the sandbox failed to start: ..."
            report.write(json.dumps({"boot_error": str(e)}) + "\n")
            report.flush()
        os._exit(127)
    os.close(0)
    for fd in (1, 2):  # pid 1 keeps no end of the output pipes: they close when the code's processes end
        os.dup2(os.open("/dev/null", os.O_WRONLY), fd)
    while True:  # pid 1 reaps every orphan until the code's own process ends; then the kernel kills the rest
        pid, status = os.wait()
        if pid == child:
            break
    report.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")
    report.close()


if __name__ == "__main__":
    main()
