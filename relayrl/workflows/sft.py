"""Supervised fine-tuning: the warm start before RL.

Each step takes ``trainer.batch_size`` problems (a built-in task's generator or
a dataset's rows), trains on ``prompt -> answer + EOS`` with the masked token
cross-entropy of ``relayrl.algorithms.sft``, and evaluates greedy accuracy on
the held-out set every ``eval.every`` steps with the same code as GRPO (the
loop is :mod:`relayrl.workflows.offline`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.config.schema import Config
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.losses import SFTLoss
from relayrl.workflows.offline import OfflineRun
from relayrl.workflows.session import Session

__all__ = ["train_sft", "answer_ids"]

KEY_METRICS = ("sft/loss", "eval/accuracy", "actor/lr", "perf/step_time_s")


def answer_ids(s: Session, text: str) -> torch.Tensor:
    """Token ids of an answer followed by the end-of-sequence token: what the model should write."""
    return torch.cat([torch.tensor(s.tokenizer(text, add_special_tokens=False)["input_ids"]),
                      torch.tensor([s.tokenizer.eos_token_id])])


def train_sft(cfg: Config) -> Path:
    """Run SFT; returns the final model directory."""
    s = Session(cfg)

    def step_batch(step: int) -> SequenceBatch:
        problems = s.prompts.take(cfg.trainer.batch_size)
        return SequenceBatch([torch.tensor(s.encode(p)) for p in problems], [answer_ids(s, p.answer) for p in problems])

    return OfflineRun(s, SFTLoss(), KEY_METRICS).run(step_batch)
