"""Direct preference optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023).

One step::

    pairs    <- the next trainer.batch_size problems that have a rejected answer
    rows     <- [prompt + chosen + EOS, prompt + rejected + EOS] per pair   (one prompt group each)
    ref_logp <- reference.logprobs(rows), summed per row                     (the frozen initial policy)
    actor.update(rows, DPO loss(beta, kind))                                 (relayrl.algorithms.dpo)

With ``trainer.precompute_ref`` the reference scores the rows of every step in one pass before the first, then
leaves memory, and each step looks its rows' ``ref_logp`` up (:mod:`relayrl.workflows.ref_logps`).

The reference-free kinds (``dpo.kind`` simpo, orpo, cpo: :mod:`relayrl.algorithms.simpo`,
:mod:`relayrl.algorithms.orpo`, :mod:`relayrl.algorithms.cpo`) build no reference model and skip its pass: the
step is the actor's update alone. Otherwise the reference is the model the run starts from
(``trainer.init_from`` or ``model.path``), or, with ``trainer.ref_sync_every``, that model moved toward the
policy every N steps (TR-DPO; :mod:`relayrl.workflows.ref_sync`). Pairs come from a dataset
(``data.answer_key`` chosen, ``data.rejected_key`` rejected, every row checked before training) or from the
built-in ``arith`` task, whose pairs prefer the true sum to the careless one that forgets to carry. The
shared-prompt packing of the training engine puts a pair into one packed unit, so its prompt is computed once
and both answers meet in the same micro-batch. Evaluation is greedy accuracy, as for SFT/GRPO.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.config.schema import Config
from relayrl.data.tasks import Problem
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.losses import DPOLoss
from relayrl.workflows.offline import OfflineRun
from relayrl.workflows.ref_logps import ReferenceLogps, Row, planned_rows
from relayrl.workflows.ref_sync import ReferenceSync
from relayrl.workflows.session import Session
from relayrl.workflows.sft import answer_ids
from relayrl.workflows.trainer_workers import ReferenceWorker

__all__ = ["train_dpo", "take_pairs", "pair_rows"]

KEY_METRICS = ("dpo/loss", "dpo/reward_accuracy", "dpo/reward_margin", "eval/accuracy", "perf/step_time_s")
MAX_DRAWS_PER_PAIR = 100


def take_pairs(take, n: int) -> list[Problem]:
    """``n`` problems with a rejected answer (``meta["rejected"]``), drawn ``take(k)`` at a time."""
    out: list[Problem] = []
    draws = 0
    while len(out) < n:
        got = take(n - len(out))
        draws += len(got)
        out += [p for p in got if p.meta.get("rejected") is not None]
        if draws >= MAX_DRAWS_PER_PAIR * n and len(out) < n:
            raise ValueError(f"DPO: only {len(out)} of {draws} problems drawn had a rejected answer; for the arith "
                             f"task draw sums that need a carry (data.task_options.carries=inner)")
    return out


def pair_rows(pairs: list[Problem]) -> list[Row]:
    """The rows of ``pairs``: each prompt with its chosen answer, then with its rejected one."""
    return [(p, text) for p in pairs for text in (p.answer, p.meta["rejected"])]


def train_dpo(cfg: Config) -> Path:
    """Run DPO; returns the final model directory."""
    s = Session(cfg)
    cfg = s.cfg  # (trainer.total_epochs resolved into trainer.steps)
    d, t = cfg.dpo, cfg.trainer
    loss = DPOLoss(beta=d.beta, kind=d.kind, label_smoothing=d.label_smoothing, nll_weight=d.nll_weight,
                   gamma=d.gamma)
    run = OfflineRun(s, loss, KEY_METRICS)
    ref = None  # SimPO, ORPO, CPO: no reference (the config refuses trainer.ref_sync_every and precompute_ref for them)
    if not loss.reference_free:
        group = run.group(ReferenceWorker, "reference", engine=cfg.engine, **run.precision["frozen"])
        ref = ReferenceLogps(s, group, run.release)
        run.ref_sync = ReferenceSync(t.ref_sync_every, t.ref_sync_alpha, run.actor, group)

    def draw(take) -> list[Row]:
        return pair_rows(take_pairs(take, t.batch_size))

    def step_batch(step: int) -> SequenceBatch:
        rows = draw(s.prompts.take)
        n = len(rows) // 2
        batch = SequenceBatch([torch.tensor(s.encode(p)) for p, _ in rows], [answer_ids(s, text) for _, text in rows],
                              {"pair": [float(i // 2) for i in range(2 * n)], "chosen": [1.0, 0.0] * n},
                              groups=[i // 2 for i in range(2 * n)])
        if ref is not None:
            batch.fields["ref_logp"] = ref(rows, batch, step)
        return batch

    def precompute() -> None:  # (after a resume: the steps left; none when the run has nothing left to train)
        if s.finished() is None and t.steps > s.start_step:
            ref.precompute(planned_rows(s.prompts, t.steps - s.start_step, draw), per_call=2 * t.batch_size)

    return run.run(step_batch, before_steps=precompute if t.precompute_ref else None)
