"""The sandbox's system-call filter, compiled with libseccomp (through ``pyseccomp``, its ctypes bindings).

The filter allows every system call except those that reach other processes, the kernel's configuration
or new namespaces, which fail with ``EPERM`` (a deny list in the spirit of Docker's default profile, which
is an allow list; a deny list keeps every ordinary program working and closes what an unprivileged uid
could still do). System calls of another ABI on the same machine (i386 or x32 on x86-64) kill the process:
libseccomp adds that check for the native architecture only.

The parent compiles the filter once (:func:`filter_program`) and hands the raw BPF program to the boot
script, which installs it with ``prctl(PR_SET_SECCOMP)`` right before ``execve``: the boot needs ctypes only,
not the virtualenv this module is imported from.
"""

from __future__ import annotations

import errno
import functools
import tempfile

__all__ = ["DENIED", "CLONE_NAMESPACE_FLAGS", "filter_program", "syscall_number"]

DENIED = (
    # other processes: tracing, reading or writing their memory, taking their file descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # mounts and roots (the jail is built before the filter is loaded)
    "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "open_tree_attr", "fsopen", "fsconfig", "fsmount", "fspick",
    # new or other namespaces (clone with namespace flags: below)
    "unshare", "setns",
    # kernel surfaces an unprivileged program has no use for, and frequent hosts of kernel exploits
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "modify_ldt", "iopl", "ioperm",
    # the machine's configuration (all need privileges today; denied all the same)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "lookup_dcookie", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vhangup",
)
"""System calls that fail with EPERM inside the sandbox."""

CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000, 0x00000080)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME: ``clone`` with any is EPERM."""

_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # typing into a terminal (the sandbox has none; denied all the same)


@functools.lru_cache(maxsize=1)
def _pyseccomp():
    """The bindings, or ImportError/RuntimeError (libseccomp.so missing) for the caller to explain."""
    import pyseccomp

    return pyseccomp


def syscall_number(name: str) -> int:
    """The native number of a system call (for those glibc has no wrapper of: pivot_root, mount_setattr)."""
    nr = _pyseccomp().resolve_syscall(_pyseccomp().Arch.NATIVE, name)
    if nr < 0:
        raise OSError(errno.ENOSYS, f"libseccomp knows no system call {name!r} on this architecture")
    return nr


@functools.lru_cache(maxsize=1)
def filter_program() -> bytes:
    """The filter as a native-endian classic BPF program (8 bytes per instruction), ready for
    ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog)``."""
    sc = _pyseccomp()
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in DENIED:
        nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if nr == -1:  # not a system call of this architecture (or newer than this libseccomp)
            continue
        flt.add_rule(sc.ERRNO(errno.EPERM), nr)
    for flag in CLONE_NAMESPACE_FLAGS:
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, where a filter cannot look: ENOSYS makes glibc fall back to clone
    if sc.resolve_syscall(sc.Arch.NATIVE, "clone3") != -1:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for request in (_TIOCSTI, _TIOCLINUX):
        flt.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()
