"""FlexAttention for packed training passes: the shared-prompt mask as a block-sparse ``BlockMask``.

The SDPA route hands attention a dense ``[P, 1, L, L]`` boolean mask, and the
kernel computes every query-key pair of the pack before masking. A GRPO group
packed as ``[prompt, response_1, ..., response_n]`` (Periodic Asynchrony §4.2)
needs far fewer: each response sees the prompt and itself, so for n = 8
responses of 384 tokens after a 128-token prompt about a tenth of the pairs are
attended. PyTorch's FlexAttention (Dong et al. 2024, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels") takes a
``BlockMask``: per 128 x 128 tile, whether it is empty (skipped), full (no
mask evaluated) or partial (the ``mask_mod`` predicate evaluated per pair).

:func:`block_mask` builds that ``BlockMask`` from a packed batch's doc,
segment and position ids with exactly the predicate of
:func:`relayrl.models.packing.shared_prompt_mask` (also its sliding-window
variant): the tile classification is reduced from the dense predicate a slab of
query tiles at a time (``P * L * L`` bit tests, never stored whole), and
partial tiles evaluate :func:`relayrl.models.packing.shared_prompt_mask_mod`.
It is built once per micro-batch and shared by every layer.

:func:`flex_attention_forward` is the attention function the Hugging Face
model calls once :func:`install` registered it (transformers'
``AttentionInterface``) and switched the model to it; a model loaded with
``attn_implementation="flex_attention"`` gets it from the training engine.
Where it departs from transformers' own flex path: one module-level
``torch.compile(flex_attention)`` shared by every layer, pass and mode;
grouped-query attention through ``enable_gqa`` for any head ratio
(transformers repeats the key/value heads unless the query heads are a power
of two: 14 for Qwen2-0.5B); no log-sum-exp returned; inputs cast to the
autocast dtype. Inside a compiled decoder layer (``engine.compile``) the
uncompiled ``flex_attention`` is called and compiled with the layer.

Compiled shapes. Each distinct set of guards costs a compilation (tens of
seconds for a forward and backward kernel), and after eight torch.compile
falls back to the unfused implementation, so the engine keeps the shapes few.
It lays a micro-batch out as one row (batch size 1: the units of all its packed
rows in sequence, kept apart by the mask, so no row padding either), padded to
a multiple of the tile size (128) and to at least two tiles (a size of 1 would
be specialised). The function is compiled with dynamic shapes and
:func:`block_mask` marks the length and tile dimensions dynamic, so every
length reuses the first kernels: one compilation per mask kind (full, sliding
window) and grad mode, at most four. Padding tokens attend to themselves only.

CPU: FlexAttention is a CUDA route. On other devices the function calls
torch's unfused reference implementation (correct, as slow as dense
attention): torch 2.13 compiles CPU forward passes but miscompiles some
dynamic shapes, and has no CPU backward at all. :func:`backward_supported`
asks torch, and the engine refuses to train with flex on a device without a
backward; log-prob passes (a frozen reference) run. Tests check the tiles
against torch's own ``create_block_mask``, a compiled CPU kernel on them, and
log-probs and gradients on CPU through the reference implementation.
"""

from __future__ import annotations

import warnings

import torch

from relayrl.models.packing import shared_prompt_mask, shared_prompt_mask_mod

__all__ = ["BLOCK", "ATTN", "block_mask", "flex_attention_forward", "attend", "install", "is_flex",
           "backward_supported"]

BLOCK = 128
"""FlexAttention's tile (query and key block) size, and the multiple packed rows are padded to."""
ATTN = "relayrl_flex"
"""The attention implementation name registered with transformers for :func:`flex_attention_forward`."""
_SLAB = 1 << 26  # predicate tests per slab of query tiles in block_mask (a 64 MB boolean temporary)
_compiled = None


def is_flex(attn_implementation: str | None) -> bool:
    """Whether a model's attention implementation takes a ``BlockMask`` (transformers' flex or this module's)."""
    return attn_implementation in ("flex_attention", ATTN)


def block_mask(doc_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
               sliding_window: int | None = None, block: int = BLOCK, dynamic: bool = True):
    """The shared-prompt mask of a packed batch as a FlexAttention ``BlockMask`` over ``[P, 1, L, L]``.

    Args:
        doc_ids, segment_ids, position_ids: ``[P, L]`` from :class:`relayrl.models.packing.PackedBatch`
            (``position_ids`` needed only with ``sliding_window``), ``L`` a multiple of ``block``.
        sliding_window: drop keys ``>= sliding_window`` positions behind the query, as
            :func:`relayrl.models.packing.shared_prompt_mask` does.
        dynamic: mark the length and tile dimensions (of the mask and of these ids, which the mask reads)
            dynamic for ``torch.compile``, so the first compilation serves every length.
    Returns: a ``BlockMask`` whose tiles are empty, full or partial exactly as the dense mask's are; partial
        tiles evaluate :func:`relayrl.models.packing.shared_prompt_mask_mod`.
    """
    from torch.nn.attention.flex_attention import BlockMask

    P, L = doc_ids.shape
    if L % block:
        raise ValueError(f"packed length {L} is not a multiple of the block size {block} (PackedBatch.pad_to)")
    if sliding_window is not None and position_ids is None:
        raise ValueError("sliding_window needs position_ids")
    n = L // block
    step = max(1, _SLAB // max(1, P * block * L))  # query tiles per slab
    partial, full = [], []
    for s in range(0, n, step):
        rows = slice(s * block, min(n, s + step) * block)
        ok = shared_prompt_mask(doc_ids, segment_ids, position_ids, sliding_window=sliding_window, queries=rows)
        ok = ok.view(P, -1, block, n, block)
        some, every = ok.any(dim=4).any(dim=2), ok.all(dim=4).all(dim=2)  # [P, tiles in slab, n]
        partial.append(some & ~every)
        full.append(every)
    pos = position_ids if sliding_window is not None else None
    mod = shared_prompt_mask_mod(doc_ids, segment_ids, pos, sliding_window=sliding_window)
    mask = BlockMask.from_kv_blocks(*_ordered(torch.cat(partial, 1)), *_ordered(torch.cat(full, 1)),
                                    BLOCK_SIZE=block, mask_mod=mod, seq_lengths=(L, L))
    if not dynamic:
        return mask
    for t in (doc_ids, segment_ids, pos):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    for t in mask.as_tuple(flatten=False):
        if isinstance(t, torch.Tensor) and t.dim() > 2:
            torch._dynamo.maybe_mark_dynamic(t, list(range(2, t.dim())))
    return mask


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, n, n]`` tile flags -> (count ``[P, 1, n]``, key-tile indexes ``[P, 1, n, n]`` with the set ones
    first, ascending), the int32 layout of ``BlockMask``."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None].contiguous(), order[:, None].contiguous()


