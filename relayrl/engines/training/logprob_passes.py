"""The training engine's forward-only passes: per-row log-probs of a batch, with the reference's, each position's
``sum_v p_v^2`` or the routers' choices from the same pass (:class:`LogprobPasses`).

A mixin of :class:`~relayrl.engines.training.torch_engine.TorchTrainingEngine`: it runs the engine's micro-batch
pass (``_forward``) over its plan (``_plan``) in eval mode, on the rows an SP group pools (``_pool``), with
the padding passes a sharded engine's ranks need to gather each layer as often as the busiest one (a rank
given no rows runs them on a one-token row and returns no rows).
"""

from __future__ import annotations

import torch

from relayrl.engines.training import fsdp
from relayrl.engines.training.base import SequenceBatch

__all__ = ["LogprobPasses"]


class LogprobPasses:
    """Forward-only passes of the engine (module docstring)."""

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0, with_entropy: bool = False):
        lp, ent, _, _, _ = self._logprob_rows(batch, temperature, with_entropy, with_reference=False)
        return lp, ent

    @torch.no_grad()
    def logprobs_with_reference(self, batch: SequenceBatch, *, temperature: float = 1.0):
        """Per-row log-probs of the policy and of the frozen reference (``reference=``), from one micro-step
        per micro-batch: both passes run on the same packed input. Returns ``(policy, reference)``."""
        lp, _, ref, _, _ = self._logprob_rows(batch, temperature, False, with_reference=True)
        return lp, ref

    @torch.no_grad()
    def logprobs_with_sum_sq(self, batch: SequenceBatch, *, temperature: float = 1.0):
        """Per-row log-probs and each position's ``sum_v p_v^2`` (both under ``softmax(logits / temperature)``,
        from one pass): the Optimal Token Baseline's statistics (:mod:`relayrl.algorithms.otb`)."""
        lp, _, _, sq, _ = self._logprob_rows(batch, temperature, False, with_reference=False, with_sum_sq=True)
        return lp, sq

    @torch.no_grad()
    def logprobs_with_routes(self, batch: SequenceBatch, *, temperature: float = 1.0, with_sum_sq: bool = False):
        """Per-row log-probs and the experts the policy's routers chose for every token of each row
        (``[prompt + response, layers, k]`` int16: routing replay of the old policy, R2), from one pass; and with
        ``with_sum_sq`` each position's ``sum_v p_v^2``. Returns ``(logprobs, routes, sum_sq or None)``."""
        lp, _, _, sq, routes = self._logprob_rows(batch, temperature, False, with_reference=False,
                                                  with_sum_sq=with_sum_sq, record=True)
        return lp, routes, sq

    def _logprob_rows(self, batch: SequenceBatch, temperature: float, with_entropy: bool, with_reference: bool,
                      with_sum_sq: bool = False, record: bool = False):
        batch, own = self._pool(batch)
        was_training = self.runner.training
        self.runner.eval()
        out: dict[str, list[torch.Tensor | None]] = {k: [None] * len(batch) for k in ("lp", "ent", "ref", "sq", "rt")}
        plan = self._plan(batch)
        if self.sharded:  # every rank gathers each layer as often as the busiest rank (a rank without rows, as
            # a streamed chunk of fewer groups than ranks leaves one, on a one-token row)
            pad_batch, pad_item = (batch, plan[-1]) if plan else self._one_token()
            for _ in range(fsdp.max_over_ranks(len(plan), self.device) - len(plan)):
                self._forward(pad_batch, pad_item, temperature, False, with_reference)
        for item in plan:
            f = self._forward(batch, item, temperature, with_entropy, with_reference, with_sum_sq, record)
            for key, t in (("lp", f.logprobs), ("ent", f.entropy), ("ref", f.ref), ("sq", f.sum_sq)):
                for j, i in enumerate(f.rows if t is not None else ()):
                    out[key][i] = t[j, :int(batch.response_ids[i].numel())].float().cpu()
            for i, r in (f.recorded_routes or {}).items():
                out["rt"][i] = r
        self.runner.train(was_training)
        return tuple(out[k][own.start:own.stop] if on else None for k, on in (
            ("lp", True), ("ent", with_entropy), ("ref", with_reference), ("sq", with_sum_sq), ("rt", record)))
