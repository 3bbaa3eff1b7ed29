"""The training engine's side of mixture-of-experts routing (:mod:`relayrl.models.routing`): which routes a pass
replays, recording what its routers chose, the agreement between the two, and the load-balancing loss
(``engine.router_aux_loss_coef``).

:class:`RoutedPasses` is a mixin of :class:`~relayrl.engines.training.torch_engine.TorchTrainingEngine`; it
reads the engine's ``routing`` (a :class:`~relayrl.models.routing.Routing` on the module the passes run, or None
without ``routing_replay``), ``_balance`` (:func:`~relayrl.models.routing.load_balancing`, or None), ``sp`` (its
sequence-parallel group), ``cfg``, ``prefix`` and ``device``.
"""

from __future__ import annotations

import contextlib

import torch

from relayrl.engines.training.base import SequenceBatch
from relayrl.engines.training.config import TrainEngineConfig
from relayrl.models import routing

__all__ = ["RoutedPasses"]


class RoutedPasses:
    """Routing replay in the engine's passes (module docstring)."""

    routing: routing.Routing | None
    device: torch.device
    _balance = None  # engine.router_aux_loss_coef > 0: routing.load_balancing of the policy
    cfg: TrainEngineConfig
    prefix: str

    def _routes(self, batch: SequenceBatch, seq_row: torch.Tensor, seq_pos: torch.Tensor, cols: slice = slice(None)):
        """Routing replay: the batch's recorded routes of this pass's ``[P, L]`` tokens (``cols``: this SP rank's
        columns), flattened as the routers see them; None without routing replay."""
        if self.routing is None:
            return None
        if batch.routes is None:
            raise ValueError("this engine replays MoE routing (routing_replay), but the batch carries no routes: "
                             f"the rollout must record them ({routing.ROUTES_COLUMN})")
        tokens = [int(p.numel() + r.numel()) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        r = routing.laid_out(batch.routes, seq_row, seq_pos, self.routing.shape, tokens)[:, cols]
        return r.reshape(-1, *r.shape[2:]).to(self.device)

    def _replay(self, routes: torch.Tensor | None) -> None:
        """The policy pass replays ``routes``: reset the agreement count (a reference pass on the same modules
        ran unreplayed)."""
        if self.routing is not None:
            self.routing.take_counts()
            self.routing.replay(routes)

    def _agreement(self, routes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pass's ``(matched, replayed)`` expert picks (None: it replayed nothing)."""
        return None if routes is None else self.routing.take_counts()

    def _record(self, record: bool):
        if not record:
            return contextlib.nullcontext()
        if self.routing is None:
            raise ValueError("recording the routers' choices needs an engine built with routing_replay")
        return self.routing.record()

    def _gathered(self, rec, rows: int) -> torch.Tensor:
        """A recorded pass's routes as ``[P, L, layers, k]``; a sequence-parallel rank's columns joined with its
        group's (a collective)."""
        routes = rec.routes()  # [P * L, layers, k]
        local = routes.reshape(rows, -1, *routes.shape[1:])
        if not self.sp:
            return local
        parts = [torch.empty_like(local) for _ in range(self.sp.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=self.sp.group)
        return torch.cat(parts, dim=1)

    def _balanced(self, gates: list | None, mask: torch.Tensor) -> torch.Tensor | None:
        """The pass's load-balancing loss over the tokens where ``mask`` ``[rows, length]`` is 1 (its input's real
        tokens), from the router logits ``gates`` it returned; None when the pass asked for none."""
        return None if gates is None else self._balance(tuple(gates), mask.to(self.device))

    def _with_balance(self, loss: torch.Tensor, metrics: dict, f, global_tokens: int) -> tuple[torch.Tensor, dict]:
        """``loss`` plus ``engine.router_aux_loss_coef`` x the pass's load-balancing loss weighted by its share of
        the batch's loss tokens (so the micro-batches and ranks add up to the token-weighted mean), and the
        weighted term as ``<role>/router_aux_loss`` (summed over the passes like every ``..loss`` metric)."""
        if f.router_aux is None:
            return loss, metrics
        share = f.router_aux * (f.mask.sum() / max(global_tokens, 1))
        metrics = {**metrics, f"{self.prefix}/router_aux_loss": share.detach()}
        return loss + self.cfg.router_aux_loss_coef * share, metrics

