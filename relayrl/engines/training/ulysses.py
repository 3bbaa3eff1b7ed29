"""Ulysses sequence parallelism for the training engine (``engine.sequence_parallel``).

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations
for Enabling Training of Extreme Long Sequence Transformer Models") splits a
sequence over ``sp`` ranks. Every layer but attention is position-wise, so each
rank runs it on its ``L / sp`` tokens; attention needs every token, so around
it an all-to-all turns the sequence-sharded query, key and value
``[B, H, L/sp, D]`` into head-sharded ``[B, H/sp, L, D]``, attention runs over
the whole (packed, masked) sequence for ``H / sp`` heads, and a second
all-to-all turns the output back. Activations per rank shrink by ``sp``
(attention's own working set keeps ``L`` but loses heads).

How the engine uses it::

    ranks 0..W-1 = dp groups of sp consecutive ranks (an SP group sits on one node)

    pool       each SP rank's rows -> all_gather_object -> the SP group's batch, the same on every SP rank
    pack       the engine packs that batch as it would on one rank; the packed length L is padded to a
               multiple of sp; rank r keeps columns [r L/sp, (r+1) L/sp) of the ids and the *global*
               position ids (rotary sees true positions); the 4-D mask stays whole ([P, 1, L, L], or
               FlexAttention's BlockMask of the pack's tiles), since attention runs over all L queries after
               the all-to-all
    attention  :func:`ulysses_attention_forward`, registered with transformers as :data:`ATTN` (SDPA) or
               :data:`ATTN_FLEX` (a model on FlexAttention: the kernel runs on the rank's head shard)
    head       log-probs (a critic: values) of the response tokens whose predicting position is local;
               the next-token targets were fixed at packing, before the split
    gather     :meth:`Shard.gather`: every rank gets all N response tokens in packing order, so the
               loss, its counts and the returned log-probs are exactly one rank's

Gradients. Every SP rank computes the same loss from the same gathered tensor,
so the gather's backward hands each rank the gradient of its own tokens without
a reduction; the all-to-all's backward is the inverse all-to-all. A parameter's
gradient on an SP rank is then the part of the full gradient that flows through
that rank's tokens, and their sum over the group is the full gradient. FSDP2
shards over the whole world (one 1-D mesh of ``dp x sp`` ranks: the parameters
and the optimizer state spread over every rank, the least memory; a 2-D mesh
would only change which ranks hold which shard) and averages the gradients, so
the engine still scales each backward by the world size; the global token and
sequence counts and the metrics are counted once per SP group (its first rank's
figures, the others add zeros).

Where it departs from verl (which patches flash-attention's varlen path and
slices ``input_ids`` after removing padding): the mask is relayrl's shared-prompt
mask through PyTorch SDPA, so a prompt shared by a group's responses is
computed once under sequence parallelism too; key/value heads fewer than (or
not divisible by) ``sp`` are repeated to the query heads before the
all-to-all (verl repeats them just enough to reach ``sp``: less traffic, same
result); and the rows reach the SP group unsplit by the driver and are pooled
here, so the cluster layer does not know about sequence parallelism. Gloo has
``all_to_all_single`` on CPU, so the CPU tests run the same collective as NCCL.
Gradient checkpointing reruns the all-to-alls in the backward pass (every SP
rank recomputes in the same order); ``engine.compile`` compiles the layers
around them (checked by hand on CPU: the same log-probs and gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relayrl.errors import SettingError

__all__ = ["ATTN", "ATTN_FLEX", "SequenceParallel", "Shard", "setup", "check_model", "install",
           "ulysses_attention_forward", "all_to_all", "pool"]

ATTN = "relayrl_ulysses_sdpa"
"""The attention implementation name registered with transformers for :func:`ulysses_attention_forward` (SDPA
over the dense mask)."""
ATTN_FLEX = "relayrl_ulysses_flex"
"""The same function's name for a model on FlexAttention (the engine's ``BlockMask``; transformers' flex mask
builder for masks the model makes itself)."""


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` consecutive ranks of the world, this one the ``rank``-th."""

    size: int
    rank: int
    group: object
    """The ``torch.distributed`` process group of the SP ranks."""

    @property
    def leads(self) -> bool:
        """Whether this rank reports the group's counts and metrics (the others add zeros)."""
        return self.rank == 0


