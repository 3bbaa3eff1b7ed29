"""Mixture-of-experts routing: find a model's routers, record the experts each token went to, replay them.

Routing replay (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers"). A mixture-of-experts layer sends each token to the ``k`` experts its router scores highest. The
generator and the trainer run the same weights with different kernels, batch shapes and precision, so near a
tie they pick different experts for the same token, and the trainer's log-probs (and the importance ratio
built on them) then come from another network than the one that sampled. R3 records the experts the rollout
chose for every token and makes the trainer's routers choose those: the gate weights are still the trainer's
own softmax (or sigmoid) at those experts, so the router keeps its gradient; only the top-k *selection* is
replayed. The earlier form (R2, GSPO's Routing Replay: Zheng et al. 2025) records the trainer's own choice in
its pi_old pass and replays it in the update passes, so later mini-batches route as pi_old did.

How, for any transformers MoE architecture: every router of transformers' MoE models (Qwen2/3-MoE, Qwen3-Next,
Qwen3.5-MoE, Mixtral, OLMoE, GPT-OSS, GraniteMoE, DeepSeek-V3, ...) is a module with ``top_k`` and an expert
count whose forward takes ``torch.topk`` of a ``[tokens, experts]`` score. :class:`Routing` hooks each router
and, during its forward only, intercepts that one top-k call (a :class:`~torch.overrides.TorchFunctionMode`):
recording keeps the chosen indexes; replaying returns the recorded indexes with the scores gathered at them, so
whatever the router does next (renormalise, softmax over the chosen, scale) runs on the replayed choice. A row
of ``-1`` keeps the router's own choice (padding, and the last token of a sequence, which no forward pass of the
generator routed). A router that never makes such a call fails loudly instead of running unreplayed.

Departure from the paper: R3 replays in every training forward pass of the policy (old log-probs and updates);
here the frozen reference routes on its own (it is another network, and its log-probs only enter the KL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from relayrl.errors import UserError

__all__ = ["ROUTES_COLUMN", "RoutingError", "RouterShape", "router_modules", "router_shape", "Routing", "laid_out",
           "per_row", "load_balancing"]

ROUTES_COLUMN = "routed_experts"
"""The dock column (and ``SequenceBatch.routes``) of each sample's routing: ``[prompt + response - 1, layers, k]``
int16, the experts the generator chose for every token it ran through the model (the last token is sampled,
never run)."""


class RoutingError(UserError, ValueError):
    """Routing replay was asked of a model it cannot replay (no router, routers of different shapes), or given
    routes that do not fit the model (another layer count, top-k or expert range)."""


@dataclass(frozen=True)
class RouterShape:
    """A model's routing: MoE layers (routers, in layer order), experts each token takes, experts per layer."""

    layers: int
    top_k: int
    experts: int


