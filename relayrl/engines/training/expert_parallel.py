"""Expert parallelism for the training engine (``engine.expert_parallel``): every mixture-of-experts layer's
experts split whole over a group of the data-parallel ranks, and each token sent to the rank of its group that
holds its expert and back.

Under FSDP2 alone a rank all-gathers a layer's experts before the layer runs (every expert's weights, on every
rank, for a few tokens each). With expert parallelism the weights stay and the tokens move (GShard's dispatch
and combine, DeepSpeed-MoE's and Megatron's expert parallelism). The ``W`` ranks form ``W / e`` expert groups of
``e`` consecutive ranks (``engine.expert_parallel=e``; true: one group of all ``W``); each group holds every
expert: its rank ``r`` holds experts ``[r c, (r + 1) c)`` (``c = ceil(E / e)``, ``torch.chunk``'s split), and a
layer's forward

1. sorts its ``(token, slot)`` pairs by the rank of its group that holds the pair's expert and tells every rank
   of the group how many it sends (one all-to-all of counts, on the group's process group);
2. sends each pair's hidden state and local expert index (all-to-all), runs the model's own experts forward
   (transformers' experts module, eager or grouped products, with this rank's experts only) on what it
   received, with weight 1;
3. sends the outputs back (all-to-all: its backward is the reverse exchange) and sums each token's pairs,
   weighted by the router's weights, where the token lives.

The expert tensors are ``DTensor`` row shards left out of FSDP2's units (``ignored_params``): with one group,
``Shard(0)`` on FSDP2's own mesh, as FSDP2 would lay them out; with several, on a 2-D mesh ``(replica, expert)``
placed ``(Replicate(), Shard(0))`` (DeepSpeed-MoE's expert-data parallelism; torchtitan lays its experts out
so). Checkpoints and the weight relay's gather read them as they read FSDP2's shards (``full_tensor`` gathers
one group's shards), and the gradient-norm clip sums the squares per mesh (:func:`relayrl.engines.training.
fsdp.clip_grad_norm`). A rank's expert gradients arrive whole from its group's tokens; the engine scales each
backward by the world size for FSDP2's average, and the expert shards take that factor back here, so a group
holds its own tokens' share of the gradient and :func:`reduce_replicas` sums the ``W / e`` replicas' shares
before the clip (one all-reduce per tensor and step, on the replica process group): every replica then holds
the whole batch's gradient, as one group would. Every rank runs the same passes already (FSDP2 needs it), so
every rank joins each layer's exchanges, in the backward too: a rank that receives no pair still puts what it
received (nothing) and its experts into its output with weight zero, so its backward runs the reverse exchange
its senders wait in, and its experts get a (zero) gradient, so every rank's clip, replica sum and optimizer see
the same tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from relayrl.errors import UserError

__all__ = ["ExpertParallelError", "expert_modules", "dispatch_of", "shard_experts", "reduce_replicas", "load_imbalance"]


class ExpertParallelError(UserError, ValueError):
    """``engine.expert_parallel`` on a model it cannot split; the message names the key and the fix."""


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The fused experts modules of ``model`` (transformers' ``*.experts`` holding ``num_experts`` and tensors
    whose first dimension is the experts; not a router, which holds ``top_k``), by name; split ones too."""
    found = []
    for name, m in model.named_modules():
        split = dispatch_of(m)
        n = split.experts if split is not None else getattr(m, "num_experts", None)
        own = list(m.parameters(recurse=False))
        if (name.rsplit(".", 1)[-1] == "experts" and isinstance(n, int) and not hasattr(m, "top_k") and own
                and all(p.dim() >= 2 and p.shape[0] == n for p in own)):
            found.append((name, m))
    return found


