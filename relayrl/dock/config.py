"""Config of the sample dock, its typed records and its errors.

``DockConfig`` is the small pydantic model a workflow config embeds; the rest
are the records that cross the dock's boundary (``StageSpec``) and the
exceptions it raises, so callers can catch one family (``DockError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.errors import ProcessLost


class DockConfig(BaseModel):
    """How a :class:`relayrl.dock.Dock` is built (``Dock.from_config(cfg)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    units: int = Field(1, ge=1, description="Storage units the rows are spread over (one per node is typical on Ray).")
    backend: Literal["local", "process", "ray"] = Field(
        "local", description="'local': in-process units; 'process': one local process per unit (reachable from rank "
                             "processes); 'ray': one actor per unit. A GRPO-family run whose ranks live outside the "
                             "driver (a split placement, several devices, cluster.backend=ray) turns 'local' into "
                             "'process' (local backend) or 'ray'")
    lease_s: float = Field(60.0, gt=0.0, description="Seconds a handed-out row stays leased before it is re-delivered.")
    nodes: tuple[str, ...] = Field((), description="'ray': the IP addresses of the nodes the units live on (unit i "
                                   "on nodes[i % len(nodes)]); empty: Ray spreads them over the cluster")

    @model_validator(mode="after")
    def _check_nodes(self) -> "DockConfig":
        if self.nodes and self.backend != "ray":
            raise ValueError(f"dock.nodes places units on Ray nodes; dock.backend={self.backend!r} runs them on this "
                             f"machine: set dock.backend=ray or drop dock.nodes")
        return self


@dataclass(frozen=True)
class StageSpec:
    """What one consuming stage needs from every row of a partition.

    Attributes:
        stage: name of the consuming stage (``"reference"``, ``"update"``, ...).
        columns: columns a row must have before the stage may receive it.
        whole_groups: hand out rows only as complete groups of the partition's
            ``group_size`` consecutive indexes (all responses of one prompt).
        token_columns: columns whose row lengths count as a row's tokens (for
            token-budget batches and data-parallel balancing).
    """

    stage: str
    columns: tuple[str, ...]
    whole_groups: bool = False
    token_columns: tuple[str, ...] = ()


class DockError(RuntimeError):
    """Base class of the dock's runtime errors."""


class PartitionClosedError(DockError, KeyError):
    """A partition (or the generation of it a batch came from) is not open."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "partition closed"


class DockWriteError(DockError):
    """A put could not be stored or published; the rows are not visible."""


class UnitLostError(DockError, ProcessLost):
    """A storage unit died or stopped answering; the message names the unit (and its pid with the process
    backend, its Ray actor with the Ray one). A :class:`~relayrl.errors.ProcessLost`: ``run.max_restarts``
    starts the run again with a new dock."""


class UnitLostWriteError(DockWriteError, UnitLostError):
    """A put that was not stored because a unit it wrote to is lost: a :class:`DockWriteError` (the rows are
    not visible; ``indexes`` says which) that ``run.max_restarts`` recovers as a :class:`UnitLostError`."""


class LeaseLostError(DockError):
    """An ack came from a consumer whose lease expired and was handed to another."""
