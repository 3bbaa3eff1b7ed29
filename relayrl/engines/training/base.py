"""The training-engine interface and the records it exchanges.

Engines do not know the algorithm. A workflow hands the engine a
:class:`SequenceBatch` (unpadded rows) and a *loss function*; the engine pads
at the last moment, runs forward/backward over micro-batches, and steps the
optimizer. The loss function receives a :class:`MicroBatch` whose padded
tensors are response-aligned (``[B, T]``) and the **global** token and sequence
counts of the mini-batch, so losses normalised by them sum to the full-batch
loss over micro-batches (Periodic Asynchrony §3).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Protocol, Sequence

import torch

from relayrl.algorithms.aggregation import group_token_counts
from relayrl.engines.training.config import OptimConfig  # the optimizer's settings, torch-free (re-exported)

__all__ = ["SequenceBatch", "balanced_cuts", "MicroBatch", "LossFn", "REF_FIELD", "LOSS_MASK_FIELD",
           "GROUP_TOKENS_FIELD", "with_group_tokens", "metric_reduction", "finished", "OptimConfig", "TrainingEngine"]

REF_FIELD = "ref_logprobs"
"""The batch field of the reference policy's log-probs ([B, T] in a micro-batch); an engine holding a frozen
reference fills it in place (``with_reference``)."""

LOSS_MASK_FIELD = "loss_mask"
"""The optional per-token batch field (1-D float per row, aligned with the response) that says which
response tokens the model wrote (1) and which an environment wrote (0: tool output, user turns in a
multi-turn episode or chat). An engine multiplies it into :attr:`MicroBatch.mask`, so every loss term,
token count (``global_tokens``) and masked metric sees only the model's tokens; the 0 tokens are context
(the model attends to them) and are never trained on."""

GROUP_TOKENS_FIELD = "group_tokens"
"""The per-row batch field (0-D float) of a loss that weighs prompt groups (``normalized_by="groups"``,
``loss_agg=prompt-mean-token-mean``): the valid response tokens of the row's whole prompt group
(:func:`relayrl.algorithms.aggregation.group_token_counts`). An engine fills it from ``SequenceBatch.groups``
where the groups are whole (:meth:`SequenceBatch.with_group_tokens`) and counts the groups from it
(:attr:`MicroBatch.global_groups`)."""


@dataclass
class SequenceBatch:
    """Rows of prompt + response, unpadded, with per-row fields.

    ``fields`` values are lists with one entry per row: a 1-D tensor aligned
    with the response tokens (``old_logprobs``, ``advantages``, ``ref_logprobs``)
    or a 0-D tensor / float per sequence (``rewards``).
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    fields: dict[str, list] = field(default_factory=dict)
    groups: list[int] | None = None
    """Prompt-group id per row (rows of one group share their prompt); lets an engine pack a group
    as one prompt + its responses (shared-prompt attention, Periodic Asynchrony)."""
    routes: list[torch.Tensor] | None = None
    """Mixture-of-experts routing replay (:mod:`relayrl.models.routing`): per row, the experts the generator
    chose for each token of prompt + response, ``[tokens, MoE layers, top_k]`` (the last token's row may be
    missing: the generator never ran it). A policy engine built with ``routing_replay`` makes its routers choose
    them."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) != len(self.response_ids):
            raise ValueError(f"prompt_ids has {len(self.prompt_ids)} rows but response_ids has {len(self.response_ids)}")
        if self.groups is not None and len(self.groups) != len(self.response_ids):
            raise ValueError(f"groups has {len(self.groups)} rows, expected {len(self.response_ids)}")
        for k, v in self.fields.items():
            if len(v) != len(self.response_ids):
                raise ValueError(f"field {k!r} has {len(v)} rows, expected {len(self.response_ids)}")
        if self.routes is not None and len(self.routes) != len(self.response_ids):
            raise ValueError(f"routes has {len(self.routes)} rows, expected {len(self.response_ids)}")

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        """Response tokens a loss sees: all of them, or with a ``loss_mask`` field only its 1 tokens."""
        if LOSS_MASK_FIELD in self.fields:
            return int(sum(float(m.sum()) for m in self.fields[LOSS_MASK_FIELD]))
        return sum(int(r.numel()) for r in self.response_ids)

    @property
    def num_seqs(self) -> int:
        """Rows a loss sees: those with at least one response token it trains on (a row whose ``loss_mask`` is
        all 0 is no sequence to a ``seq-mean-*`` aggregation, :func:`~relayrl.algorithms.aggregation.aggregate`)."""
        return sum(n > 0 for n in self.row_tokens())

    def row_tokens(self) -> list[float]:
        """Response tokens a loss sees in each row (``loss_mask``'s 1 tokens when the batch has one)."""
        if LOSS_MASK_FIELD in self.fields:
            return [float(m.sum()) for m in self.fields[LOSS_MASK_FIELD]]
        return [float(r.numel()) for r in self.response_ids]

    @property
    def num_groups(self) -> float:
        """Prompt groups a loss sees, each row counting its share of its group's tokens
        (``GROUP_TOKENS_FIELD``; :func:`~relayrl.algorithms.aggregation.count_groups`): a whole group 1, a
        group with no token to train on 0, part of a group its share. 0 without the field."""
        if GROUP_TOKENS_FIELD not in self.fields:
            return 0.0
        return sum(n / max(float(g), 1.0) for n, g in zip(self.row_tokens(), self.fields[GROUP_TOKENS_FIELD]))

    def with_group_tokens(self) -> "SequenceBatch":
        """This batch with ``GROUP_TOKENS_FIELD`` computed from ``groups`` over its own rows, so each of its
        prompt groups must be whole here (a step's batch on a rank, a streamed chunk of whole groups)."""
        if self.groups is None:
            raise ValueError("a loss that weighs prompt groups (loss_agg=prompt-mean-token-mean) needs the rows' "
                             "prompt groups: SequenceBatch.groups is None")
        counts = group_token_counts(self.row_tokens(), self.groups) if len(self) else torch.zeros(0)
        return replace(self, fields={**self.fields, GROUP_TOKENS_FIELD: list(counts)})

    def select(self, rows: Sequence[int]) -> "SequenceBatch":
        return SequenceBatch(
            [self.prompt_ids[i] for i in rows],
            [self.response_ids[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in self.fields.items()},
            None if self.groups is None else [self.groups[i] for i in rows],
            None if self.routes is None else [self.routes[i] for i in rows],
        )

    def split(self, n: int) -> list["SequenceBatch"]:
        """``n`` contiguous, non-empty chunks of about equal tokens (prompt + response), for data-parallel
        dispatch: chunks are cut between prompt groups where possible, so a group stays on one rank (its
        prompt is then computed once). Order is kept, so results concatenated in rank order line up."""
        if not 1 <= n <= len(self):
            raise ValueError(f"cannot split {len(self)} rows over {n} data-parallel ranks: every rank needs a row")
        cost = [int(p.numel() + r.numel()) for p, r in zip(self.prompt_ids, self.response_ids)]
        cuts = balanced_cuts(cost, n, None if self.groups is None else
                             [i for i in range(1, len(self)) if self.groups[i] != self.groups[i - 1]])
        bounds = [0, *cuts, len(self)]
        return [self.select(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    @classmethod
    def concat(cls, parts: Sequence["SequenceBatch"]) -> "SequenceBatch":
        keys = parts[0].fields.keys() if parts else []
        groups = None if not parts or any(p.groups is None for p in parts) else [g for p in parts for g in p.groups]
        routed = [p for p in parts if len(p)]
        routes = None if not routed or any(p.routes is None for p in routed) else [r for p in routed for r in p.routes]
        return cls(
            [t for p in parts for t in p.prompt_ids],
            [t for p in parts for t in p.response_ids],
            {k: [t for p in parts for t in p.fields[k]] for k in keys},
            groups,
            routes,
        )


def balanced_cuts(cost: Sequence[int], n: int, preferred: Sequence[int] | None = None) -> list[int]:
    """``n - 1`` increasing cut positions in ``1..len(cost)-1`` that split ``cost`` into ``n`` non-empty
    contiguous runs of about equal sum. Each cut is the ``preferred`` position (e.g. group boundaries)
    nearest to its share of the total, or the nearest row boundary when no preferred one fits."""
    total, prefix = 0, [0]
    for c in cost:
        total += c
        prefix.append(total)
    cuts: list[int] = []
    for k in range(1, n):
        lo, hi = (cuts[-1] if cuts else 0) + 1, len(cost) - (n - k)  # leave a row for every later chunk
        target = total * k / n
        fits = [c for c in (preferred if preferred is not None else ()) if lo <= c <= hi]
        pool = fits or range(lo, hi + 1)
        cuts.append(min(pool, key=lambda c: (abs(prefix[c] - target), c)))
    return cuts


@dataclass
class MicroBatch:
    """What a loss function sees: padded, response-aligned tensors of one micro-batch."""

    logprobs: torch.Tensor
    """[B, T] log-probs of the response tokens under the current model (with grad)."""
    mask: torch.Tensor
    """[B, T] float, 1 on valid response tokens that the model wrote (times the ``loss_mask`` field when the
    batch has one)."""
    fields: dict[str, torch.Tensor]
    """Each batch field padded to [B, T] (token-aligned) or [B] (per sequence)."""
    global_tokens: int
    """Valid response tokens in the whole mini-batch (all micro-batches, all data-parallel ranks)."""
    global_seqs: int
    """Sequences in the whole mini-batch."""
    entropy: torch.Tensor | None = None
    """[B, T] token entropy when the loss asked for it."""
    global_groups: float = 0.0
    """Prompt groups in the whole mini-batch (:attr:`SequenceBatch.num_groups` summed over micro-batches and
    ranks) when the loss weighs groups (``normalized_by="groups"``); 0 otherwise."""


LossFn = Callable[[MicroBatch], "tuple[torch.Tensor, dict[str, float]]"]
"""``loss_fn(micro_batch) -> (loss, metrics)``. The engine reports each metric over the whole mini-batch
(all micro-batches and data-parallel ranks), reduced as :func:`metric_reduction` says. A loss function may
name in a ``summed`` attribute metrics it already normalises by the global counts (summed as they are).
A loss whose every term is a sum over rows divided by one of the counts says which in a ``normalized_by``
attribute (``"tokens"``: ``global_tokens``, ``"seqs"``: ``global_seqs``, ``"groups"``: ``global_groups``, for
which the engine hands it the ``group_tokens`` field too); only such a loss can be streamed
(``accumulate``, :mod:`relayrl.engines.training.accumulate`), which fixes the count at the end. Metric
values are floats or 0-dim tensors; the engine calls the loss inside
:func:`relayrl.algorithms._checks.deferred_metrics`, where relayrl's losses leave them on the device, and reads
an optimizer step's metrics to the host at once. A figure that is no reduction of its micro-batches' (SFT's
perplexity, ``exp`` of the batch's mean NLL) comes from a ``finish`` attribute, ``finish(metrics) -> metrics``,
which the engine calls on the update's reduced metrics (:func:`finished`)."""


def finished(loss_fn: LossFn, metrics: dict[str, float]) -> dict[str, float]:
    """An update's reduced ``metrics`` through the loss's ``finish`` (when it has one)."""
    finish = getattr(loss_fn, "finish", None)
    return finish(metrics) if finish is not None else metrics


def with_group_tokens(batch: SequenceBatch, loss_fn: LossFn) -> SequenceBatch:
    """``batch`` with each row's group token count (``GROUP_TOKENS_FIELD``, over ``batch``'s rows) when ``loss_fn``
    weighs prompt groups (``normalized_by="groups"``) and the batch does not carry it; ``batch`` itself
    otherwise. An engine calls it on what it is handed whole: a step's batch before the mini-batches cut its
    groups apart, a streamed chunk."""
    if getattr(loss_fn, "normalized_by", None) != "groups" or GROUP_TOKENS_FIELD in batch.fields:
        return batch
    return batch.with_group_tokens()


def metric_reduction(name: str, summed: Sequence[str] = ()) -> Literal["sum", "max", "min", "seq", "mean"]:
    """How a loss metric combines over micro-batches and ranks, by its name: ``..loss`` is summed (a
    micro-batch's loss is its share of the mini-batch's, normalised by the global counts), as are the
    counters (``..tokens``, ``..passes``) and the names in ``summed``; ``.._max`` / ``.._min`` take the extreme; a figure per response
    (``seq``: a name whose part after the ``/`` starts with ``seq_`` or ends with ``_seq_mean``,
    ``correction/seq_capped_frac``, ``actor/seq_ratio_mean``) is a mean weighted by the micro-batch's responses
    with a token to train on; anything else is a mean weighted by response tokens."""
    if name.endswith(("loss", "tokens", "passes")) or name in summed:
        return "sum"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    leaf = name.rpartition("/")[2]
    if leaf.startswith("seq_") or leaf.endswith("_seq_mean"):
        return "seq"
    return "mean"


class TrainingEngine(Protocol):
    """Log-probs, updates, and weights of the policy (or critic) being trained."""

    def logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-row log-probs of the response tokens (and entropies), unpadded."""
        ...

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int = 1, epochs: int = 1,
                   temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        """Epochs x mini-batches optimizer steps over the batch; the steps' metrics combined by kind
        (:func:`relayrl.engines.training.steps.over_steps`: token means over the batch, extremes, summed counts,
        the losses and grad norms averaged)."""
        ...

    def begin_accumulation(self) -> None:
        """Open a streamed update: one optimizer step over chunks that arrive one by one."""
        ...

    def accumulate(self, batch: SequenceBatch, loss_fn: LossFn, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> None:
        """Forward + backward of a chunk, gradients accumulated (``loss_fn`` declares ``normalized_by``)."""
        ...

    def finish_accumulation(self) -> dict[str, float]:
        """The streamed update's optimizer step: ``train_step``'s update and metrics on the union of the chunks."""
        ...

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Current weights by name (no copy) for the weight relay and checkpoints."""
        ...
