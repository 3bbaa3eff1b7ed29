"""Data parallelism for the training engine: FSDP2 sharding and what it asks of the engine.

When the ranks of a worker group form a ``torch.distributed`` process group of
more than one rank, the engine shards its model with FSDP2 (``fully_shard``):
each decoder layer is one unit, the root takes the embeddings, final norm and
output head. Parameters, gradients and optimizer state then live as ``DTensor``
shards; each rank trains on its own rows. The loss is already normalised by
global token/sequence counts, so the exact gradient is the *sum* of the ranks'
gradients (Periodic Asynchrony §3); FSDP2 averages them, so the engine scales each
backward by the world size (a custom divide factor would need a pre-multiplied
sum, which gloo lacks).

FSDP2 gathers a unit's parameters collectively in every forward, so all ranks
must run the same number of forward (and backward) passes: :func:`max_over_ranks`
gives the count to pad to, and the engine runs the missing passes on a
micro-batch it already has with the loss multiplied by zero.

The root's hooks fire only when the root module itself is called. The engine
computes log-probs by running the decoder and then the output head on the
response positions only, so :class:`ResponseLogits` wraps both in one module
that is the FSDP2 root.

A LoRA model (:mod:`relayrl.models.lora`) is sharded the same way: its frozen base weights and trainable
adapters share each unit. FSDP2 reduce-scatters only the gradients that exist and asks one dtype only of a
unit's trainable parameters (a bf16 base with float32 adapters gathers its mixed dtypes as bytes).

Checkpoints use full (unsharded) state dicts with parameter names, through
``torch.distributed.checkpoint.state_dict``, at every world size; a run saved
on N ranks resumes on M.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from relayrl.models.load import decoder_layers
from relayrl.models.logits import LogitTransform

__all__ = ["ResponseLogits", "world_size", "shard_model", "max_over_ranks", "sum_over_ranks", "union_over_ranks",
           "reduce_over_ranks", "full_model_state", "full_optimizer_state", "load_full_state", "scalar", "decoder_layers"]


class ResponseLogits(nn.Module):
    """``model``'s output logits at chosen positions: the decoder runs on the whole input, the head only on
    ``hidden[rows, cols]`` (so prompt positions never get ``[L, V]`` logits). ``head_dtype``: the dtype of the
    head's matrix product (``torch.float32``: ``model.head_fp32``, :mod:`relayrl.models.head_precision`); None:
    the compute dtype, as the head's own forward runs it. ``transform``: what the model's forward does to the
    head's product before returning logits (:class:`relayrl.models.logits.LogitTransform`: Gemma's soft-capping,
    Cohere's and Granite's scales); None: nothing (a critic's value head)."""

    def __init__(self, model: nn.Module, head_dtype: torch.dtype | None = None,
                 transform: LogitTransform | None = None) -> None:
        super().__init__()
        self.model = model
        self.head_dtype = head_dtype
        self.transform = transform or LogitTransform()

    def forward(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor | None,
                rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor | None = None,
                temperature: float = 1.0, chunk: int = 0, with_entropy: bool = False, fused: bool = False,
                grad_by: str = "positions", with_sum_sq: bool = False, router_logits: list | None = None):
        """Logits ``[..., V]`` at ``(rows, cols)``; with ``targets`` (same shape as ``rows``) instead the
        log-probs of the targets and the entropy (or None), the head applied ``chunk`` positions at a time
        (:mod:`relayrl.engines.training.head`, its float32 steps compiled when ``fused``, its backward sliced
        by ``grad_by``), so no ``[..., V]`` tensor is kept; ``with_sum_sq`` adds a third output, each position's
        ``sum_v p_v^2``. ``router_logits``: a list that gets a mixture of experts' router logits, one
        ``[tokens, experts]`` tensor per MoE layer (the decoder's ``output_router_logits``)."""
        extra = {"output_router_logits": True} if router_logits is not None else {}
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=False, **extra)
        if router_logits is not None:
            router_logits.extend(out.router_logits or ())
        hidden = out.last_hidden_state
        head = self.model.get_output_embeddings()
        if targets is None:
            if self.head_dtype == torch.float32:
                from relayrl.models.head_precision import fp32_logits

                return self.transform(fp32_logits(hidden[rows, cols], head.weight, head.bias))
            return self.transform(head(hidden[rows, cols])).float()
        from relayrl.engines.training.head import chunked_token_logprobs

        picked = hidden[rows, cols]
        if self.transform.scale != 1.0:  # scale * (h W^T) = (scale * h) W^T: the chunked head needs no bias
            picked = picked * self.transform.scale
        out = chunked_token_logprobs(picked.reshape(-1, picked.shape[-1]), head.weight, targets.reshape(-1),
                                     temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                                     fused=fused, grad_by=grad_by, with_sum_sq=with_sum_sq,
                                     head_dtype=self.head_dtype, softcap=self.transform.softcap)
        return tuple(None if t is None else _shaped(t, targets.shape) for t in out)


