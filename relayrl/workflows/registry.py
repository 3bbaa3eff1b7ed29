"""The workflows by config name (``workflow:``).

Each entry is the import path of a ``train(cfg) -> model dir`` function, imported when it runs (a run of
one workflow does not import the others). A new workflow is a module with that function and one line here.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Callable

from relayrl.config.schema import Config

__all__ = ["WORKFLOWS", "train", "train_grpo"]

WORKFLOWS: dict[str, str] = {
    "grpo": "relayrl.workflows.registry:train_grpo",
    "sft": "relayrl.workflows.sft:train_sft",
    "dpo": "relayrl.workflows.dpo:train_dpo",
    "rm": "relayrl.workflows.rm:train_rm",
}


def train(cfg: Config) -> Path:
    """Run ``cfg.workflow``; returns the directory of the trained model."""
    module, _, name = WORKFLOWS[cfg.workflow].partition(":")
    fn: Callable[[Config], Path] = getattr(import_module(module), name)
    return fn(cfg)


def train_grpo(cfg: Config) -> Path:
    """Run a GRPO-family workflow (synchronous, periodic, or k-step off-policy); returns the model dir."""
    from relayrl.workflows.pipeline import GRPOPipeline

    return GRPOPipeline(cfg).run()
