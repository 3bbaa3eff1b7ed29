"""`Worker`: the base class of everything a worker group runs on its ranks.

HybridFlow gives each model a ParallelWorker base class that, given
its devices, sets up the process groups for SPMD computation. Here the group
sets up `torch.distributed` (rank, world size, master address) *before* the
subclass's `__init__` runs, so the subclass can build FSDP or tensor-parallel
modules right away; the base only records where the rank sits. Departure: no
3D-parallel groups are built here (a worker builds its own device meshes from
the default process group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RankInfo:
    """Where one rank of a group sits."""

    group_name: str
    """Name of the worker group."""
    rank: int
    """Rank in the group, 0..world_size-1 (also the torch.distributed rank)."""
    world_size: int
    """Number of ranks in the group."""
    local_rank: int
    """Rank among this group's ranks on the same node."""
    device: str
    """Device string, e.g. `"cpu"` or `"cuda:1"`."""
    distributed: bool
    """Whether a torch.distributed process group was initialised for the group."""
    devices: tuple[str, ...] = ()
    """Every device the rank owns, ``device`` first: more than one when the group gives each rank several
    (``devices_per_rank``, e.g. a vLLM engine with tensor parallelism); empty means ``(device,)``."""

    @property
    def owned(self) -> tuple[str, ...]:
        """The rank's devices: ``devices``, or ``(device,)`` when the group gives each rank one."""
        return self.devices or (self.device,)


class Worker:
    """Base class for a group's rank. Subclasses define `__init__(**init_kwargs)`
    and public methods the driver calls by reference (``group.all(MyWorker.method)``) or by name; only the
    name travels to the ranks.

    Before `__init__` runs, these are set: `rank`, `world_size`, `local_rank`,
    `device` (a `torch.device`), `devices` (every device the rank owns, `device` first), `group_name`,
    `distributed`.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    devices: tuple[torch.device, ...]
    group_name: str
    distributed: bool

    def _relayrl_bind(self, info: RankInfo) -> None:
        self.rank = info.rank
        self.world_size = info.world_size
        self.local_rank = info.local_rank
        self.device = torch.device(info.device)
        self.devices = tuple(torch.device(d) for d in info.owned)
        self.group_name = info.group_name
        self.distributed = info.distributed


def construct_worker(worker_cls: type, info: RankInfo, init_kwargs: dict) -> Worker:
    """Create `worker_cls` with its rank attributes set before `__init__` runs."""
    obj = worker_cls.__new__(worker_cls)
    obj._relayrl_bind(info)
    obj.__init__(**init_kwargs)
    return obj


def check_worker_class(worker_cls: object) -> type:
    """Reject a non-`Worker` class with a clear message."""
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"worker_cls={worker_cls!r} must be a subclass of relayrl.cluster.Worker")
    return worker_cls


def check_method(worker_cls: type, group: str, method: str) -> None:
    """Reject a call to a private or missing method before anything is sent."""
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise ValueError(f"group {group!r}: method={method!r} must be the name of a public method of {worker_cls.__name__}")
    if not callable(getattr(worker_cls, method, None)):
        raise AttributeError(f"group {group!r}: {worker_cls.__name__} has no method {method!r}")


def method_name(worker_cls: type, group: str, method: Callable | str) -> str:
    """The name under which ``method`` is called on the ranks of a group of ``worker_cls`` (only the name
    travels to the ranks: the function is never pickled).

    ``method`` is either

    * a reference to a public function defined on ``worker_cls`` or one of its bases, taken from the class
      (``PolicyWorker.update``; a static method or a class method the same way): its name is its
      ``__name__``, where ``getattr(worker_cls, name)`` is that same function (else the public attribute of
      ``worker_cls`` holding it: a method replaced by a function of another name, as a test's patch may);
      a method of another class is refused before anything is sent, naming both classes; or
    * its name, a string (``"update"``), as before.
    """
    if isinstance(method, str):
        check_method(worker_cls, group, method)
        return method
    name = getattr(method, "__name__", None)
    owner = getattr(method, "__self__", None)
    if not callable(method) or not isinstance(name, str) or (owner is not None and not isinstance(owner, type)):
        raise TypeError(f"group {group!r}: method={method!r} must be a method of {worker_cls.__name__} taken from "
                        f"the class (e.g. {worker_cls.__name__}.some_method) or its name")
    where = getattr(method, "__qualname__", name)
    found = getattr(worker_cls, name, None)
    if _same(found, method):
        resolved = name
    else:  # (a method replaced on the class by a function of another name, e.g. a test's patched lambda)
        resolved = next((k for k in dir(worker_cls) if not k.startswith("_")
                         and _same(getattr(worker_cls, k, None), method)), None)
    if resolved is None and (found is None or not callable(found)):
        raise AttributeError(f"group {group!r}: {worker_cls.__name__} has no method {name!r} ({where} is a "
                             f"method of another class); the group runs {worker_cls.__name__}")
    if resolved is None:
        mine = getattr(found, "__qualname__", f"{worker_cls.__name__}.{name}")
        raise ValueError(f"group {group!r} runs {worker_cls.__name__}, whose {name!r} is {mine}, not {where}: "
                         f"pass a method of {worker_cls.__name__} or one of its bases")
    if resolved.startswith("_"):
        raise ValueError(f"group {group!r}: {where} is private; the ranks run public methods of "
                         f"{worker_cls.__name__} only")
    return resolved


def _same(found: object, method: Callable) -> bool:
    """Whether the class attribute ``found`` is ``method`` (a class method's binding compared by function)."""
    return found is not None and getattr(found, "__func__", found) is getattr(method, "__func__", method)
