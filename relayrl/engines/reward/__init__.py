"""Rewards: rule verifiers (built-in tasks, math via math-verify, exact match), format rewards,
and user reward functions loaded by dotted path, behind one batched :class:`RewardEngine`."""

from relayrl.engines.reward.config import RewardConfig, RewardError
from relayrl.engines.reward.engine import RewardEngine
from relayrl.engines.reward.user import RewardFn, check_rewards, load_reward_fn
from relayrl.engines.reward.verifiers import (
    exact_reward,
    extract_boxed,
    extract_last_number,
    format_reward,
    math_reward,
)

__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardEngine",
    "RewardFn",
    "load_reward_fn",
    "check_rewards",
    "exact_reward",
    "math_reward",
    "extract_boxed",
    "extract_last_number",
    "format_reward",
]
