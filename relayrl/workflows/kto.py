"""KTO on unpaired completions, each labelled desirable or undesirable (Ethayarajh et al. 2024; TRL's
KTOTrainer with ``loss_type="kto"`` or ``"apo_zero_unpaired"``, ``kto.loss``).

One step::

    examples <- the next trainer.batch_size (prompt, completion, desirable) examples
    kl rows  <- prompt i with the completion of example i - 1 (cyclically): mismatched pairs of the batch
    ref_logp <- reference.logprobs(examples + kl rows), summed per row         (the frozen initial policy)
    kl_logp  <- actor.logprobs(kl rows), summed per row                         (no gradient)
    z0       <- mean(kl_logp - ref_kl_logp), clamped at 0                        (relayrl.algorithms.kto)
    actor.update(examples, KTO loss(beta, z0, weights))

With ``kto.loss=apo_zero_unpaired`` (unpaired APO-zero: KTO against ``z0 = 0``) there are no kl rows, no
``kl_logp`` pass and no ``z0``: the reference's pass covers the examples alone.

``z0`` is estimated with the weights the update starts from, before it, as TRL's step computes it in the same
forward pass under ``no_grad``: the KL rows never enter the gradient. Examples come from a dataset in TRL's
unpaired format (``data.answer_key`` the completion, ``data.label_key`` true / false, every row checked before
training) or from the built-in ``arith`` task, whose pairs are split: of each batch's drawn sums the even
positions give the true sum as a desirable example, the odd ones the careless sum (that forgets to carry) as
an undesirable one, so no prompt appears with both. The reference is the model the run starts from, or with
``trainer.ref_sync_every`` that model moved toward the policy (TR-DPO's update, as for DPO). Evaluation is
greedy accuracy on the held-out set (of a dataset: its rows labelled desirable).
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.algorithms.kto import kl_estimate
from relayrl.config.schema import Config
from relayrl.data.tasks import Problem
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.dpo import take_pairs
from relayrl.workflows.losses import KTOLoss
from relayrl.workflows.offline import OfflineRun
from relayrl.workflows.ref_sync import ReferenceSync
from relayrl.workflows.session import Session
from relayrl.workflows.sft import answer_ids
from relayrl.workflows.workers import PolicyWorker, ReferenceWorker

__all__ = ["train_kto", "unpaired", "kl_completions", "balance_note"]

KEY_METRICS = ("kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "eval/accuracy",
               "perf/step_time_s")


def unpaired(problems: list[Problem]) -> list[tuple[Problem, str, bool]]:
    """``(problem, completion, desirable)`` per problem: a dataset row's answer and ``meta["label"]``; a
    problem with a rejected answer (``meta["rejected"]``, the arith task's pairs) gives its answer at even
    positions (desirable) and its rejected answer at odd ones (undesirable)."""
    out = []
    for i, p in enumerate(problems):
        if "label" in p.meta:
            out.append((p, p.answer, bool(p.meta["label"])))
        elif p.meta.get("rejected") is not None:
            out.append((p, p.answer, True) if i % 2 == 0 else (p, p.meta["rejected"], False))
        else:
            raise ValueError(f"KTO: problem {p.prompt!r} has neither a label nor a rejected answer")
    return out


def kl_completions(completions: list) -> list:
    """The completions of the batch's mismatched rows: row ``i`` takes example ``i - 1``'s (the last's for
    row 0), as TRL's KTO builds its KL dataset."""
    return completions[-1:] + completions[:-1]


def balance_note(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """A sentence when the weighted desirable examples are not 1 to 4/3 times the weighted undesirable ones (KTO's
    paper, section 4: with fewer desirable examples, raise ``desirable_weight``); None when they are, or when one
    kind is missing (nothing to balance)."""
    if not desirable or not undesirable or not undesirable_weight:
        return None
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if 1.0 <= ratio <= 4.0 / 3.0:
        return None
    lo, hi = undesirable_weight * undesirable / desirable, 4.0 / 3.0 * undesirable_weight * undesirable / desirable
    return (f"kto: the training rows hold {desirable} desirable and {undesirable} undesirable examples, so "
            f"desirable_weight x {desirable} / (undesirable_weight x {undesirable}) = {ratio:.2f}, outside the 1 to "
            f"4/3 KTO's paper recommends: set kto.desirable_weight between {lo:.2f} and {hi:.2f}")


def train_kto(cfg: Config) -> Path:
    """Run KTO; returns the final model directory."""
    s = Session(cfg)
    cfg = s.cfg  # (trainer.total_epochs resolved into trainer.steps)
    k = cfg.kto
    if s.train_problems is not None:  # a dataset: its labels are known now (TRL warns the same way)
        good = sum(bool(p.meta.get("label")) for p in s.train_problems)
        note = balance_note(good, len(s.train_problems) - good, k.desirable_weight, k.undesirable_weight)
        if note:
            s.log(f"relayrl: warning: {note}")
    loss = KTOLoss(beta=k.beta, desirable_weight=k.desirable_weight, undesirable_weight=k.undesirable_weight,
                   loss=k.loss)
    run = OfflineRun(s, loss, KEY_METRICS)
    ref = run.group(ReferenceWorker, "reference", engine=cfg.engine, **run.precision["frozen"])
    run.ref_sync = ReferenceSync(cfg.trainer.ref_sync_every, cfg.trainer.ref_sync_alpha, run.actor, ref)
    n = cfg.trainer.batch_size

    def step_batch(step: int) -> SequenceBatch:
        problems = take_pairs(s.prompts.take, n) if s.train_problems is None else s.prompts.take(n)
        ex = unpaired(problems)
        prompts = [torch.tensor(s.encode(p)) for p, _, _ in ex]
        ids = [answer_ids(s, text) for _, text, _ in ex]
        good = sum(d for _, _, d in ex)
        batch = SequenceBatch(prompts, ids, {"desirable": [float(d) for _, _, d in ex],
                                             "n_desirable": [float(good)] * n, "n_undesirable": [float(n - good)] * n},
                              groups=list(range(n)))
        if not loss.estimates_kl:  # apo_zero_unpaired: no z0, so no mismatched rows to score
            with s.span("ref_logprob", "reference", step):
                batch.fields["ref_logp"] = [float(lp.sum()) for lp in ref.split(ReferenceWorker.logprobs, batch)]
            return batch
        kl_ids = kl_completions(ids)
        both = SequenceBatch([p for p in prompts for _ in range(2)], [r for pair in zip(ids, kl_ids) for r in pair],
                             groups=[i for i in range(n) for _ in range(2)])  # row i beside its KL row: one prompt
        with s.span("ref_logprob", "reference", step):
            ref_lp = [float(lp.sum()) for lp in ref.split(ReferenceWorker.logprobs, both)]
        with s.span("kl_logprob", "actor", step):
            kl_lp = [float(lp.sum()) for lp in run.actor.split(PolicyWorker.logprobs,
                                                                SequenceBatch(prompts, kl_ids, groups=list(range(n))))]
        z0 = float(kl_estimate(torch.tensor(kl_lp, dtype=torch.float64), torch.tensor(ref_lp[1::2],
                                                                                     dtype=torch.float64)))
        batch.fields.update(ref_logp=ref_lp[0::2], kto_kl=[z0] * n)
        return batch

    return run.run(step_batch)
