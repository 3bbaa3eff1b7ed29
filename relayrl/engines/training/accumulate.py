"""One optimizer step over a batch that arrives in chunks: the trainer side of periodic asynchrony.

Periodic asynchrony (Periodic Asynchrony §4.3) starts training as soon as the
first prompt groups of a batch finish generating: the trainer runs forward and
backward on each finished group as it arrives, gradients accumulating, and
takes one optimizer step once the whole batch is consumed. The update must
equal the synchronous one (``train_step(full_batch, mini_batches=1,
epochs=1)``), whatever the arrival order and however the rows are cut into
chunks::

    rollout --finished groups--> accumulate(chunk) --+  forward + backward per micro-batch,
            --finished groups--> accumulate(chunk) --+  gradients add up in .grad,
            ...                                      |  metric partial sums kept
    batch consumed ------------> finish_accumulation()  counts summed (all-reduced), gradients
                                                        rescaled, clip, optimizer + scheduler step

**Normalisation (unit denominators, rescaled at the end).** A loss divides by a
batch-wide count, ``global_tokens``, ``global_seqs`` or ``global_groups`` (:class:`MicroBatch`),
which is known only when the last chunk has arrived. Every term of the losses
here has the form ``sum over rows / N`` with ``N`` the count the loss declares
as ``loss_fn.normalized_by`` (``"tokens"``, ``"seqs"`` or ``"groups"``). The chunks run with
``global_tokens = global_seqs = global_groups = 1``, so each backward adds the gradient of the
*unnormalised* sum; :meth:`StreamedUpdate.finish_accumulation` sums the counts
(over chunks and data-parallel ranks), multiplies every gradient by ``1 / N``
and only then clips and steps. By linearity this is the full-batch gradient,
exactly (up to float rounding: ``(sum g) / N`` instead of ``sum (g / N)``). The
same factor rescales the loss metrics (names ending in ``loss`` and the loss's
``summed`` names, which the contract says are normalised by the global counts);
means are token-weighted over the whole batch and do not depend on ``N``;
``_max`` / ``_min`` take extremes; ``..tokens`` are raw counts.

What this asks of a loss: one normaliser for all its terms (a token-mean policy
loss with a sequence-mean KL term could not be rescaled by one factor), and no
other use of the counts. :class:`relayrl.workflows.losses.PolicyLoss` (policy
loss, KL term and entropy bonus all aggregate with its one ``agg``),
``ValueLoss`` and ``SFTLoss`` declare theirs. ``seq-mean-token-sum-norm``
needs its constant fixed (``agg_constant``), else it divides by each
micro-batch's padded width, which depends on how rows were cut (as for
micro-batching in ``train_step``). ``DPOLoss`` declares none (its NLL term
divides by ``global_seqs // 2``), so it is refused. A loss that weighs prompt
groups (``"groups"``, ``loss_agg=prompt-mean-token-mean``) weighs each token by
its group's token count, taken over the chunk: every chunk must hold whole
prompt groups (a group id met again in a later chunk is refused), as the
workflow's leases of whole groups do.

Data parallel (FSDP2): each of :meth:`~StreamedUpdate.accumulate` and
:meth:`~StreamedUpdate.finish_accumulation` is a collective. Every rank must
get the same number of ``accumulate`` calls, but a rank's chunk may be empty
(fewer finished rows than ranks): within a call every rank runs as many
forward/backward passes as the busiest, padding with zero-loss passes (a
one-token row when it has none). The counts and the metrics are summed over
ranks at the finish; gradients are summed over ranks by each backward, as in
``train_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relayrl.algorithms._checks import host_floats
from relayrl.engines.training import fsdp
from relayrl.engines.training.base import LossFn, SequenceBatch, finished, metric_reduction, with_group_tokens

__all__ = ["MetricSums", "StreamedUpdate"]


def _device(*values) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


@dataclass
class MetricSums:
    """A loss's metrics summed over micro-batches (and chunks) before the reduction over ranks: means as
    token-weighted sums, per-response figures as sums weighted by responses, sums as sums, ``_max`` / ``_min``
    as extremes (:func:`metric_reduction`); and the engine's counters."""

    summed: tuple[str, ...] = ()
    """The loss's own summed metric names (``loss_fn.summed``)."""
    with_reference: bool = False
    """Whether the passes ran the reference (adds the ``ref_forward_*`` counters)."""
    values: dict[str, float] = field(default_factory=dict)
    forward_tokens: int = 0
    """Padded input tokens of the policy passes (padding passes of a sharded engine not counted)."""
    ref_passes: int = 0
    ref_tokens: int = 0
    routing: list = field(default_factory=list)
    """Routing replay: each pass's ``(matched, replayed)`` expert picks (device tensors)."""

    def add(self, metrics: dict[str, float | torch.Tensor], weight: float | torch.Tensor,
            seqs: float | torch.Tensor, forward_tokens: int, with_reference: bool,
            routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One micro-batch's metrics; ``weight``: its valid response tokens, ``seqs``: its responses with a valid
        token (the weight of a ``seq`` figure: what ``global_seqs`` counts). Values may be floats or 0-dim
        float64 tensors on the device (:func:`relayrl.algorithms._checks.deferred_metrics`): sums and extremes
        stay on the device then, and :meth:`reduce` reads them to the host together."""
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):  # a loss of the caller's may hand its metric with its graph
                v = v.detach().reshape(()).double()
            how = metric_reduction(k, self.summed)
            if how in ("mean", "seq", "sum"):
                self.values[k] = self.values.get(k, 0.0) + {"mean": weight, "seq": seqs}.get(how, 1.0) * v
            elif k not in self.values:
                self.values[k] = v
            elif isinstance(v, torch.Tensor) or isinstance(self.values[k], torch.Tensor):
                pick, where = torch.maximum if how == "max" else torch.minimum, _device(v, self.values[k])
                self.values[k] = pick(*(torch.as_tensor(x, dtype=torch.float64, device=where)
                                        for x in (self.values[k], v)))
            else:
                self.values[k] = max(self.values[k], v) if how == "max" else min(self.values[k], v)
        self.forward_tokens += forward_tokens
        if routing is not None:
            self.routing.append(routing)
        if with_reference:
            self.ref_passes += 1
            self.ref_tokens += forward_tokens

    def reduce(self, device: torch.device, global_tokens: int, global_seqs: int, prefix: str, *,
               scale: float = 1.0, agree_names: bool = False, counted: bool = True) -> dict[str, float]:
        """The metrics over the whole batch (a collective when sharded): means divided by ``global_tokens``,
        per-response figures by ``global_seqs``, normalised sums (``..loss``, ``summed``) multiplied by
        ``scale``. ``agree_names``: ranks may hold different names (a rank that saw no rows has none), so they
        first agree on the union. ``counted=False``: another rank reports the same figures (a sequence-parallel
        rank after its group's first): this one adds zeros to the sums and counters."""
        how = {k: metric_reduction(k, self.summed) for k in self.values}
        values = host_floats(self.values)  # the step's one read of metrics kept on the device
        if not counted:
            values = {k: v if how[k] in ("max", "min") else 0.0 for k, v in values.items()}
        if agree_names:
            neutral = {"max": float("-inf"), "min": float("inf")}
            for k in fsdp.union_over_ranks(list(values)):
                if k not in values:
                    how[k] = metric_reduction(k, self.summed)
                    values[k] = neutral.get(how[k], 0.0)
        values = fsdp.reduce_over_ranks(values, how, device)
        out = {}
        for k, v in values.items():
            if how[k] == "mean":
                v = v / max(global_tokens, 1)
            elif how[k] == "seq":
                v = v / max(global_seqs, 1)
            elif how[k] == "sum" and (k.endswith("loss") or k in self.summed):
                v = v * scale
            out[k] = v
        counters = [self.forward_tokens, self.ref_passes, self.ref_tokens] if counted else [0, 0, 0]
        # routing replay's picks: every rank counts its own (an SP rank's routers see only its columns)
        matched, picks = (host_floats({"m": sum(m for m, _ in self.routing), "p": sum(p for _, p in self.routing)})
                          .values() if self.routing else (0.0, 0.0))
        fwd, ref_passes, ref_tokens, matched, picks = fsdp.sum_over_ranks([*counters, matched, picks], device)
        fwd, ref_passes, ref_tokens = int(fwd), int(ref_passes), int(ref_tokens)  # (counts: ints on any world size)
        out[f"{prefix}/forward_tokens"] = fwd
        if picks:
            out[f"{prefix}/routing_agreement"] = matched / picks
        if self.with_reference:
            out[f"{prefix}/ref_forward_passes"] = ref_passes
            out[f"{prefix}/ref_forward_tokens"] = ref_tokens
        return out


@dataclass
class _Accumulation:
    """An open streamed update: what the finish needs."""

    normalized_by: str | None = None
    loss_fn: LossFn | None = None
    """The first chunk's loss (its ``finish`` completes the metrics)."""
    partial: MetricSums | None = None
    tokens: int = 0
    seqs: int = 0
    groups: float = 0.0
    seen_groups: set[int] = field(default_factory=set)
    """The prompt-group ids of the chunks so far, when the loss weighs groups (each must be whole in its chunk)."""


class StreamedUpdate:
    """The streamed update of :class:`~relayrl.engines.training.torch_engine.TorchTrainingEngine` (a mixin
    of it: it uses the engine's passes and optimizer step). See the module docstring."""

    _accumulation: _Accumulation | None = None

    def _grad_sync(self, last: bool) -> None:
        """Sharded, before a pass: with ``dp_sync=step`` only the last pass before an optimizer step reshards
        the parameters and reduce-scatters the gradients; the others keep the gathered parameters (no
        all-gather in the next pass) and add into every rank's unsharded gradients. ``dp_sync=pass``: every
        pass gathers, reshards and reduces (FSDP2's default)."""
        if self.sharded:
            sync = last or self.cfg.dp_sync == "pass"
            self.net.set_requires_gradient_sync(sync)
            self.net.set_reshard_after_forward(sync)
            self.net.set_reshard_after_backward(sync)

    def _sync_gradients(self) -> None:
        """Sharded, ``dp_sync=step``, after passes that did not reduce (streamed chunks): reduce-scatter the
        held gradients and reshard the parameters now, through one zero-loss one-token pass (FSDP2 reduces
        the held gradients with that pass's zero ones). A collective: every rank calls it once."""
        if not self.sharded or self.cfg.dp_sync == "pass":
            return
        self._grad_sync(True)
        batch, item = self._one_token()
        (self._forward(batch, item, 1.0, False, False).logprobs.sum() * 0.0).backward()

    def begin_accumulation(self) -> None:
        """Open a streamed update (discarding any open one and its gradients)."""
        if self.optimizer is None:
            raise RuntimeError("begin_accumulation on an engine built with trainable=False")
        if self._accumulation is not None and self._accumulation.partial is not None:
            self._sync_gradients()  # a discarded update's held (unreduced) gradients must not reach the next
        self.optimizer.zero_grad(set_to_none=True)
        self.runner.train()
        self._accumulation = _Accumulation()

    def accumulate(self, batch: SequenceBatch, loss_fn: LossFn, *, temperature: float = 1.0,
                   with_entropy: bool | str = False, with_reference: bool = False) -> None:
        """Forward and backward of every micro-batch of ``batch`` (any number of rows, none included),
        gradients accumulated, the loss seeing unit counts; metric partial sums kept. A collective when
        sharded (every rank makes the same number of calls). Every call of one update passes the same kind
        of loss (``normalized_by``, ``summed``) and the same ``with_reference``."""
        acc = self._accumulation
        if acc is None:
            raise RuntimeError("accumulate before begin_accumulation()")
        by = getattr(loss_fn, "normalized_by", None)
        if by not in ("tokens", "seqs", "groups"):
            raise ValueError(f"accumulate needs the loss to declare normalized_by='tokens', 'seqs' or 'groups' (the "
                             f"global count all its terms divide by); {type(loss_fn).__name__} gives {by!r}: use "
                             f"train_step")
        summed = tuple(getattr(loss_fn, "summed", ()))
        if acc.partial is None:
            acc.normalized_by, acc.loss_fn, acc.partial = by, loss_fn, MetricSums(summed, with_reference)
        elif (by, summed, with_reference) != (acc.normalized_by, acc.partial.summed, acc.partial.with_reference):
            raise ValueError(f"accumulate: the chunks of one update must share the loss's normalized_by and "
                             f"summed metrics, and with_reference: this chunk gives {(by, summed, with_reference)}, "
                             f"the first gave {(acc.normalized_by, acc.partial.summed, acc.partial.with_reference)}")
        batch, _ = self._pool(batch)  # sequence parallel: the SP group's rows on each of its ranks
        if by == "groups":
            batch = self._whole_groups(batch, loss_fn, acc)
        self._backward(batch, loss_fn, temperature, with_entropy, with_reference, (1, 1, 1.0), acc.partial,
                       sync=False)
        acc.tokens += batch.num_tokens
        acc.seqs += batch.num_seqs
        acc.groups += batch.num_groups

    @staticmethod
    def _whole_groups(batch: SequenceBatch, loss_fn: LossFn, acc: _Accumulation) -> SequenceBatch:
        """``batch`` with its rows' group token counts, taken over the chunk; a group that an earlier chunk of
        this update held is refused (its rows would be weighed by part of its tokens)."""
        batch = with_group_tokens(batch, loss_fn)
        ids = set(batch.groups or ())
        split = sorted(ids & acc.seen_groups)
        if split:
            raise ValueError(f"accumulate: prompt group(s) {split[:5]} were in an earlier chunk of this update; a "
                             f"loss that weighs prompt groups (loss_agg=prompt-mean-token-mean) needs every chunk "
                             f"to hold whole groups")
        acc.seen_groups |= ids
        return batch

    def finish_accumulation(self) -> dict[str, float]:
        """Rescale the accumulated gradients by ``1 / N`` (``N``: the batch's global count the loss
        normalises by), clip, step the optimizer and the scheduler. Returns the metrics ``train_step`` returns
        for the union of the chunks (``forward_tokens`` counts the chunks' own packing). A collective when
        sharded."""
        acc, self._accumulation = self._accumulation, None
        if acc is None or acc.partial is None:
            raise RuntimeError("finish_accumulation without begin_accumulation() and accumulate()")
        g_tokens, g_seqs, g_groups = self._global(acc.tokens, acc.seqs, acc.groups)
        if g_seqs == 0:
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError("finish_accumulation: the accumulated chunks hold no rows")
        self._sync_gradients()  # the chunks' passes left the reduction over ranks to the end
        count = {"tokens": g_tokens, "seqs": g_seqs, "groups": g_groups}[acc.normalized_by]
        scale = 1.0 / (count if acc.normalized_by == "groups" and count > 0 else max(count, 1))
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        metrics = acc.partial.reduce(self.device, g_tokens, g_seqs, self.prefix, scale=scale,
                                     agree_names=self.sharded, counted=self._counts_own)
        return finished(acc.loss_fn, self._apply_gradients(metrics))