def setup(size: int) -> SequenceParallel | None:
    """The SP groups of the default process group, ``size`` consecutive ranks each (a collective: every rank
    creates every group); None for ``size == 1``. The world must be a multiple of ``size``."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % size:
        raise SettingError(f"engine.sequence_parallel={size} must divide the trainer group's {world} ranks (each "
                           f"data-parallel replica is {size} ranks); set cluster.devices (x cluster.nodes) to a "
                           f"multiple of {size}, or lower engine.sequence_parallel")
    me = dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= me < start + size:
            mine = SequenceParallel(size, me - start, group)
    return mine


def check_model(model, size: int) -> None:
    """Refuse a model the Ulysses attention cannot split: query heads not divisible by ``size``, or an
    attention implementation other than SDPA or FlexAttention."""
    from relayrl.engines.training import flex

    conf = model.config
    impl = getattr(conf, "_attn_implementation", None)
    if impl not in ("sdpa", ATTN, ATTN_FLEX) and not flex.is_flex(impl):
        raise SettingError(f"engine.sequence_parallel={size} runs attention through PyTorch SDPA over the packed mask "
                           f"or FlexAttention over its tiles; the model is loaded with "
                           f"attn_implementation={impl!r}: set model.attn_implementation=sdpa or flex_attention "
                           f"(or engine.sequence_parallel=1)")
    heads = getattr(conf, "num_attention_heads", None)
    if not heads or heads % size:
        raise SettingError(f"engine.sequence_parallel={size} gives each rank 1/{size} of the attention heads, but the "
                           f"model has {heads} query heads: set engine.sequence_parallel to a divisor of {heads}")


def install(model, sp: SequenceParallel) -> None:
    """Register :func:`ulysses_attention_forward` with transformers (as :data:`ATTN`, with SDPA's mask builder)
    and switch ``model`` to it; every attention module learns its SP group."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from relayrl.engines.training import flex

    check_model(model, sp.size)
    on_flex = flex.is_flex(getattr(model.config, "_attn_implementation", None)) or \
        getattr(model.config, "_attn_implementation", None) == ATTN_FLEX
    name = ATTN_FLEX if on_flex else ATTN
    AttentionInterface.register(name, ulysses_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flex_attention" if on_flex else "sdpa"])
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]
    expected = getattr(model.config, "num_hidden_layers", None)
    if not layers or (expected is not None and len(layers) != expected):
        raise SettingError(f"engine.sequence_parallel: found {len(layers)} attention modules in "
                           f"{type(model).__name__} (expected {expected}, one per decoder layer)")
    for m in layers:
        m.sequence_parallel = sp
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name


# ------------------------------------------------------------------------------------------ all-to-all
def _all_to_all(x: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
    """Cut ``x`` into ``size`` chunks along ``scatter``, send chunk j to rank j, and concatenate the chunks
    received along ``gather`` in rank order."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter: int, gather: int, group):
        ctx.dims, ctx.group = (scatter, gather), group
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad):  # the inverse exchange: chunks go back where they came from
        scatter, gather = ctx.dims
        return _all_to_all(grad.contiguous(), gather, scatter, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter: int, gather: int, sp: SequenceParallel) -> torch.Tensor:
    """Differentiable all-to-all over the SP group: ``x``'s dim ``scatter`` shrinks ``sp.size``-fold, dim
    ``gather`` grows ``sp.size``-fold (e.g. heads -> sequence: ``[B, H, L/sp, D]`` -> ``[B, H/sp, L, D]``
    with ``scatter=1, gather=2``)."""
    if x.shape[scatter] % sp.size:
        raise ValueError(f"all_to_all: dim {scatter} of {tuple(x.shape)} is not a multiple of {sp.size}")
    return _AllToAll.apply(x, scatter, gather, sp.group)


def ulysses_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention contract on a sequence shard: ``query`` ``[B, H, L/sp, D]``, ``key``/``value``
    ``[B, KV, L/sp, D]``, ``attention_mask`` the whole ``[B, 1, L, L]`` mask (boolean or additive, for SDPA; a
    ``BlockMask`` over all ``L``, for FlexAttention); returns ``[B, L/sp, H, D]``. Key/value heads are repeated
    to the query heads first unless ``KV`` is a multiple of ``sp``."""
    from torch.nn.attention.flex_attention import BlockMask

    sp: SequenceParallel = module.sequence_parallel
    tiles = isinstance(attention_mask, BlockMask)
    if attention_mask is None or len(attention_mask.shape) != 4:
        raise RuntimeError("Ulysses attention runs on the training engine's packed passes, which hand it the "
                           "whole 4-D mask; this call has none")
    for name in ("softcap", "s_aux"):  # (a sliding window is in the mask already)
        if kwargs.get(name) is not None:
            raise SettingError(f"engine.sequence_parallel: the model's attention uses {name}, which relayrl's "
                               f"Ulysses attention (plain SDPA) does not compute: set engine.sequence_parallel=1")
    heads, kv = query.shape[1], key.shape[1]
    if kv % sp.size:  # too few key/value heads to split: repeat them to the query heads (GQA's own mapping)
        key, value = key.repeat_interleave(heads // kv, dim=1), value.repeat_interleave(heads // kv, dim=1)
        kv = heads
    q, k, v = (all_to_all(t, 1, 2, sp) for t in (query, key, value))  # [B, heads/sp, L, D]
    if tiles:  # FlexAttention over the head shard (it maps grouped key/value heads itself)
        from relayrl.engines.training import flex

        if dropout:
            raise ValueError(f"attention dropout {dropout} is not supported by FlexAttention; set the model's "
                             "attention_dropout to 0")
        out = flex.attend(q, k, v, attention_mask, scaling)
        return all_to_all(out.transpose(1, 2), 1, 2, sp).contiguous(), None
    if kv != heads:
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling)
    return all_to_all(out.transpose(1, 2), 1, 2, sp).contiguous(), None  # [B, L, heads/sp, D] -> [B, L/sp, H, D]


# ------------------------------------------------------------------------------------------- shards
class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, index: list, rank: int, group):
        ctx.own = index[rank]
        counts = [int(i.numel()) for i in index]
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[:counts[rank]] = local
        parts = [torch.empty_like(padded) for _ in index]
        dist.all_gather(parts, padded.contiguous(), group=group)
        out = local.new_zeros((sum(counts), *local.shape[1:]))
        for i, part, n in zip(index, parts, counts):
            out[i] = part[:n]
        return out

    @staticmethod
    def backward(ctx, grad):  # every SP rank's loss is the same function of ``out``: keep its own tokens' share
        return grad[ctx.own], None, None, None


@dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s share of a packed batch: its columns of the ids and positions, the response tokens whose
    predicting position it holds (``rows``/``cols`` in its local columns), and where every rank's tokens go in
    the packed batch's ``[N]`` order (``index``)."""

    input_ids: torch.Tensor
    """[P, L/sp]"""
    position_ids: torch.Tensor
    """[P, L/sp] the global position ids of those columns."""
    rows: torch.Tensor
    """[N_r] packed row of each local response token's predicting position."""
    cols: torch.Tensor
    """[N_r] its local column."""
    targets: torch.Tensor
    """[N_r] the token it predicts."""
    index: tuple[torch.Tensor, ...]
    """Per SP rank: the indexes into ``[N]`` of its tokens."""
    sp: SequenceParallel

    @classmethod
    def of(cls, pb, sp: SequenceParallel) -> "Shard":
        """Cut a packed batch (:class:`relayrl.models.packing.PackedBatch`) for ``sp.rank``; its length ``L``
        must be a multiple of ``sp.size``."""
        input_ids, position_ids, token_pack, token_src = pb.input_ids, pb.position_ids, pb.token_pack, pb.token_src
        L = input_ids.shape[1]
        if L % sp.size:
            raise ValueError(f"packed length {L} is not a multiple of engine.sequence_parallel={sp.size}")
        width = L // sp.size
        owner = token_src // width
        index = tuple(torch.nonzero(owner == r).flatten() for r in range(sp.size))
        own = index[sp.rank]
        cols = slice(sp.rank * width, (sp.rank + 1) * width)
        return cls(input_ids[:, cols], position_ids[:, cols], token_pack[own], token_src[own] - sp.rank * width,
                   pb.targets[own], index, sp)

    def gather(self, local: torch.Tensor | None) -> torch.Tensor | None:
        """Every SP rank's ``[N_r, ...]`` per-token values as one ``[N, ...]`` tensor in packing order, on every
        rank (differentiable: the backward keeps this rank's tokens' gradient, see the module docstring)."""
        if local is None:
            return None
        return _GatherTokens.apply(local, list(self.index), self.sp.rank, self.sp.group)


def pool(batch, sp: SequenceParallel):
    """The SP group's rows as one batch, the same on every SP rank (ranks' rows in rank order), and this
    rank's rows in it (a ``range``). A collective over the SP group."""
    from relayrl.engines.training.base import SequenceBatch

    parts: list = [None] * sp.size
    dist.all_gather_object(parts, batch, group=sp.group)
    start = sum(len(p) for p in parts[:sp.rank])
    nonempty = [p for p in parts if len(p)] or parts[:1]
    return SequenceBatch.concat(nonempty), range(start, start + len(batch))