def _shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` in ``shape`` and not a view: FSDP2 hooks the root's outputs for its backward, and an in-place op on
    a view would drop that hook (it warns of every view returned)."""
    return t if t.shape == shape else t.reshape(shape).clone()


def world_size() -> int:
    """Ranks of the default process group (1 when none is initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard_model(root: ResponseLogits, device: torch.device, compute_dtype: torch.dtype | None = None,
                expert_parallel: bool | int = False) -> bool:
    """Shard ``root`` (and its decoder layers) with FSDP2 over the default process group; False when
    there is nothing to shard over (one rank). With ``compute_dtype`` the sharded parameters keep their
    dtype (the master weights) and are gathered in ``compute_dtype`` for the passes; gradients are reduced
    in float32 (FSDP2's ``MixedPrecisionPolicy``). ``expert_parallel`` (``engine.expert_parallel``: true, or
    ranks per expert group): the experts are split over groups of consecutive ranks and tokens dispatched to
    them (:mod:`relayrl.engines.training.expert_parallel`), outside FSDP2's units."""
    n = world_size()
    if n == 1:
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (n,))
    policy = MixedPrecisionPolicy() if compute_dtype is None else \
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    ignored = None
    ep = n if expert_parallel is True else int(expert_parallel)
    if ep > 1:
        from relayrl.engines.training.expert_parallel import ExpertParallelError, shard_experts

        if n % ep:
            raise ExpertParallelError(f"engine.expert_parallel={ep} puts the {n} trainer ranks in groups of {ep}: "
                                      f"set it to a divisor of {n} (or true: one group of all of them)")
        experts_mesh = mesh if ep == n else init_device_mesh(device.type, (n // ep, ep),
                                                             mesh_dim_names=("replica", "expert"))
        ignored = shard_experts(root.model, experts_mesh, compute_dtype)
    for unit in [*decoder_layers(root.model), root]:
        fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    return True


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of ``params`` so that their global 2-norm is at most ``max_norm``; that norm before
    scaling, the same on every rank (a collective when sharded). ``torch.nn.utils.clip_grad_norm_`` when the
    gradients share one device mesh (or none); DTensors on several meshes (expert parallelism in several groups:
    the experts on their 2-D mesh, the rest on FSDP2's) cannot be stacked, so each mesh's norm is taken whole
    (its shards reduced over that mesh, replicas counted once) and the squares summed, as torchtitan does."""
    meshes: dict[int, list[nn.Parameter]] = {}
    for p in params:
        meshes.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    if len(meshes) <= 1:
        return scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = math.sqrt(sum(scalar(torch.nn.utils.get_total_norm([p.grad for p in ps])) ** 2
                         for ps in meshes.values()))
    coef = max_norm / (norm + 1e-6)  # (clip_grads_with_norm_'s; it cannot mix a plain norm with DTensor grads)
    if math.isfinite(norm) and coef < 1.0:
        for ps in meshes.values():
            torch._foreach_mul_([p.grad for p in ps], coef)
    return norm


def max_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` any rank holds (a collective; ``n`` itself with one rank)."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (a collective; ``values`` unchanged with one rank)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def rows_before(held: int, first_rank: int, device: torch.device) -> tuple[int, int]:
    """``(rows of the ranks before first_rank, rows of all ranks)`` from each rank's ``held`` rows, numbered in
    rank order (a collective; ``(0, held)`` with one rank). ``first_rank``: the first rank of this rank's
    replica (a sequence-parallel group's rows are held once, by its first rank: the others pass 0)."""
    if world_size() == 1:
        return 0, held
    counts = [0.0] * world_size()
    counts[dist.get_rank()] = float(held)
    counts = sum_over_ranks(counts, device)
    return int(sum(counts[:first_rank])), int(sum(counts))


