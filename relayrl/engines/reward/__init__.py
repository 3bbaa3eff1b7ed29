"""Rewards: rule verifiers (built-in tasks, math via math-verify, exact match), format rewards,
and user reward functions loaded by dotted path (relayrl's shape, TRL's and verl's: :class:`CallShape`),
behind one batched :class:`RewardEngine`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relayrl.engines.reward.config import RewardConfig, RewardError
from relayrl.engines.reward.user import CallShape, RewardFn, call_shape, check_rewards, load_reward_fn
from relayrl.engines.reward.verifiers import (
    exact_reward,
    extract_boxed,
    extract_last_number,
    format_reward,
    math_reward,
)

if TYPE_CHECKING:
    from relayrl.engines.reward.engine import RewardEngine


def __getattr__(name: str) -> Any:
    # The engine (torch) is imported when first asked for: the config is read while a recipe is validated,
    # before torch is imported.
    if name != "RewardEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from relayrl.engines.reward.engine import RewardEngine

    globals()[name] = RewardEngine
    return RewardEngine


__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardEngine",
    "RewardFn",
    "CallShape",
    "call_shape",
    "load_reward_fn",
    "check_rewards",
    "exact_reward",
    "math_reward",
    "extract_boxed",
    "extract_last_number",
    "format_reward",
]
