"""An episode's sample columns: what a step puts in ``info["log_extra"]`` reaches the episode's record.

A single-turn response's reward extras (TRL's ``log_extra``, a verl dict's keys beside ``"score"``) are
fields of its row in ``RUN_DIR/samples.jsonl`` (:mod:`relayrl.engines.reward.extra`). An episode's reward is
its environment's, given in a step; the tools environment scores the final answer with the run's reward
engine, and what the reward functions log for it comes back in that step's ``info["log_extra"]`` (a dict,
column -> value). The episode keeps them (:attr:`~relayrl.environments.base.Episode.extras`, a later step's
value of a column replacing an earlier one's), the rollout writes them into the dock beside ``env_rewards``
as the UTF-8 bytes of a JSON object (``env_extras``: the dock holds tensors), and the score stage hands them
on as the row's columns, as it hands on a single-turn row's.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from relayrl.engines.reward.extra import json_value

__all__ = ["EXTRAS_COLUMN", "step_extras", "encode_extras", "decode_extras"]

EXTRAS_COLUMN = "env_extras"


def step_extras(info: dict[str, Any], where: str) -> dict[str, Any]:
    """``info["log_extra"]`` checked (a dict of non-empty str keys and JSON-able values; ``{}`` without one);
    ``ValueError`` naming ``where`` and the key otherwise (the episode ends with it as its error)."""
    got = info.get("log_extra")
    if got is None:
        return {}
    if not isinstance(got, dict) or not all(isinstance(k, str) and k for k in got):
        raise ValueError(f"{where}: info['log_extra'] must be a dict of column name -> value (non-empty str "
                         f"keys), got {type(got).__name__} {str(got)[:80]!r}")
    try:
        return {k: json_value(v, k, 0) for k, v in got.items()}
    except Exception as e:  # (ExtraError: the value JSON cannot hold)
        raise ValueError(f"{where}: info['log_extra']: {e}") from None


def encode_extras(extras: dict[str, Any]) -> torch.Tensor:
    """An episode's extras as a dock row: the UTF-8 bytes of their JSON object, ``uint8 [L]``."""
    return torch.tensor(list(json.dumps(extras, ensure_ascii=False).encode()), dtype=torch.uint8)


def decode_extras(row: torch.Tensor) -> dict[str, Any]:
    """:func:`encode_extras` back."""
    return json.loads(bytes(row.tolist()).decode())