def union_over_ranks(names: list[str]) -> list[str]:
    """The sorted union of every rank's ``names`` (a collective; ``names`` sorted with one rank)."""
    if world_size() == 1:
        return sorted(names)
    gathered: list[list[str] | None] = [None] * world_size()
    dist.all_gather_object(gathered, sorted(names))
    return sorted(set().union(*gathered))


def reduce_over_ranks(values: dict[str, float], how: dict[str, str], device: torch.device) -> dict[str, float]:
    """Combine named values over ranks: ``how[name]`` is ``max``, ``min``, or anything else for a sum.
    Every rank must hold the same names (a collective; ``values`` unchanged with one rank)."""
    if world_size() == 1:
        return dict(values)
    names = sorted(values)
    sign = [(-1.0 if how[k] == "min" else 1.0) for k in names]
    extreme = [how[k] in ("max", "min") for k in names]
    summed = sum_over_ranks([0.0 if e else values[k] for k, e in zip(names, extreme)], device)
    t = torch.tensor([s * values[k] if e else 0.0 for k, s, e in zip(names, sign, extreme)], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: s * x if e else y for k, s, e, x, y in zip(names, sign, extreme, t.tolist(), summed)}


def scalar(x: torch.Tensor) -> float:
    """A 0-d tensor or DTensor (e.g. a gradient norm under FSDP2) as a float, the same on every rank."""
    full = getattr(x, "full_tensor", None)
    return float(full() if callable(full) else x)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict on the CPU (rank 0; other ranks get ``{}``). Collective when sharded.
    ``trainable_only``: without the frozen parameters (not gathered; buffers stay)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(ignore_frozen_params=trainable_only))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (rank 0; others ``{}``). Collective when sharded."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options())


def full_model_state_everywhere(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on every rank, on the model's device. Collective when sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def mix_weights(model: nn.Module, named, alpha: float) -> None:
    """``model <- alpha * named + (1 - alpha) * model``, parameter by parameter (``named``: full tensors under the
    model's parameter names, the same on every rank; a plain or sharded model; a tied weight's other name takes
    its parameter's mix; buffers stay). Collective when sharded: every rank gathers the model's full state, mixes
    it and keeps its shard. A parameter ``named`` lacks is refused."""
    src = dict(named)
    by_id = {id(p): n for n, p in model.named_parameters()}
    param_of = {n: by_id[id(t)] for n, t in model.state_dict(keep_vars=True).items() if id(t) in by_id}
    missing = sorted({p for p in param_of.values() if p not in src})
    if missing:
        raise ValueError(f"mixing weights: the source lacks {len(missing)} of the model's parameters "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    own = full_model_state_everywhere(model)
    mixed = {n: (t.lerp(src[param_of[n]].to(t.device, t.dtype), alpha) if n in param_of else t)
             for n, t in own.items()}
    load_full_state(model, mixed)


def load_full_state(model: nn.Module, model_state: dict | None, optimizer: torch.optim.Optimizer | None = None,
                    optimizer_state: dict | None = None) -> tuple[list[str], list[str]]:
    """Load full state dicts (every rank passes the same) into a plain or sharded model; returns the
    (missing, unexpected) parameter names of the model state. Missing names keep the model's values; a tied
    weight is missing only when none of its names is in the state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from relayrl.models.load import absent_weights

    missing: list[str] = []
    unexpected: list[str] = []
    if model_state is not None:
        # set_model_state_dict with full state dicts fills what the state lacks with the model's own values
        # and so never reports a missing name: they are found here, before it runs.
        missing = absent_weights(model, model_state)
        keys = set_model_state_dict(model, model_state, options=_options(strict=False))
        unexpected = list(keys.unexpected_keys)
    if optimizer is not None and optimizer_state:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_options())
    return missing, unexpected
