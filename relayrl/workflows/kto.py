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

With ``trainer.precompute_ref`` the reference scores the examples (and KL rows) of every step in one pass before the
first, then leaves memory, and each step looks its ``ref_logp`` up (:mod:`relayrl.workflows.ref_logps`: the KL
rows are still the batch's own, so ``z0`` is the same as without).

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
from relayrl.workflows.ref_logps import ReferenceLogps, Row, planned_rows
from relayrl.workflows.ref_sync import ReferenceSync
from relayrl.workflows.session import Session
from relayrl.workflows.sft import answer_ids
from relayrl.workflows.trainer_workers import PolicyWorker, ReferenceWorker

__all__ = ["train_kto", "unpaired", "kl_completions", "reference_rows", "balance_note", "one_kind_note"]

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


def reference_rows(examples: list[tuple[Problem, str, bool]]) -> list[Row]:
    """The rows a step's reference pass scores: each example, then its KL row (its prompt with the completion of
    :func:`kl_completions`)."""
    kl = kl_completions([c for _, c, _ in examples])
    return [row for (p, c, _), other in zip(examples, kl) for row in ((p, c), (p, other))]


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


def one_kind_note(desirable: int, undesirable: int) -> str | None:
    """A sentence when the training rows hold examples of one kind only, saying what the loss then does (KTO
    contrasts the two kinds; with one, only its term trains); None when both kinds are there (or neither)."""
    if bool(desirable) == bool(undesirable):
        return None
    if undesirable == 0:
        return (f"kto: the training rows hold {desirable} desirable and no undesirable examples, so the loss only "
                f"raises the desirable completions' log-probs above the reference's (nothing is pushed down to "
                f"contrast them with), and kto/rewards_undesirable, kto/logps_undesirable and kto/reward_margin "
                f"are not logged: add rows labelled false (data.label_key), or train these rows with workflow sft")
    return (f"kto: the training rows hold {undesirable} undesirable and no desirable examples, so the loss only "
            f"pushes the undesirable completions' log-probs below the reference's (nothing is raised in their "
            f"place), and kto/rewards_desirable, kto/logps_desirable and kto/reward_margin are not logged: add "
            f"rows labelled true (data.label_key)")


def train_kto(cfg: Config) -> Path:
    """Run KTO; returns the final model directory."""
    s = Session(cfg)
    cfg = s.cfg  # (trainer.total_epochs resolved into trainer.steps)
    k = cfg.kto
    if s.train_problems is not None:  # a dataset: its labels are known now (TRL warns the same way)
        good = sum(bool(p.meta.get("label")) for p in s.train_problems)
        bad = len(s.train_problems) - good
        note = one_kind_note(good, bad) or balance_note(good, bad, k.desirable_weight, k.undesirable_weight)
        if note:
            s.log(f"relayrl: warning: {note}")
    loss = KTOLoss(beta=k.beta, desirable_weight=k.desirable_weight, undesirable_weight=k.undesirable_weight,
                   loss=k.loss)
    run = OfflineRun(s, loss, KEY_METRICS)
    t = cfg.trainer
    group = run.group(ReferenceWorker, "reference", engine=cfg.engine, **run.precision["frozen"])
    ref = ReferenceLogps(s, group, run.release)
    run.ref_sync = ReferenceSync(t.ref_sync_every, t.ref_sync_alpha, run.actor, group)
    n = t.batch_size

    def draw(take) -> list[tuple[Problem, str, bool]]:
        return unpaired(take_pairs(take, n) if s.train_problems is None else take(n))

    def scored_rows(ex: list[tuple[Problem, str, bool]]) -> list[Row]:
        """The rows the reference scores for a step's examples: with the KL term, each beside its KL row."""
        return reference_rows(ex) if loss.estimates_kl else [(p, c) for p, c, _ in ex]

    def step_batch(step: int) -> SequenceBatch:
        ex = draw(s.prompts.take)
        prompts = [torch.tensor(s.encode(p)) for p, _, _ in ex]
        ids = [answer_ids(s, text) for _, text, _ in ex]
        good = sum(d for _, _, d in ex)
        batch = SequenceBatch(prompts, ids, {"desirable": [float(d) for _, _, d in ex],
                                             "n_desirable": [float(good)] * n, "n_undesirable": [float(n - good)] * n},
                              groups=list(range(n)))
        if not loss.estimates_kl:  # apo_zero_unpaired: no z0, so no mismatched rows to score
            batch.fields["ref_logp"] = ref(scored_rows(ex), batch, step)
            return batch
        kl_ids = kl_completions(ids)
        both = SequenceBatch([p for p in prompts for _ in range(2)], [r for pair in zip(ids, kl_ids) for r in pair],
                             groups=[i for i in range(n) for _ in range(2)])  # row i beside its KL row: one prompt
        ref_lp = ref(reference_rows(ex), both, step)
        with s.span("kl_logprob", "actor", step):
            kl_lp = [float(lp.sum()) for lp in run.actor.split(PolicyWorker.logprobs,
                                                                SequenceBatch(prompts, kl_ids, groups=list(range(n))))]
        z0 = float(kl_estimate(torch.tensor(kl_lp, dtype=torch.float64), torch.tensor(ref_lp[1::2],
                                                                                     dtype=torch.float64)))
        batch.fields.update(ref_logp=ref_lp[0::2], kto_kl=[z0] * n)
        return batch

    def precompute() -> None:  # (after a resume: the steps left; none when the run has nothing left to train)
        if s.finished() is None and t.steps > s.start_step:
            plan = planned_rows(s.prompts, t.steps - s.start_step, lambda take: scored_rows(draw(take)))
            ref.precompute(plan, per_call=2 * n)

    return run.run(step_batch, before_steps=precompute if t.precompute_ref else None)
