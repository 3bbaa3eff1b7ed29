"""Reward-model training on (prompt, chosen, rejected) pairs (``workflow: rm``; InstructGPT, Ouyang et al. 2022).

One step::

    pairs  <- the next trainer.batch_size problems that have a rejected answer   (as for DPO)
    rows   <- [prompt + chosen + EOS, prompt + rejected + EOS] per pair           (one prompt group each)
    rm.update(rows, Bradley-Terry loss(margin))                                   (relayrl.algorithms.reward_model)
    every eval.every steps: scores of the held-out pairs -> pair accuracy, reward margin, loss
                            (pair accuracy and margin also per held-out set when there are several)

The reward model is the starting model's network (``trainer.init_from`` or ``model.path``) with its
output head replaced by a zero-initialised scalar head without bias; the score of a row is the head on
the last response token's hidden state (:mod:`relayrl.models.reward`). It trains on the critic's engine
(``output="values"``), so packing, mixed precision, FSDP2, checkpoints and exact resume are those of the
other workflows, and it is saved as a Hugging Face ``*ForSequenceClassification`` with one label, which
``reward.model`` loads to score a GRPO run's responses.

Held-out pairs are the evaluation problems that have a rejected answer (the arith task's careless sum;
a dataset's ``data.rejected_key``). ``eval/accuracy`` is their pair accuracy, so ``eval.stop_at`` works
as for the other workflows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.algorithms.reward_model import bradley_terry_loss
from relayrl.config.schema import Config
from relayrl.data.tasks import Problem
from relayrl.engines.training.base import SequenceBatch
from relayrl.evaluation.metrics import per_source, source_names
from relayrl.workflows.dpo import take_pairs
from relayrl.workflows.losses import BTLoss
from relayrl.workflows.offline import OfflineRun
from relayrl.workflows.session import Session
from relayrl.workflows.sft import answer_ids
from relayrl.workflows.trainer_workers import RewardModelTrainer

__all__ = ["train_rm", "pair_batch"]

KEY_METRICS = ("rm/loss", "rm/accuracy", "eval/pair_accuracy", "eval/reward_margin", "perf/step_time_s")


def pair_batch(s: Session, pairs: list[Problem], margin: float = 0.0) -> SequenceBatch:
    """Two rows per pair, chosen first, in one prompt group; fields ``pair``, ``chosen``, ``margin``."""
    prompts = [torch.tensor(s.encode(p)) for p in pairs]
    return SequenceBatch(
        [p for p in prompts for _ in range(2)],
        [answer_ids(s, text) for p in pairs for text in (p.answer, p.meta["rejected"])],
        {"pair": [float(i) for i in range(len(pairs)) for _ in range(2)], "chosen": [1.0, 0.0] * len(pairs),
         "margin": [float(margin)] * (2 * len(pairs))},
        groups=[i for i in range(len(pairs)) for _ in range(2)],
    )


class RMRun(OfflineRun):
    """The offline loop with a reward model as the trained worker and pair scores as the evaluation."""

    def __init__(self, s: Session) -> None:
        super().__init__(s, BTLoss(margin=s.cfg.rm.margin), KEY_METRICS, actor_cls=RewardModelTrainer, rollout=False)
        self.held_out = [p for p in s.eval_problems if p.meta.get("rejected") is not None]
        if not self.held_out:
            raise ValueError("workflow rm: no held-out problem has a rejected answer; for the arith task evaluate on "
                             "sums that need a carry (data.eval_task_options.carries=inner), for a dataset give "
                             "data.eval_path rows with data.rejected_key")

    def evaluate(self, step: int) -> dict[str, float]:
        with self.s.span("eval", "actor", step):
            batch = pair_batch(self.s, self.held_out)
            values = self.actor.split(RewardModelTrainer.values, batch)
            scores = torch.stack([v[-1] for v in values]).float()  # the value at the EOS position: the row's score
        chosen, rejected = scores[0::2], scores[1::2]
        m = held_out_metrics(chosen, rejected)
        # several held-out sets (a data.eval_path list, or rows with data_source): pair accuracy and margin of each
        sources = source_names([p.meta for p in self.held_out])
        m.update(per_source(sources, lambda rows: {k: v for k, v in held_out_metrics(chosen[rows], rejected[rows])
                                                   .items() if k in ("eval/pair_accuracy", "eval/reward_margin")}))
        return m


def held_out_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """The evaluation's figures for the scores of held-out (chosen, rejected) pairs: pair accuracy (also as
    ``eval/accuracy``, which ``eval.stop_at`` reads), reward margin, loss, the two means."""
    _, m = bradley_terry_loss(chosen, rejected)
    return {"eval/pair_accuracy": m["rm/accuracy"], "eval/accuracy": m["rm/accuracy"],
            "eval/reward_margin": m["rm/reward_margin"], "eval/loss": m["rm/loss"],
            "eval/chosen_mean": m["rm/chosen_mean"], "eval/rejected_mean": m["rm/rejected_mean"]}


def train_rm(cfg: Config) -> Path:
    """Train a reward model; returns the exported model directory (a Hugging Face sequence classifier)."""
    s = Session(cfg)
    cfg = s.cfg  # (trainer.total_epochs resolved into trainer.steps)
    run = RMRun(s)
    return run.run(lambda step: pair_batch(s, take_pairs(s.prompts.take, cfg.trainer.batch_size), cfg.rm.margin))
