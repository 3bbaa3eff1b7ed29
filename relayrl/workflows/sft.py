"""Supervised fine-tuning: the warm start before RL.

Each step takes ``trainer.batch_size`` problems (a built-in task's generator or
a dataset's rows), trains on ``prompt -> answer + EOS`` with the masked token
cross-entropy of ``relayrl.algorithms.sft``, and evaluates greedy accuracy on
the held-out set every ``eval.every`` steps with the same code as GRPO (the
loop is :mod:`relayrl.workflows.offline`).

Multi-turn rows train only the model's tokens, through the ``loss_mask`` field (0 on context tokens): a
built-in task with demonstrations (``toolsum``: tool calls, tool results, final answer; the results are
the environment's and masked) and, from a dataset with ``data.messages_key``, whole conversations of which
only the assistant turns are trained (the mask comes from the chat template, :mod:`relayrl.data.chat`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from relayrl.config.schema import Config
from relayrl.engines.training.base import LOSS_MASK_FIELD, SequenceBatch
from relayrl.workflows.losses import SFTLoss
from relayrl.workflows.offline import OfflineRun
from relayrl.workflows.session import Session

__all__ = ["train_sft", "answer_ids"]

KEY_METRICS = ("sft/loss", "eval/accuracy", "actor/lr", "perf/step_time_s")


def answer_ids(s: Session, text: str) -> torch.Tensor:
    """Token ids of an answer followed by the end-of-sequence token: what the model should write."""
    return torch.cat([torch.tensor(s.tokenizer(text, add_special_tokens=False)["input_ids"]),
                      torch.tensor([s.tokenizer.eos_token_id])])


def demonstration_ids(s: Session, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a demonstration given as ``(text, written by the model)`` segments, then
    the end-of-sequence token (the model's). Each segment is tokenized on its own, as the episode loop
    does for turns and observations."""
    ids: list[int] = []
    mask: list[int] = []
    for text, model in segments:
        t = s.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [int(model)] * len(t)
    return ids + [s.tokenizer.eos_token_id], mask + [1]


def masked_batch(rows: list[tuple[list[int], tuple[list[int], list[int]]]]) -> SequenceBatch:
    """``(prompt ids, (response ids, loss mask))`` rows as a batch with the ``loss_mask`` field."""
    return SequenceBatch([torch.tensor(p) for p, _ in rows], [torch.tensor(r) for _, (r, _) in rows],
                         {LOSS_MASK_FIELD: [torch.tensor(m, dtype=torch.float32) for _, (_, m) in rows]})


def train_sft(cfg: Config) -> Path:
    """Run SFT; returns the final model directory."""
    s = Session(cfg)
    cfg = s.cfg  # (trainer.total_epochs resolved into trainer.steps)

    demo_rng = random.Random(cfg.run.seed + 17)  # the teacher's choices (e.g. toolsum's tool_rate)

    def step_batch(step: int) -> SequenceBatch:
        problems = s.prompts.take(cfg.trainer.batch_size)
        if hasattr(s.task, "demonstration"):
            return masked_batch([(s.encode(p), demonstration_ids(s, s.task.demonstration(p, demo_rng))) for p in problems])
        if any("conversation" in p.meta for p in problems):
            from relayrl.data.chat import conversation_ids

            return masked_batch([conversation_ids(s.tokenizer, p.meta["conversation"], cfg.data.chat_template_kwargs) for p in problems])
        return SequenceBatch([torch.tensor(s.encode(p)) for p in problems], [answer_ids(s, p.answer) for p in problems])

    return OfflineRun(s, SFTLoss(), KEY_METRICS).run(step_batch)