def dispatch_of(module: nn.Module) -> "_Dispatch | None":
    """The dispatching forward `shard_experts` gave ``module``, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, _Dispatch) else None


def shard_experts(model: nn.Module, mesh, compute_dtype: torch.dtype | None) -> set[nn.Parameter]:
    """Split every experts module of ``model`` over ``mesh`` (every rank holding the same full weights) and give
    it the dispatching forward; the expert parameters, for FSDP2 to leave alone. ``mesh``: 1-D, one expert group
    of all its ranks, or 2-D ``(replica, expert)``, a group per row, each expert shard replicated down a column.
    ``compute_dtype``: the dtype the local experts run in (FSDP2's mixed precision for the other parameters),
    None: their own."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    modules = expert_modules(model)
    if not modules:
        raise ExpertParallelError(f"engine.expert_parallel splits a mixture of experts' experts, and "
                                  f"{type(model).__name__} has none (no fused mlp.experts tensors): set "
                                  f"engine.expert_parallel=false")
    ep = mesh.ndim - 1  # the expert dimension (the last)
    size, rank = mesh.size(ep), mesh.get_local_rank(ep)
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    replicas = mesh.get_group(0) if mesh.ndim == 2 else None
    fewest = min(m.num_experts for _, m in modules)
    if size > fewest:
        fits = [d for d in range(2, fewest + 1) if mesh.size() % d == 0]
        raise ExpertParallelError(f"engine.expert_parallel splits each layer's experts whole over a group of {size} "
                                  f"ranks, and {type(model).__name__} has {fewest} experts a layer, so some ranks "
                                  f"would hold none: set engine.expert_parallel to "
                                  + (f"one of {', '.join(map(str, fits))}" if fits else "false")
                                  + f" (ranks per group, dividing the {mesh.size()} ranks)")
    ignored: set[nn.Parameter] = set()
    for _, m in modules:
        experts = m.num_experts
        per_rank = -(-experts // size)
        for name, p in list(m.named_parameters(recurse=False)):
            local = p.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            shard = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
            param = nn.Parameter(shard, requires_grad=p.requires_grad)
            setattr(m, name, param)
            ignored.add(param)
        m.num_experts = max(0, min(experts, (rank + 1) * per_rank) - rank * per_rank)  # what its forward runs
        m.forward = _Dispatch(m, experts, per_rank, mesh.get_group(ep), replicas, compute_dtype)
    return ignored


def reduce_replicas(model: nn.Module) -> None:
    """Sum each expert shard's gradient over its replicas (the same shard in every expert group: module
    docstring); nothing with one group. A collective over every rank (each calls it once a step, before the
    clip); a frozen expert (no gradient) is skipped on every rank alike."""
    for _, m in expert_modules(model):
        d = dispatch_of(m)
        if d is None or d.replicas is None:
            continue
        for p in m.parameters(recurse=False):
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local(), group=d.replicas)


def load_imbalance(model: nn.Module, device: torch.device) -> float | None:
    """How unevenly the experts' ranks were loaded in the training passes since the last call: the most
    ``(token, expert)`` pairs a rank received over their mean over all ranks (1.0: even; ``e``: one rank of each
    group got them all). None without expert parallelism or with no pair. A collective (every rank calls it)."""
    dispatches = [d for _, m in expert_modules(model) if (d := dispatch_of(m)) is not None]
    if not dispatches:
        return None
    total = torch.tensor([float(sum(d.received for d in dispatches))], dtype=torch.float64, device=device)
    for d in dispatches:
        d.received = 0
    most = total.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    return float(most) / (float(total) / dist.get_world_size()) if float(total) else None


class _Dispatch:
    """An experts module's forward under expert parallelism (module docstring): ``(hidden [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H]``, as the module's own forward returns."""

    def __init__(self, module: nn.Module, experts: int, per_rank: int, group, replicas,
                 compute_dtype: torch.dtype | None):
        self.module, self.experts, self.per_rank, self.group = module, experts, per_rank, group
        self.replicas = replicas  # the process group of this rank's shard in every expert group (None: one group)
        self.world = dist.get_world_size(group)  # ranks of this rank's expert group
        self.scale = 1.0 / dist.get_world_size()  # (the engine scales each backward by every rank's count)
        self.compute_dtype = compute_dtype
        self.received = 0  # pairs received by the passes with gradients since load_imbalance last read them

    @torch.compiler.disable  # (engine.compile: the exchanges' sizes are data, a recompile each pass if traced)
    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd as exchange

        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        owner = torch.div(flat, self.per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_n, recv_n = send.tolist(), recv.tolist()
        if torch.is_grad_enabled():
            self.received += sum(recv_n)
        local_ids = (flat - owner * self.per_rank)[order]
        ids_in = local_ids.new_empty(sum(recv_n))
        dist.all_to_all_single(ids_in, local_ids, recv_n, send_n, group=self.group)
        x = hidden[torch.div(order, k, rounding_mode="floor")]
        x_in = exchange(x, recv_n, send_n, self.group)
        y_in = self._local_experts(x_in, ids_in)
        y = exchange(y_in, send_n, recv_n, self.group)
        pairs = y.new_empty(y.shape).index_copy(0, order, y).view(tokens, k, -1)
        return (pairs * top_k_weights[..., None].to(pairs.dtype)).sum(1).to(hidden.dtype)

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The module's own forward over this rank's experts (its parameters swapped for their local shards)."""
        m = self.module
        saved = dict(m._parameters)
        local = {n: self._local(p) for n, p in saved.items()}
        try:
            m._parameters.update(local)
            out = type(m).forward(m, x, ids[:, None], torch.ones(len(ids), 1, dtype=x.dtype, device=x.device))
        finally:
            m._parameters.update(saved)
        if not len(ids) and torch.is_grad_enabled():  # no pair came (module doc): the backward still runs the
            # exchange that brought ``x`` (its senders wait for the gradients), and the experts get a zero one
            out = out + (x.sum() + sum(t.sum() for t in local.values() if t.requires_grad)) * 0.0
        return out

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        t = p.to_local()
        if p.requires_grad and torch.is_grad_enabled():
            t = _ScaleGrad.apply(t, self.scale)
        return t if self.compute_dtype is None else t.to(self.compute_dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (the world-size factor the engine adds for FSDP2's mean)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