# 64 x 64 tiles in the compiled kernels (the mask keeps its 128-token blocks), and IS_DIVISIBLE: packed rows are
# padded to a multiple of BLOCK (block_mask checks it), so the kernels skip their bounds checks. Measured on an
# H100 with the Qwen2-0.5B shape (64-dim heads, 14 query / 2 key-value heads, groups of 128 + 8 x 384 tokens):
# the default tiles 0.377 s an update, 64 x 64 0.350 s; IS_DIVISIBLE 0.269 s against 0.298 s on the fastest
# variant (benchmarks/gpu.py --only train, 2026-11-27)
CUDA_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "IS_DIVISIBLE": True}

# Grouped-query attention: False hands the kernel the key/value heads as they are (enable_gqa); True repeats
# them to the query heads first. The backward's key/value pass runs one program per key tile and key/value
# head, walking every query that attends the tile for each query head of its group: with a shared prompt, the
# prompt's tile is attended by every response of the group, and with enable_gqa that program walks them seven
# times over (Qwen2-0.5B's 14 / 2 heads) while the others wait. Repeated heads give each query head its own
# program (the repeat's backward sums the seven gradients). Measured on an H100 (2026-11-27, benchmarks/gpu.py
# --only train, the fastest variant with IS_DIVISIBLE): 0.256 s an update against 0.269 s, MFU 30.4% against
# 28.9%, for 1.1 GB more peak memory.
EXPAND_KV = True


def _kernel(query: torch.Tensor):
    """The ``flex_attention`` to call. On CUDA: compiled once per process with dynamic shapes (the fused
    block-sparse kernels; see the module docstring), or uncompiled inside a graph being compiled (it is traced
    into that graph). Elsewhere: torch's unfused reference implementation (dense scores, the mask predicate on
    every pair), since torch 2.13's compiled CPU kernel has no backward and miscompiles some dynamic shapes."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def flex_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``query [B, Hq, L, D]``, ``key``/``value [B, Hkv, L, D]`` and a
    ``BlockMask`` -> (``[B, L, Hq, D]``, no attention weights)."""
    from torch.nn.attention.flex_attention import BlockMask

    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by {ATTN}; set the model's "
                         "attention_dropout to 0")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{ATTN} applies no logit soft-capping or attention sinks; load this model with "
                         "attn_implementation='eager' (transformers' SDPA path drops the cap too)")
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"{ATTN} takes a BlockMask (relayrl.engines.training.flex.block_mask), got "
                        f"{type(attention_mask).__name__}")
    return attend(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, scaling: float | None) -> torch.Tensor:
    """FlexAttention of ``query [B, Hq, L, D]`` over ``key``/``value [B, Hkv, L, D]`` under the ``BlockMask``
    ``mask``: ``[B, Hq, L, D]`` in the autocast dtype (or the query's). What :func:`flex_attention_forward`
    and the Ulysses attention (:mod:`relayrl.engines.training.ulysses`, on its head shard) call."""
    kind = query.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    if gqa and EXPAND_KV:  # query head h reads key/value head h // (Hq / Hkv), as enable_gqa maps them
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    with torch.autocast(kind, enabled=False):  # inputs cast already; the kernel needs no autocast rule
        return _kernel(q)(q, k, v, block_mask=mask, scale=scaling, enable_gqa=gqa,
                          kernel_options=CUDA_KERNEL_OPTIONS if q.is_cuda else None)


def install(model: torch.nn.Module) -> None:
    """Register :func:`flex_attention_forward` with transformers (as :data:`ATTN`, with transformers' flex
    mask builder for the masks the model makes itself) and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN, flex_attention_forward)
    AttentionMaskInterface.register(ATTN, ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"])
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(ATTN)
    else:
        model.config._attn_implementation = ATTN


def backward_supported(device: torch.device) -> bool:
    """Whether torch's ``flex_attention`` has a backward pass on ``device`` (asked with a tiny call; CUDA has
    one, CPU has none as of torch 2.13)."""
    if device.type == "cuda":
        return True
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, BLOCK, 16, device=device, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True
