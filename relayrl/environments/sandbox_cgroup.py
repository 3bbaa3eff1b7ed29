"""A cgroup per sandboxed run: CPU share, memory of the whole process tree, and its number of processes.

Each controller (``cpu``, ``memory``, ``pids``) is used where this process can create a child of its own
cgroup in that controller's hierarchy: cgroup v2 where the unified hierarchy has the controller (enabling it
in this cgroup's ``cgroup.subtree_control`` when needed), else cgroup v1 where a hierarchy of it is mounted.
The run's group is a child of relayrl's own cgroup, so whatever limits relayrl runs under (a container's,
a scheduler's) still count its sandboxes. Where none can be made (no permission: not root and no delegated
cgroup; or a v2 cgroup that holds processes and has not the controllers enabled) the run goes on without it
and :func:`create` says why, for one log line.

Limits (``cpu.max`` / ``cpu.cfs_quota_us``, ``memory.max`` / ``memory.limit_in_bytes`` with swap closed
where it is accounted, ``pids.max``) are written before any process joins: the boot script moves itself
(pid 1 of the jail) into the group by writing ``0`` to each ``cgroup.procs``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupLimits", "Cgroup", "create"]

CONTROLLERS = ("cpu", "memory", "pids")
_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupLimits:
    cpus: float
    """CPU time per wall second of the whole tree (1.0: one core)."""
    memory_bytes: int
    """Memory of the whole tree (its files on tmpfs included)."""
    pids: int
    """Processes and threads of the whole tree."""


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    own: Path
    """This process's cgroup directory in the hierarchy."""
    controllers: tuple[str, ...]


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo, whose spaces and the like are octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _hierarchies() -> list[_Hierarchy]:
    """Where each of CONTROLLERS can be used by a child of this process's cgroup (v2 preferred)."""
    own_paths: dict[str, str] = {}  # "0" for v2, else the controllers of a v1 hierarchy -> path
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            own_paths["" if hid == "0" else ctrls] = path
    v2_mount, v1_mounts = None, []  # (mount point, root of the mount inside its hierarchy, controllers)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, _source, options) = left.split(), right.split()[:3]
            if fstype == "cgroup2" and v2_mount is None:
                v2_mount = (_unescape(fields[4]), _unescape(fields[3]))
            elif fstype == "cgroup":
                ctrls = tuple(o for o in options.split(",") if o in CONTROLLERS)
                if ctrls:
                    v1_mounts.append((_unescape(fields[4]), _unescape(fields[3]), ctrls))
    out, covered = [], set()
    if v2_mount is not None and "" in own_paths:
        own = _own_dir(v2_mount[0], v2_mount[1], own_paths[""])
        if own is not None:
            with contextlib.suppress(OSError):
                available = (own / "cgroup.controllers").read_text().split()
                ctrls = tuple(c for c in CONTROLLERS if c in available)
                if ctrls:
                    out.append(_Hierarchy(2, own, ctrls))
                    covered.update(ctrls)
    for point, mroot, ctrls in v1_mounts:
        ctrls = tuple(c for c in ctrls if c not in covered)
        path = next((p for key, p in own_paths.items() if key and set(key.split(",")) & set(ctrls)), None)
        own = _own_dir(point, mroot, path) if ctrls and path is not None else None
        if own is not None:
            out.append(_Hierarchy(1, own, ctrls))
            covered.update(ctrls)
    return out


def _own_dir(mount_point: str, mount_root: str, own_path: str) -> Path | None:
    """This process's cgroup directory under a mount of its hierarchy (None: the mount does not show it)."""
    rel = os.path.relpath(own_path, mount_root)
    if rel.startswith(".."):
        return None
    return Path(mount_point) / rel if rel != "." else Path(mount_point)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    """One run's group: a directory in each hierarchy used."""

    def __init__(self, dirs: list[tuple[_Hierarchy, Path]]) -> None:
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for _, d in self.dirs]

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(c for h, _ in self.dirs for c in h.controllers)

    def oom_kills(self) -> int:
        """Processes the kernel killed for the group's memory limit (memory.events / memory.oom_control)."""
        for h, d in self.dirs:
            if "memory" in h.controllers:
                name = "memory.events" if h.version == 2 else "memory.oom_control"
                with contextlib.suppress(OSError):
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
        return 0

    def kill_and_remove(self) -> None:
        """SIGKILL whatever is left in the group, then remove its directories."""
        for h, d in self.dirs:
            if h.version == 2 and (d / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(d / "cgroup.kill", "1")
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                    if not pids:
                        os.rmdir(d)
                        break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: the last processes are still exiting
                    pids = []
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() > deadline:
                    break  # a process stuck in the kernel: the group stays (empty groups cost nothing)
                time.sleep(0.01)


def _limit(h: _Hierarchy, d: Path, limits: CgroupLimits) -> None:
    if "cpu" in h.controllers:
        quota = max(int(limits.cpus * _PERIOD_US), 1000)
        if h.version == 2:
            _write(d / "cpu.max", f"{quota} {_PERIOD_US}")
        else:
            _write(d / "cpu.cfs_period_us", str(_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(quota))
    if "memory" in h.controllers:
        if h.version == 2:
            _write(d / "memory.max", str(limits.memory_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (d / name).exists():
                    _write(d / name, value)
        else:
            _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (d / "memory.memsw.limit_in_bytes").exists():  # swap is accounted: memory + swap = memory
                _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    if "pids" in h.controllers:
        _write(d / "pids.max", str(limits.pids))


def create(name: str, limits: CgroupLimits) -> tuple[Cgroup | None, str | None]:
    """The run's group with its limits set, and why a controller is missing (None: all three are used)."""
    try:
        hierarchies = _hierarchies()
    except OSError as e:
        return None, f"cannot read this process's cgroups ({e})"
    made: list[tuple[_Hierarchy, Path]] = []
    why = []
    for h in hierarchies:
        d = h.own / name
        try:
            if h.version == 2:
                enabled = (h.own / "cgroup.subtree_control").read_text().split()
                missing = [c for c in h.controllers if c not in enabled]
                if missing:
                    _write(h.own / "cgroup.subtree_control", " ".join("+" + c for c in missing))
            if d.exists():  # left by a run that died with its trainer; its uid is ours now
                Cgroup([(h, d)]).kill_and_remove()
            d.mkdir()
        except OSError as e:
            why.append(f"cannot create {d} ({e.strerror or e})")
            continue
        made.append((h, d))
        try:
            _limit(h, d, limits)
        except OSError as e:
            why.append(f"cannot set the limits of {d} ({e.strerror or e})")
            Cgroup([made.pop()]).kill_and_remove()
    group = Cgroup(made) if made else None
    missing = [c for c in CONTROLLERS if group is None or c not in group.controllers]
    if missing and not why:
        why.append("no cgroup hierarchy of this machine has them")
    return group, (f"no {', '.join(missing)} cgroup: " + "; ".join(why)) if missing else None
