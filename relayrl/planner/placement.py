"""What the planner decides and what it predicts: :class:`Placement` (which pools the roles run on, their sizes,
the step mode and its staleness bound) and :class:`Prediction` (the simulated step time, throughput, each pool's
busy share and peak memory of one placement). :mod:`.simulate` and :mod:`.memory` model a placement; :mod:`.search`
ranks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Mode", "Placement", "Prediction"]

Mode = Literal["sync-colocated", "sync-split", "periodic", "offpolicy"]


@dataclass(frozen=True)
class Placement:
    """Where the roles run and how a step is scheduled."""

    mode: Mode
    main: int
    """Devices of the actor's pool (its data-parallel size): ``cluster.devices``."""
    gen: int = 0
    """Devices of the rollout's own pool (``placement.pools.gen``); 0: the rollout is on ``main``."""
    k: int = 0
    """``offpolicy``: the staleness bound ``trainer.off_policy_steps``."""
    partial: bool = False
    """``offpolicy``: partial rollout (``rollout.partial``)."""

    def __post_init__(self) -> None:
        if self.main < 1:
            raise ValueError(f"main={self.main}: the actor needs at least one device")
        if (self.mode == "sync-colocated") != (self.gen == 0):
            raise ValueError(f"mode {self.mode} with gen={self.gen}: the colocated loop has no rollout pool, the "
                             f"other modes need one (gen >= 1)")
        if (self.mode == "offpolicy") != (self.k >= 1) or (self.partial and self.mode != "offpolicy"):
            raise ValueError(f"mode {self.mode} with k={self.k}, partial={self.partial}: k >= 1 and partial are "
                             f"for mode offpolicy only, which needs k >= 1")

    @property
    def devices(self) -> int:
        return self.main + self.gen

    @property
    def pools(self) -> str:
        return f"main={self.main}" + (f" gen={self.gen}" if self.gen else "")

    @property
    def mode_name(self) -> str:
        return self.mode if self.mode != "offpolicy" else f"offpolicy-k{self.k}" + ("-partial" if self.partial else "")

    def overrides(self) -> list[str]:
        """The config overrides that run this placement."""
        out = [f"cluster.devices={self.main}"]
        if self.gen:
            out += [f"placement.pools.gen={self.gen}", "placement.rollout=gen"]
        if self.mode == "periodic":
            out.append("trainer.mode=periodic")
        if self.mode == "offpolicy":
            out += [f"trainer.off_policy_steps={self.k}", f"rollout.partial={str(self.partial).lower()}"]
        return out


@dataclass
class Prediction:
    """What :func:`relayrl.planner.simulate.simulate` predicts for one placement."""

    placement: Placement
    step_s: float
    tokens: float
    """Prompt + response tokens trained per step (the mean over the simulated steps)."""
    busy: dict[str, float]
    """Share of the step each pool computes (0..1)."""
    memory_gib: dict[str, float]
    """Peak memory of one device of each pool."""
    fits: bool
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per step of each stage (summed, they overlap in the split modes)."""
    per: int = 0
    """Devices the throughput is divided by: the placement's, or on a CPU the machine's cores (every CPU
    placement uses all of them, a device being a share)."""

    @property
    def tpspd(self) -> float:
        """Tokens per second per device (Periodic Asynchrony's TPSPD)."""
        return self.tokens / (self.step_s * (self.per or self.placement.devices))