def _counts(m: nn.Module) -> tuple[int, int] | None:
    top_k = getattr(m, "top_k", None)
    experts = next((getattr(m, a) for a in ("num_experts", "n_routed_experts", "num_local_experts")
                    if isinstance(getattr(m, a, None), int)), None)
    if isinstance(top_k, int) and experts is not None and 0 < top_k <= experts:
        return top_k, experts
    return None


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` in layer order: the innermost modules holding ``top_k`` and an expert count
    (a sparse block that also holds ``top_k`` is the router's parent, not a router). Empty for a dense model."""
    found = [m for m in model.modules() if _counts(m) is not None]
    return [m for m in found if not any(c is not m and _counts(c) is not None for c in m.modules())]


def router_shape(model: nn.Module) -> RouterShape | None:
    """The routing of ``model`` (None: no routers, a dense model). All routers must agree on ``top_k`` and the
    expert count (every transformers MoE model does)."""
    mods = router_modules(model)
    if not mods:
        return None
    shapes = {_counts(m) for m in mods}
    if len(shapes) > 1:
        raise RoutingError(f"the model's routers differ in (top_k, experts): {sorted(shapes)}; routing replay "
                           "(algorithm.routing_replay) needs one shape for every layer")
    (top_k, experts), = shapes
    return RouterShape(len(mods), top_k, experts)


class _TopK(TorchFunctionMode):
    """Inside one router's forward: the ``torch.topk`` of a ``[tokens, experts]`` score with ``k = top_k``.
    ``replay`` ``[tokens, k]`` (``-1`` rows: the router's own choice) replaces the chosen indexes; ``chosen``
    keeps what the router chose itself (the last such call)."""

    def __init__(self, top_k: int, experts: int, replay: torch.Tensor | None, compare: bool = False) -> None:
        super().__init__()
        self.top_k, self.experts, self.replay, self.compare = top_k, experts, replay, compare
        self.chosen: torch.Tensor | None = None

    def _matches(self, args: tuple, kwargs: dict) -> bool:
        x = args[0] if args else kwargs.get("input")
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        return (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[-1] == self.experts and k == self.top_k
                and dim in (-1, 1))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk) or not self._matches(args, kwargs):
            return func(*args, **kwargs)
        scores = args[0] if args else kwargs["input"]
        if self.replay is not None and self.replay.shape[0] != scores.shape[0]:
            raise ValueError(f"routing replay: a router scored {scores.shape[0]} tokens but {self.replay.shape[0]} "
                             "recorded routes were given (the routes are not laid out like the forward's tokens)")
        values, chosen = func(*args, **kwargs)
        self.chosen = chosen
        if self.replay is None or self.compare:  # (compare: the router's own choice, counted against the routes)
            return torch.return_types.topk((values, chosen))
        own = self.replay[:, :1] < 0
        index = torch.where(own, chosen, self.replay.to(chosen.device, chosen.dtype))
        return torch.return_types.topk((scores.gather(-1, index), index))


class Routing:
    """Hooks on a model's routers (:func:`router_modules`) that record the experts each token is sent to
    (:meth:`record`) or make them choose given ones (:meth:`replay`; with ``compare``, only compare the given ones
    with the routers' own choices, which stand); idle otherwise. The hooks stay until :meth:`remove`.

    While replaying, the routers' own choices are compared with the replayed ones: :meth:`take_counts` gives
    how many replayed (token, expert) picks the trainer's routers would have made themselves, and of how many
    (their share is 1.0 when the generator and the trainer route alike; R3's "routing discrepancy" is one minus
    it)."""

    def __init__(self, model: nn.Module, *, compare: bool = False) -> None:
        self.compare = compare  # given routes are only compared with the routers' choices, not replayed
        self.routers = router_modules(model)
        shape = router_shape(model)
        if shape is None:
            raise RoutingError(f"routing replay (algorithm.routing_replay) needs a mixture-of-experts model; "
                               f"{type(model).__name__} has no router (a module with top_k and an expert count): "
                               "set algorithm.routing_replay=none")
        self.shape = shape
        self._replay: torch.Tensor | None = None  # [tokens, layers, k]
        self._recorded: list[torch.Tensor | None] | None = None
        self._agree = self._picks = None  # device scalars: matched picks, replayed picks
        self._modes: dict[int, _TopK] = {}
        self._handles = []
        for layer, m in enumerate(self.routers):
            self._handles.append(m.register_forward_pre_hook(self._enter(layer)))
            self._handles.append(m.register_forward_hook(self._exit(layer), always_call=True))

    def _enter(self, layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._replay is None and self._recorded is None:
                return
            replay = None if self._replay is None else self._replay[:, layer]
            mode = self._modes[layer] = _TopK(self.shape.top_k, self.shape.experts, replay, self.compare)
            mode.__enter__()
        return hook

    def _exit(self, layer: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            mode = self._modes.pop(layer, None)
            if mode is None:
                return
            mode.__exit__(None, None, None)
            if output is None:  # the forward raised (an always_call hook runs anyway): its error goes on
                return
            if mode.chosen is None:
                raise RuntimeError(f"routing: router {layer} ({type(module).__name__}) made no top-k choice over its "
                                   f"{self.shape.experts} experts that relayrl recognises; its routing cannot be "
                                   "recorded or replayed")
            if self._recorded is not None:
                self._recorded[layer] = mode.chosen.detach()
            if mode.replay is not None:
                self._count(mode.chosen.detach(), mode.replay)
        return hook

    def _count(self, own: torch.Tensor, replay: torch.Tensor) -> None:
        valid = (replay[:, 0] >= 0).to(own.device)
        e = self.shape.experts
        mine = torch.zeros(own.shape[0], e, device=own.device).scatter_(1, own, 1.0)
        theirs = torch.zeros_like(mine).scatter_(1, replay.clamp_min(0).to(own.device, torch.long), 1.0)
        agree = (mine * theirs)[valid].sum()
        picks = valid.sum() * self.shape.top_k
        self._agree = agree if self._agree is None else self._agree + agree
        self._picks = picks if self._picks is None else self._picks + picks

    def replay(self, routes: torch.Tensor | None) -> None:
        """Make the routers choose ``routes`` ``[tokens, layers, k]`` (the forward's tokens in the order its
        routers see them: ``[rows, length]`` flattened; ``-1`` rows keep the router's own choice) in every pass
        until the next call; None: route freely. It stays set through the backward pass, so activation
        checkpointing recomputes the same routing."""
        if routes is not None and tuple(routes.shape[1:]) != (self.shape.layers, self.shape.top_k):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}, expected [tokens, "
                             f"{self.shape.layers} MoE layers, top_k={self.shape.top_k}]")
        self._replay = routes

    def record(self) -> "_Recording":
        """A context whose passes keep each router's choice: ``with routing.record() as rec: model(...)``, then
        ``rec.routes()`` is ``[tokens, layers, k]`` (the last pass's tokens)."""
        return _Recording(self)

    def take_counts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(picks the routers would have made themselves, replayed picks)`` over the replayed passes since the
        last call, 0-d tensors on the device (no host read); None when nothing was replayed."""
        if self._picks is None:
            return None
        out = (self._agree, self._picks)
        self._agree = self._picks = None
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _Recording:
    def __init__(self, routing: Routing) -> None:
        self.routing = routing

    def __enter__(self) -> "_Recording":
        self.routing._recorded = [None] * self.routing.shape.layers
        return self

    def __exit__(self, *exc) -> None:
        self.recorded, self.routing._recorded = self.routing._recorded, None

    def routes(self) -> torch.Tensor:
        """``[tokens, layers, k]`` long: each router's choice in the last pass."""
        rec = getattr(self, "recorded", None) or self.routing._recorded
        missing = [i for i, r in enumerate(rec) if r is None]
        if missing:
            raise RuntimeError(f"routing: routers {missing} did not run in the recorded pass")
        return torch.stack(rec, dim=1)


def laid_out(routes: Sequence[torch.Tensor], seq_row: torch.Tensor, seq_pos: torch.Tensor,
             shape: RouterShape, tokens: Sequence[int] | None = None) -> torch.Tensor:
    """The routes of a forward's tokens: ``[P, L, layers, k]`` for a ``[P, L]`` input whose token ``[p, l]`` is
    token ``seq_pos[p, l]`` of batch row ``seq_row[p, l]`` (``-1``: padding), from each row's recorded
    ``routes[row]`` ``[tokens, layers, k]``; ``-1`` where a row has no route for the token (padding, a
    sequence's last token) so the router chooses itself there. Reads only the rows the pass holds. ``tokens``:
    each row's prompt + response length, which its routes may not exceed (they would be another sequence's). On
    ``seq_row``'s device."""
    row, pos = seq_row.cpu(), seq_pos.cpu()
    need = torch.unique(row[row >= 0]).tolist()
    for i in need:
        r = routes[i]
        if r.dim() != 3 or tuple(r.shape[1:]) != (shape.layers, shape.top_k):
            raise RoutingError(f"row {i}: routes of shape {tuple(r.shape)}, expected [tokens, {shape.layers} MoE "
                               f"layers, top_k={shape.top_k}] (were they recorded on another model?)")
        if tokens is not None and r.shape[0] > tokens[i]:
            raise RoutingError(f"row {i}: {r.shape[0]} routed tokens for a sequence of {tokens[i]} (prompt + "
                               f"response); the {ROUTES_COLUMN} column does not belong to these tokens")
    out = torch.full((*row.shape, shape.layers, shape.top_k), -1, dtype=torch.int16)
    if not need:
        return out.to(seq_row.device)
    flat = torch.cat([routes[i].to(torch.int16) for i in need])
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= shape.experts):
        bad = next(i for i in need if routes[i].numel() and (int(routes[i].min()) < 0
                                                            or int(routes[i].max()) >= shape.experts))
        raise RoutingError(f"row {bad}: routes name experts outside 0..{shape.experts - 1} (were they recorded on "
                           "another model?)")
    lengths = torch.zeros(max(need) + 1, dtype=torch.long)
    lengths[need] = torch.tensor([int(routes[i].shape[0]) for i in need])
    starts = torch.zeros_like(lengths)
    starts[need] = torch.cumsum(lengths[need], 0) - lengths[need]
    have = (row >= 0) & (pos < lengths[row.clamp_min(0)])
    out[have] = flat[(starts[row.clamp_min(0)] + pos)[have]]
    return out.to(seq_row.device)


def per_row(recorded: torch.Tensor, seq_row: torch.Tensor, seq_pos: torch.Tensor, units) -> dict[int, torch.Tensor]:
    """The inverse of :func:`laid_out`: each batch row's routes ``[prompt + response, layers, k]`` int16 from a
    pass's recorded ``[P, L, layers, k]``, for the rows of ``units`` (``PackUnit``s: a unit's rows share its
    prompt, whose tokens the pack holds once, under its first row)."""
    units = list(units)
    rows = [r for u in units for r in u.rows]
    lookup = torch.full((max(rows) + 1,), -1, dtype=torch.long)
    lookup[torch.tensor(rows)] = torch.arange(len(rows))
    width = max(u.prompt_len + max(u.response_lens, default=0) for u in units)
    table = torch.full((len(rows), width, *recorded.shape[2:]), -1, dtype=torch.int16)
    row, pos, rec = seq_row.cpu(), seq_pos.cpu(), recorded.cpu()
    have = row >= 0
    table[lookup[row[have]], pos[have]] = rec[have].to(torch.int16)
    out = {}
    for u in units:
        first = int(lookup[u.rows[0]])
        for r, n in zip(u.rows, u.response_lens):
            j = int(lookup[r])
            if j != first:  # the shared prompt's routes, recorded under the unit's first row
                table[j, :u.prompt_len] = table[first, :u.prompt_len]
            out[r] = table[j, :u.prompt_len + n].clone()
    return out


def load_balancing(model: nn.Module):
    """``balance(router_logits, mask)``: ``model``'s own load-balancing loss (its transformers module's
    ``load_balancing_loss_func``, Switch Transformer eqs. 4-6) of a pass's router logits (the decoder's
    ``output_router_logits``: one ``[tokens, experts]`` tensor per MoE layer) over the tokens where ``mask``
    (the pass's ``[rows, length]`` input) is 1. A model whose class computes none is refused."""
    import importlib

    fn = getattr(importlib.import_module(type(model).__module__), "load_balancing_loss_func", None)
    cfg = model.config
    experts = next((getattr(cfg, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(cfg, a, None), int)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if fn is None or experts is None or top_k is None:
        raise RoutingError(f"engine.router_aux_loss_coef adds a mixture-of-experts model's load-balancing loss; "
                           f"{type(model).__name__} computes none (no load_balancing_loss_func in its module, or no "
                           f"experts in its config): set engine.router_aux_loss_coef=0")

    def balance(router_logits: tuple, mask: torch.Tensor) -> torch.Tensor:
        if not router_logits:
            raise RuntimeError(f"{type(model).__name__}'s decoder returned no router logits "
                               "(output_router_logits=True)")
        return fn(tuple(router_logits), experts, top_k, mask)

    return balance

