"""Cluster config: which backend runs the worker groups, and how it connects.

A workflow holds one `ClusterConfig` and builds every group through
`make_group(cfg, ...)`, so switching from the embedded `local` backend to a Ray
cluster is a config value, never a code fork (DESIGN.md principle).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BackendName = Literal["local", "ray"]


class ClusterConfig(BaseModel):
    """Backend choice and connection settings for worker groups."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)  # (the reference's text)

    backend: BackendName = "local"
    """`local`: one rank in the driver process, more ranks as spawned processes on
    this machine. `ray`: ranks are Ray actors placed by placement groups."""
    ray_address: str | None = None
    """`None` starts a local Ray instance (`ray.init(address="local")`), unless the `RAY_ADDRESS`
    environment variable names a cluster (as a Ray job's driver has it), which is joined then; `"auto"`,
    `"host:port"` or `"ray://host:port"` connects to an existing cluster. Only read when `backend="ray"`."""
    in_process: bool = True
    """`local` backend: a one-rank group runs inside the driver process (no
    serialization). False spawns it in its own process like larger groups (its
    own interpreter lock, e.g. for a rollout that overlaps training)."""
    devices: int = Field(default=1, ge=1)
    """Devices per node of a workflow's main resource pool (GPUs, or CPU slots). The actor, reference and
    rollout groups get one rank per device: data parallel, the actor and reference sharded with FSDP2."""
    oversubscribe: bool = False
    """`local` backend on a CPU: allow more ranks (`devices` plus the placement's pools) than this machine has
    cores; refused otherwise, since every rank then shares the cores and the run only slows down."""
    nodes: int = Field(default=1, ge=1)
    """Nodes of the main resource pool (more than one needs `backend="ray"`)."""
    num_cpus: int | None = Field(default=None, ge=1)
    """CPUs for a Ray instance started by the driver (ignored when connecting)."""
    error_grace_s: float = Field(default=3.0, ge=0.0)
    """After one rank fails, how long to wait for the other ranks' replies before
    declaring the group broken (they may be stuck in a collective)."""
    start_timeout_s: float = Field(default=300.0, gt=0.0)
    """How long rank start-up (process spawn, process-group rendezvous, worker
    construction, Ray placement) may take before the driver raises."""
    collective_timeout_s: float = Field(default=1800.0, gt=0.0)
    """Timeout passed to `torch.distributed.init_process_group`."""
    call_timeout_s: float | None = Field(default=3600.0, gt=0.0)
    """How long one call on a worker group's ranks (an update, a generation, a checkpoint save) may take
    before the driver raises `CallTimeout` naming the group, the method and the ranks that had not answered,
    and stops the group's rank processes (Ray: kills its actors). It ends a rank that hangs outside a
    collective (a loop, a deadlocked lock, a server that never answers), which `collective_timeout_s` does not
    see. Twice `collective_timeout_s` by default, far above one call of a run; `None` (null): no limit. A
    one-rank group running inside the driver (`in_process`) cannot be stopped: past the limit the driver
    warns and keeps waiting."""

    @model_validator(mode="after")
    def _nodes_need_ray(self) -> "ClusterConfig":
        if self.nodes > 1 and self.backend != "ray":
            raise ValueError(f"cluster.nodes={self.nodes}: the local backend runs on one machine; set "
                             f"cluster.backend=ray (with cluster.ray_address to join a running cluster), or "
                             f"cluster.nodes=1")
        return self

    @field_validator("ray_address")
    @classmethod
    def _check_address(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("ray_address is empty: use None to start a local Ray, 'auto' or 'ray://host:port' to connect")
        return v


def as_config(backend: str | ClusterConfig) -> ClusterConfig:
    """Accept a backend name or a full config; reject anything else by name."""
    if isinstance(backend, ClusterConfig):
        return backend
    if backend in ("local", "ray"):
        return ClusterConfig(backend=backend)
    raise ValueError(f"backend={backend!r} is not supported: use 'local', 'ray' or a ClusterConfig")
